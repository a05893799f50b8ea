"""GPU check of the cluster (written, not yet run on a GPU): two device replicas share one GPU.
Skips, with the reason, without CUDA or without Ray (which the wheelhouse cannot carry).

Ray is started on this machine with its GPUs; the fleet's one node type asks for `num_gpus: 0.5`,
so both replicas land on GPU 0, each with its own Runtime admitting by NVML (the probe reads the
whole card: each replica sees the other's memory too) under a 6 GiB budget. Two ResNet18 models
are kept on both replicas (copies min 2). Round robin at concurrency 16 for 10 s through the
cluster front; checks: every answer 200, both replicas served, NVML's used memory never above
the card's total, and each replica's ledger peak within its budget. Writes OUT/cluster.md.

    python scripts/gpu_cluster_check.py OUT_DIR
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def skip_reason() -> str | None:
    """Why the check cannot run here, or None."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return "no CUDA: torch.cuda.is_available() is False"
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed (the offline wheelhouse leaves it out: its wheel is 76 MiB; pip install -e '.[ray]' where an index is reachable)"
    return None


def main(out: Path) -> int:
    reason = skip_reason()
    if reason is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "cluster.md").write_text(f"| cluster check | result | detail |\n| --- | --- | --- |\n"
                                        f"| two replicas on one GPU | skipped | {reason} |\n")
        print(f"cluster check skipped: {reason}")
        return 0
    import pynvml
    import ray
    from ray import serve

    from benchmarks.systems import free_port
    from benchmarks.workloads import ultralytics_asset
    from router.cluster.app import build_app
    from router.serving.plan import load_plan

    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    models = "".join(f"  resnet-{i}:\n    plugin: resnet\n    device: cuda:0\n    options: {{weights: resnet18.pt}}\n"
                     "    batch: {max_size: 8, max_delay_ms: 5}\n" for i in range(2))
    fleet = (f"model_store: {REPO / 'model_store'}\ndevices:\n  cuda:0: {{probe: nvml, memory_budget: 6GiB}}\nmodels:\n{models}"
             "cluster:\n  node_types:\n    gpu: {device: cuda, num_gpus: 0.5, num_cpus: 1, replicas: {min: 2, max: 2}}\n"
             "  copies: {min: 2, max: 2}\n"
             f"  front: {{host: 127.0.0.1, port: {port}, num_cpus: 0}}\n  stats_period_s: 0.25\n")
    (out / "cluster-fleet.yaml").write_text(fleet)
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="Disabled")
    serve.run(build_app(load_plan(out / "cluster-fleet.yaml").fleet), name="model-router", route_prefix=None)
    url = f"http://127.0.0.1:{port}"
    pynvml.nvmlInit()
    card = pynvml.nvmlDeviceGetHandleByIndex(0)
    total = pynvml.nvmlDeviceGetMemoryInfo(card).total
    rows = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            with urllib.request.urlopen(url + "/models", timeout=5) as reply:
                placed = json.loads(reply.read())["models"]
            if all(m["cluster"]["copies"] == 2 for m in placed):
                break
            time.sleep(1)
        bus = ultralytics_asset("bus.jpg")
        load = subprocess.Popen([sys.executable, "-m", "benchmarks.loadgen", "--url", url, "--concurrency", "16",
                                 "--cycle", "--duration", "10", "--timeout", "30",
                                 *[f"--target=/models/resnet-{i}/predict=image/jpeg:@{bus}" for i in range(2)]],
                                cwd=REPO, stdout=subprocess.PIPE, text=True)
        peak = 0
        while load.poll() is None:
            peak = max(peak, pynvml.nvmlDeviceGetMemoryInfo(card).used)
            time.sleep(0.05)
        report = json.loads(load.stdout.read() if load.stdout else "{}")
        with urllib.request.urlopen(url + "/models", timeout=5) as reply:
            after = json.loads(reply.read())["models"]
        with urllib.request.urlopen(url + "/metrics", timeout=5) as reply:
            metrics = reply.read().decode()
        serving = {r for m in after for r, v in m["cluster"]["replicas"].items() if v["requests"].get("ok", 0)}
        ledger = [line for line in metrics.splitlines() if line.startswith("model_router_ledger_peak_bytes")]
        rows += [("every answer 200", report.get("statuses") == {"200": report.get("requests")}, str(report.get("statuses"))),
                 ("both replicas served", len(serving) == 2, ", ".join(sorted(serving))),
                 ("NVML used <= total", peak <= total, f"peak {peak >> 20} MiB of {total >> 20} MiB"),
                 ("ledger peaks within 6 GiB each", all(float(x.rsplit(" ", 1)[1]) <= 6 * 2**30 for x in ledger),
                  "; ".join(ledger)[:300])]
    finally:
        serve.shutdown()
        ray.shutdown()
    lines = ["| cluster check | result | detail |", "| --- | --- | --- |"]
    lines += [f"| {name} | {'pass' if ok else 'FAIL'} | {detail} |" for name, ok, detail in rows]
    (out / "cluster.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if rows and all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-check-out")))
