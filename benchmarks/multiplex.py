"""Residency against Ray Serve's multiplexing: four ResNet18 models, one replica, round robin.

    python -m benchmarks.multiplex [--seconds 8] [--store model_store]

Concurrency 16, round robin over four ResNet18 models (the demo weights) on ultralytics' bus.jpg.
Ray Serve 2.60: one replica with `@serve.multiplexed(max_num_models_per_replica=K)`, K = 2
(evicting by count, least recently used) and K = 4 (all resident), each request run through the
same resnet plugin code in a thread, no batching; requests through Ray's HTTP proxy. The router:
the four models `residency: on_demand` under a ledger budget in which two fit (140 MB: 46.8 MB
of weights each, 5 MB per input declared), and under one where all four fit. Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.cluster import loadgen
from benchmarks.systems import free_port, serve_router
from benchmarks.workloads import REPO, WORKLOADS, build_plugin, ultralytics_asset

__all__ = ["main"]

CONCURRENCY = 16


def ray_deployment(max_models: int, store: Path) -> Any:
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    @serve.deployment(num_replicas=1, max_ongoing_requests=CONCURRENCY, ray_actor_options={"num_cpus": 0})
    class Multiplexed:
        @serve.multiplexed(max_num_models_per_replica=max_models)
        async def get_model(self, model_id: str) -> Any:
            return await asyncio.to_thread(build_plugin, WORKLOADS["photo"], store)

        async def __call__(self, request: Request) -> Any:
            plugin = await self.get_model(request.url.path.strip("/"))
            body = await request.body()
            answer = await asyncio.to_thread(_run, plugin, body)
            return Response(json.dumps(answer), media_type="application/json")  # with a Content-Length

    return Multiplexed.bind()


def _run(plugin: Any, body: bytes) -> Any:
    from router.sdk.plugin import Payload

    item = plugin.preprocess(Payload(body, "image/jpeg"))
    return plugin.postprocess(plugin.predict_batch([item])[0], item)


def ray_runs(store: Path, seconds: float, bus: str) -> dict[str, Any]:
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    targets = [f"/m{i}=image/jpeg:@{bus}" for i in range(4)]
    out = {}
    try:
        for label, k in (("max_2", 2), ("all_4", 4)):
            serve.run(ray_deployment(k, store), name="multiplex", route_prefix="/")
            loadgen(url, targets, "--concurrency", str(CONCURRENCY), "--cycle", "--duration", "4")
            out[label] = loadgen(url, targets, "--concurrency", str(CONCURRENCY), "--cycle", "--duration", str(seconds))
            serve.delete("multiplex")
    finally:
        serve.shutdown()
        ray.shutdown()
    return out


def router_fleet(store: Path, budget_mb: int) -> str:
    models = "".join(f"  resnet-{i}:\n    plugin: resnet\n    options: {{weights: resnet18.pt}}\n    residency: on_demand\n"
                     "    memory: {per_item: 5MB}\n    queue: {max_size: 64, timeout_ms: 60000}\n" for i in range(4))
    return f"model_store: {store}\ndevices:\n  cpu: {{probe: none, memory_budget: {budget_mb}MB}}\nmodels:\n{models}"


def router_runs(store: Path, scratch: Path, seconds: float, bus: str) -> dict[str, Any]:
    targets = [f"/models/resnet-{i}/predict=image/jpeg:@{bus}" for i in range(4)]
    out = {}
    for label, budget in (("two_of_four", 140), ("all_4", 400)):
        with serve_router(router_fleet(store, budget), scratch) as server:
            loadgen(server.url, targets, "--concurrency", str(CONCURRENCY), "--cycle", "--duration", "4")
            out[label] = loadgen(server.url, targets, "--concurrency", str(CONCURRENCY), "--cycle", "--duration",
                                 str(seconds))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--store", type=Path, default=REPO / "model_store")
    parser.add_argument("--scratch", type=Path, default=REPO / "benchmarks" / "results" / "scratch")
    args = parser.parse_args(argv)
    args.scratch.mkdir(parents=True, exist_ok=True)
    bus = ultralytics_asset("bus.jpg")
    store = args.store.resolve()
    result: dict[str, Any] = {"router": router_runs(store, args.scratch, args.seconds, bus),
                              "ray_serve": ray_runs(store, args.seconds, bus)}
    rps = {f"{system}/{label}": run["throughput_rps"] for system, runs in result.items() for label, run in runs.items()}
    result["ratios"] = {
        "router_two_of_four_over_all_4": round(rps["router/two_of_four"] / max(rps["router/all_4"], 1e-9), 3),
        "router_two_of_four_over_ray_max_2": round(rps["router/two_of_four"] / max(rps["ray_serve/max_2"], 1e-9), 3),
        "ray_max_2_over_all_4": round(rps["ray_serve/max_2"] / max(rps["ray_serve/all_4"], 1e-9), 3),
    }
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
