"""The surge part of the GPU check (written, not yet run on a GPU).

A two-model fleet (ResNet-50 and YOLOv8n) on one GPU under an NVML-measured budget a few GiB above
what the card used before the router started. First each model's capacity, closed loop; then five
times that rate, open loop, for 10 s. Checks: every request answered 200 or shed with 503 or 504
(nothing lost, no transport error), no CUDA out-of-memory in the router's log, NVML's reading of the
whole card never above the budget; figures: capacity, answered and shed, latency, how often
admission paused, and the ledger's peak beside NVML's peak for the router process (the ledger
against NVML under load). Writes OUT/surge.md.

    python -m gpu_check.surge OUT [--store DIR] [--headroom-gib 4] [--device cuda:0]

Without CUDA it writes its rows as skipped; `--device cpu` runs the same code on the CPU (resnet18,
the host probe, short runs: how the code is exercised where there is no GPU).
"""

from __future__ import annotations

import argparse
import json
import threading
import urllib.request
from pathlib import Path
from typing import Any, Self

from benchmarks.gpu import NvmlSampler
from benchmarks.systems import RssSampler, serve_router
from gpu_check.loads import GIB, body_target, drive, gib, metric, photo, run_part

__all__ = ["CHECKS", "FACTOR", "fleet_yaml", "surge_rows"]

FACTOR = 5
DEADLINE_MS = 1000  # a queued request older than this is shed (504)
ANSWERED = ("200", "503", "504")  # served, refused at once (queue full, with Retry-After), past its deadline
CHECKS = ("capacity, closed loop", f"{FACTOR}x surge, open loop: answered or shed", "no CUDA out-of-memory",
          "NVML within the budget", "ledger vs NVML under load")
MODELS = ("resnet", "yolo")


def fleet_yaml(store: Path, device: str, arch: str, budget_bytes: int) -> str:
    probe = "nvml" if device.startswith("cuda") else "host"
    options = {"resnet": f"plugin: resnet, options: {{arch: {arch}, weights: {arch}.pt}}, batch: {{max_size: 32, "
                         "max_delay_ms: 5}",
               "yolo": "plugin: yolo, options: {model: yolov8n.pt, imgsz: 640}, batch: {max_size: 16, max_delay_ms: 5}"}
    settings = f"probe: {probe}, memory_budget: {budget_bytes}, poll_interval_ms: 10"
    lines = [f"model_store: {store}", "devices:", f"  {device}: {{{settings}}}", "models:"]
    lines += [f"  {name}: {{{spec}, device: {device}, queue: {{max_size: 256, timeout_ms: {DEADLINE_MS}}}}}"
              for name, spec in options.items()]
    return "\n".join(lines) + "\n"


class MetricsSampler(threading.Thread):
    """The router's ledger peak and how often admission was paused, read from /metrics every 100 ms."""

    def __init__(self, url: str, device: str) -> None:
        super().__init__(daemon=True)
        self.url, self.device = url, device
        self.samples = self.paused = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            try:
                with urllib.request.urlopen(self.url + "/metrics", timeout=5) as response:
                    text = response.read().decode()
            except OSError:
                continue
            self.samples += 1
            self.paused += metric(text, "model_router_admission_paused", self.device) > 0


class NvmlPeaks(NvmlSampler):
    """benchmarks.gpu's NVML sampler, going on where a container refuses NVML's process list (then
    the router's own peak reads 0: unknown)."""

    def read(self) -> tuple[int, int]:
        used = int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)
        try:
            listed = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except self.nvml.NVMLError:
            listed = []
        return used, sum(int(p.usedGpuMemory or 0) for p in listed if p.pid == self.pid)


class Memory:
    """Peak memory while it runs: NVML's whole card and the router's own on CUDA, RSS on the CPU."""

    def __init__(self, device: str, pid: int) -> None:
        self.cuda = device.startswith("cuda")
        if self.cuda:
            import pynvml

            pynvml.nvmlInit()
            self.sampler: Any = NvmlPeaks(pid)
        else:
            self.sampler = RssSampler(pid)

    def __enter__(self) -> Self:
        self.sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sampler.done.set()
        self.sampler.join(2)

    def peaks(self) -> tuple[int, int]:
        """(the card's peak, the router process's peak); on the CPU both are the router's RSS."""
        if self.cuda:
            return self.sampler.device_peak, self.sampler.process_peak
        return self.sampler.peak, self.sampler.peak


def card_used(device: str) -> int:
    """What the card (or the host) uses now: the baseline the budget is set above."""
    from router.scheduling.memory import HostMemoryProbe, NvmlProbe

    probe = NvmlProbe(device) if device.startswith("cuda") else HostMemoryProbe(device)
    try:
        return probe.read().used_bytes
    finally:
        probe.close()


def surge_rows(capacity: dict[str, Any], surge: dict[str, Any], offered: dict[str, float], figures: dict[str, Any],
               ) -> list[tuple[str, str, str]]:
    """The part's rows from its measurements (plain values)."""
    cap = ", ".join(f"{m} {capacity['targets'][p]['throughput_rps']:.0f} rps" for m, p in figures["paths"].items())
    above = gib(figures["budget"] - figures["baseline"])
    budget = f"budget {gib(figures['budget'])}, {above} above the card's use before"
    rows = [(CHECKS[0], "info", f"{cap} ({figures['clients']}; {budget})")]
    statuses = surge["statuses"]
    sent = surge["requests"] / figures["surge_s"]
    lost = {s: n for s, n in statuses.items() if s not in ANSWERED}
    detail = (f"offered {sum(offered.values()):.0f} rps, sent {sent:.0f} rps for {figures['surge_s']:.0f} s: "
              f"200 {statuses.get('200', 0)}, 503 {statuses.get('503', 0)} "
              f"({surge['rejected_without_retry_after']} without Retry-After), 504 {statuses.get('504', 0)}, "
              f"other {sum(lost.values())} {lost or ''} {surge['errors'] or ''}; p99 of 200s {surge['ok_ms'].get('p99')} ms; "
              f"admission paused in {figures['paused']} of {figures['samples']} samples")
    rows.append((CHECKS[1], "FAIL" if lost or surge["errors"] or surge["rejected_without_retry_after"] else "pass",
                 detail))
    ooms = figures["oom_lines"]
    rows.append((CHECKS[2], "FAIL" if ooms else "pass", f"{ooms} out-of-memory lines in the router's log"))
    card, process = figures["peaks"]
    if not figures["cuda"]:
        rows.append((CHECKS[3], "info", f"peak {gib(card)} of {gib(figures['budget'])} (RSS on the CPU)"))
        rows.append((CHECKS[4], "info", f"ledger peak {gib(figures['ledger_peak'])}; the router's RSS peak {gib(process)}"))
        return rows
    read = card > 0
    rows.append((CHECKS[3], ("pass" if card <= figures["budget"] else "FAIL") if read else "FAIL",
                 f"peak {gib(card)} of {gib(figures['budget'])}" if read else "NVML gave no reading"))
    mine = (f"the router's NVML peak {gib(process)} (ledger/NVML {figures['ledger_peak'] / process:.2f})" if process
            else "NVML listed no memory for the router's process (a container may hide it)")
    rows.append((CHECKS[4], "info", f"ledger peak {gib(figures['ledger_peak'])}, {mine}"))
    return rows


def run(store: Path, out: Path, device: str, arch: str, headroom: int, seconds: float, processes: int,
        concurrency: int) -> list[tuple[str, str, str]]:
    baseline = card_used(device)
    budget = baseline + headroom
    image = photo()
    paths = {name: f"/models/{name}/predict" for name in MODELS}
    targets = [body_target(path, image) for path in paths.values()]
    with serve_router(fleet_yaml(store, device, arch, budget), out, timeout_s=240) as server:
        with Memory(device, server.process.pid) as memory:
            capacity = drive(server.url, targets, seconds / 2, processes, concurrency=concurrency)
            offered = {p: FACTOR * capacity["targets"][p]["throughput_rps"] for p in paths.values()}
            sampler = MetricsSampler(server.url, device)
            sampler.start()
            surge = drive(server.url, targets, seconds, processes, rates=list(offered.values()), timeout_s=30)
            sampler.done.set()
            sampler.join(2)
        with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
            ledger_peak = metric(response.read().decode(), "model_router_ledger_peak_bytes", device)
        log = server.log_path.read_text(encoding="utf-8", errors="replace").lower()
    (out / "surge.json").write_text(json.dumps({"capacity": capacity, "surge": surge, "offered": offered}, indent=2))
    figures = {"paths": paths, "clients": f"{processes} clients x {concurrency} connections, {image.name}",
               "budget": budget, "baseline": baseline, "surge_s": seconds, "paused": sampler.paused,
               "samples": sampler.samples, "oom_lines": log.count("out of memory"), "peaks": memory.peaks(),
               "cuda": device.startswith("cuda"), "ledger_peak": ledger_peak}
    return surge_rows(capacity, surge, offered, figures)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--store", type=Path, help="default: OUT/store")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--headroom-gib", type=float, default=4.0, help="the budget above the card's use before")
    parser.add_argument("--seconds", type=float, default=10.0, help="of the surge; capacity is measured for half")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)
    return run_part("surge", args.out.resolve(), args.device, args.store, CHECKS, lambda store, arch: run(
        store, args.out.resolve(), args.device, arch, int(args.headroom_gib * GIB), args.seconds, args.processes,
        args.concurrency))


if __name__ == "__main__":
    raise SystemExit(main())
