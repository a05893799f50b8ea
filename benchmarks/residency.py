"""The dynamic fleet's costs, for `make bench` (workload `residency`):

- cold start per plugin: the first load of an on-demand model (load, estimate, warm-up, timing)
  and a reload after an eviction (load only: the first load's figures are reused), read from
  `GET /models` (`residency.last_load_s`);
- the cost of residency: four ResNet18s, round robin at concurrency 16 on bus.jpg, served once
  with all four resident and once with a budget that holds two (on demand, evicting by measured
  memory), as a ratio from the same run.

    python -m benchmarks.run --workload residency [--quick]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.systems import Server, serve_router
from benchmarks.workloads import REPO, ultralytics_asset

__all__ = ["run_residency"]

MODELS = 4
#: Two ResNet18s (46.8 MB of weights each) and a batch of eight at the declared 5 MB per input fit;
#: three do not. Declared per-input costs: the plugin's estimate is a GPU-sized upper bound.
TWO_FIT_BUDGET_MB = 140


def _fleet(store: Path, *, resident: bool, budget_mb: int) -> str:
    models = "".join(
        f"  resnet-{i}:\n    plugin: resnet\n    options: {{weights: resnet18.pt}}\n"
        f"    residency: {'always' if resident else 'on_demand'}\n    memory: {{per_item: 5MB}}\n"
        "    queue: {max_size: 64, timeout_ms: 60000}\n    batch: {max_size: 8, max_delay_ms: 5}\n"
        for i in range(MODELS)
    )
    return (f"model_store: {store}\ndevices:\n  cpu: {{probe: none, memory_budget: {budget_mb}MB}}\n"
            f"models:\n{models}")


def _round_robin(server: Server, seconds: float, warm_s: float) -> dict[str, Any]:
    bus = ultralytics_asset("bus.jpg")
    targets = [f"--target=/models/resnet-{i}/predict=image/jpeg:@{bus}" for i in range(MODELS)]
    command = [sys.executable, "-m", "benchmarks.loadgen", "--url", server.url, *targets, "--concurrency", "16",
               "--cycle", "--timeout", "60"]
    subprocess.run([*command, "--duration", str(warm_s)], cwd=REPO, capture_output=True, check=True, timeout=300)
    done = subprocess.run([*command, "--duration", str(seconds)], cwd=REPO, capture_output=True, text=True,
                          check=True, timeout=600)
    report: dict[str, Any] = json.loads(done.stdout)
    models = httpx.get(server.url + "/models", timeout=10).json()["models"]
    report["loads"] = sum(m["residency"]["loads"] for m in models)
    report["evictions"] = sum(sum(m["residency"]["evictions"].values()) for m in models)
    return report


def _cold_starts(store: Path, scratch: Path) -> dict[str, Any]:
    """Each vision plugin's first load (on demand, by one request: load, estimate, warm-up and
    timing) and a reload after an unload (an operator's unload, then load: the load alone)."""
    fleet = (f"model_store: {store}\nmodels:\n"
             "  resnet18: {plugin: resnet, options: {weights: resnet18.pt}, residency: on_demand}\n"
             "  yolov8n: {plugin: yolo, options: {model: yolov8n.pt}, residency: on_demand}\n")
    body = (REPO / "examples" / "street.jpg").read_bytes()
    out: dict[str, Any] = {}
    with serve_router(fleet, scratch) as server:
        for model in ("resnet18", "yolov8n"):
            started = time.perf_counter()
            reply = httpx.post(f"{server.url}/models/{model}/predict", content=body,
                               headers={"content-type": "image/jpeg"}, timeout=300)
            reply.raise_for_status()
            first_request_s = time.perf_counter() - started
            first = httpx.get(f"{server.url}/models/{model}").json()["residency"]["last_load_s"]
            httpx.post(f"{server.url}/models/{model}/unload", timeout=60).raise_for_status()
            httpx.post(f"{server.url}/models/{model}/load", timeout=300).raise_for_status()
            reload = httpx.get(f"{server.url}/models/{model}").json()["residency"]["last_load_s"]
            out[model] = {"first_load_s": first, "first_request_s": round(first_request_s, 3), "reload_s": reload}
    return out


def run_residency(store: Path, scratch: Path, seconds: float, warm_s: float) -> dict[str, Any]:
    results: dict[str, Any] = {"cold_start": _cold_starts(store, scratch)}
    print(f"[residency] cold starts {results['cold_start']}", flush=True)
    for label, resident, budget in (("all_resident", True, 4096), ("two_of_four", False, TWO_FIT_BUDGET_MB)):
        with serve_router(_fleet(store, resident=resident, budget_mb=budget), scratch) as server:
            results[label] = _round_robin(server, seconds, warm_s)
        print(f"[residency] {label}: {results[label]['throughput_rps']} rps {results[label]['statuses']} "
              f"loads {results[label]['loads']}", flush=True)
    return results
