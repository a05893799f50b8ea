"""The dynamic fleet's cold starts, for `make bench` (workload `residency`): per plugin, the first
load of an on-demand model (load, estimate, warm-up, timing) and a reload after an unload (the
plugin's load alone: the first load's figures are reused), read from `GET /models`
(`residency.last_load_s`). The cost of residency under round-robin traffic, beside Ray Serve's
multiplexing, is the `multiplex` scenario (benchmarks/multiplex.py).

    python -m benchmarks.run --workload residency
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.systems import serve_router
from benchmarks.workloads import REPO

__all__ = ["run_residency"]

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


def run_residency(store: Path, scratch: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"cold_start": _cold_starts(store, scratch)}
    print(f"[residency] cold starts {results['cold_start']}", flush=True)
    return results
