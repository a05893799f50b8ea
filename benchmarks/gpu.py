"""The GPU variant of the benchmark: several models sharing one card under a memory budget.

One router serves three models on cuda:0 (two ResNet18s and YOLOv8n) while one load generator
per model drives it, closed loop, all at once. Meanwhile NVML is read every 20 ms (the device's
used memory, and the server process's own) and /metrics every 200 ms. Reported: throughput and
latency per model, the direct-loop limit of ResNet18 on the card, the ledger's peak
(`model_router_ledger_peak_bytes`) beside NVML's peak, and whether memory ever crossed the budget.
Skips (exit 0) without CUDA. Unverified on real hardware when written: no GPU was lent.

    python -m benchmarks.gpu [--out benchmarks/results/gpu] [--seconds 20] [--budget-gib 6]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.systems import Server, serve_router
from benchmarks.workloads import REPO, WORKLOADS

__all__ = ["main"]

MODELS = {  # name: (plugin, options, max batch, body file, content type)
    "resnet_a": ("resnet", {"arch": "resnet18", "weights": "resnet18.pt"}, 32, "examples/street.jpg", "image/jpeg"),
    "resnet_b": ("resnet", {"arch": "resnet18", "weights": "resnet18.pt"}, 32, "examples/street.jpg", "image/jpeg"),
    "yolo": ("yolo", {"model": "yolov8n.pt", "imgsz": 640}, 16, "examples/street.jpg", "image/jpeg"),
}
CONCURRENCY = 64


def fleet(store: Path, budget_gib: float) -> str:
    lines = [f"model_store: {store}", "devices:", "  cuda:0:", f"    memory_budget: {budget_gib}GiB",
             "    probe: nvml", "    poll_interval_ms: 20", "models:"]
    for name, (plugin, options, batch, _, _) in MODELS.items():
        lines += [f"  {name}:", f"    plugin: {plugin}", "    device: cuda:0", f"    options: {json.dumps(options)}",
                  "    queue: {max_size: 256, timeout_ms: 10000}", f"    batch: {{max_size: {batch}, max_delay_ms: 5}}"]
    return "\n".join(lines) + "\n"


class NvmlSampler(threading.Thread):
    """Peak NVML readings: the whole device's used bytes, and the server process's own."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        import pynvml

        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.pid = pid
        self.device_peak = 0
        self.process_peak = 0
        self.done = threading.Event()

    def read(self) -> tuple[int, int]:
        used = int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)
        mine = sum(int(p.usedGpuMemory or 0) for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
                   if p.pid == self.pid)
        return used, mine

    def run(self) -> None:
        while not self.done.wait(0.02):
            used, mine = self.read()
            self.device_peak, self.process_peak = max(self.device_peak, used), max(self.process_peak, mine)


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(f'{name}{{device="cuda:0"}} '):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def drive(server: Server, seconds: float) -> dict[str, Any]:
    """One closed-loop load generator per model, all at once; their reports by model."""
    runs = {}
    for name, (_, _, _, body, content_type) in MODELS.items():
        command = [sys.executable, "-m", "benchmarks.loadgen", "--url", server.url, "--target",
                   f"/models/{name}/predict={content_type}:@{REPO / body}", "--concurrency", str(CONCURRENCY),
                   "--duration", str(seconds), "--timeout", "15"]
        runs[name] = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reports = {}
    for name, process in runs.items():
        out, err = process.communicate(timeout=seconds + 60)
        reports[name] = json.loads(out) if process.returncode == 0 else {"error": err[-1000:]}
    return reports


def direct_limit(store: Path, seconds: float) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.direct", "--workload", "resnet18", "--seconds", str(seconds),
               "--store", str(store), "--device", "cuda:0"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-1000:]}


def measure(store: Path, scratch: Path, seconds: float, budget_gib: float) -> dict[str, Any]:
    import pynvml

    pynvml.nvmlInit()
    limit = direct_limit(store, 5.0)
    limit["batch_note"] = f"batch {WORKLOADS['resnet18'].max_batch}, as the CPU run"
    with serve_router(fleet(store, budget_gib), scratch) as server:
        sampler = NvmlSampler(server.process.pid)
        before_device, before_process = sampler.read()
        sampler.start()
        runs = drive(server, seconds)
        sampler.done.set()
        sampler.join(2)
        ledger_peak = metric(server.url, "model_router_ledger_peak_bytes")
        budget = metric(server.url, "model_router_device_budget_bytes")
    gib = 2**30
    return {
        "device": pynvml.nvmlDeviceGetName(sampler.handle), "limit_resnet18": limit, "runs": runs,
        "budget_gib": round(budget / gib, 3), "ledger_peak_gib": round(ledger_peak / gib, 3),
        "nvml_process_peak_gib": round(sampler.process_peak / gib, 3),
        "nvml_device_peak_gib": round(sampler.device_peak / gib, 3),
        "nvml_device_before_gib": round(before_device / gib, 3), "nvml_process_after_load_gib": round(before_process / gib, 3),
        "ledger_over_nvml": round(ledger_peak / sampler.process_peak, 3) if sampler.process_peak else None,
        "within_budget": sampler.process_peak <= budget and ledger_peak <= budget,
    }


def render(result: dict[str, Any]) -> str:
    lines = [f"GPU: {result['device']}; ResNet18 direct loop: {result['limit_resnet18']}"]
    for name, r in result["runs"].items():
        if "error" in r:
            lines.append(f"  {name}: loadgen failed: {r['error'][-200:]}")
            continue
        lines.append(f"  {name}: {r['throughput_rps']} rps, p50 {r['ok_ms']['p50']} ms, p99 {r['ok_ms']['p99']} ms, "
                     f"statuses {r['statuses']}")
    lines.append(f"  ledger peak {result['ledger_peak_gib']} GiB vs NVML process peak {result['nvml_process_peak_gib']} GiB "
                 f"(ratio {result['ledger_over_nvml']}); budget {result['budget_gib']} GiB: "
                 f"{'never crossed' if result['within_budget'] else 'CROSSED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu")
    parser.add_argument("--store", type=Path, default=REPO / "model_store")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--budget-gib", type=float, default=6.0)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("benchmarks.gpu: skipped, no CUDA device (torch.cuda.is_available() is False)")
        return 0
    from router.store import init_demo

    store = args.store.resolve()
    init_demo(store)  # builds only the demo weights that are missing
    args.out.mkdir(parents=True, exist_ok=True)
    result = measure(store, args.out, args.seconds, args.budget_gib)
    (args.out / "gpu.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(render(result))
    return 0 if result["within_budget"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
