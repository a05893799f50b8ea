"""The `cluster` workload: the router scaled out on a local two-node Ray cluster, in its own process.

    python -m benchmarks.cluster [--seconds 6] [--store model_store]

Prints one JSON document:
  - `throughput`: the simulated accelerator (a batch of n costs 200 + 2 n ms, GIL released) at
    concurrency 128 through the cluster front, one device replica and two, and their ratio;
  - `latency`: a no-op model at concurrency 1: p50 of the single-process router, of the cluster
    through our front (Serve replica running our HTTP server, one handle hop to the device
    replica) and through Ray Serve's HTTP proxy with the same app as `serve.ingress` (two hops);
  - `round_robin`: four on-demand models of which two fit per replica, concurrency 16, round
    robin: statuses, throughput, the share served without a load after a warm-up.

Two "GPU hosts" are `ray.cluster_utils.Cluster` nodes with a `gpu_host` custom resource each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.systems import free_port, serve_router
from benchmarks.workloads import REPO

__all__ = ["main"]

APP = "model-router"
JSON = 'application/json:{"id": "x"}'
ACCEL = ("  accel:\n    plugin: scripted\n    options: {fixed_ms: 200, per_item_ms: 2}\n"
         "    batch: {max_size: 32, max_delay_ms: 5}\n    queue: {max_size: 256}\n")
NOOP = "  noop:\n    plugin: scripted\n    batch: {max_size: 8, max_delay_ms: 0}\n"
FOUR = "".join(f"  m{i}:\n    plugin: scripted\n    options: {{fixed_ms: 20, per_item_ms: 1, load_ms: 300, "
               "weights_bytes: 40000000}\n    residency: on_demand\n    batch: {max_size: 8, max_delay_ms: 2}\n"
               "    queue: {max_size: 64, timeout_ms: 10000}\n" for i in range(4))


def fleet(store: Path, budget: str, models: str, port: int, replicas: int, copies: str, extra: str = "") -> str:
    return (f"model_store: {store}\ndevices:\n  cpu: {{probe: none, memory_budget: {budget}}}\nmodels:\n{models}"
            f"cluster:\n  app_name: {APP}\n  node_types:\n    host: {{device: cpu, num_gpus: 0, num_cpus: 0, "
            f"resources: {{gpu_host: 1}}, replicas: {{min: {replicas}, max: {replicas}}}}}\n"
            f"  models: {copies}\n  front: {{host: 127.0.0.1, port: {port}, num_cpus: 0}}\n  stats_period_s: 0.25\n{extra}")


def loadgen(url: str, targets: list[str], *args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "benchmarks.loadgen", "--url", url, *[f"--target={t}" for t in targets],
                           "--timeout", "30", *args], cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"loadgen failed ({done.returncode}): {done.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())


def _wait(check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"not ready after {timeout} s")


@contextmanager
def deployed(text: str, scratch: Path, *, ingress: bool = False, port: int | None = None) -> Iterator[str]:
    from ray import serve

    from router.cluster.app import build_app
    from router.serving.plan import load_plan

    path = scratch / f"cluster-{time.monotonic_ns()}.yaml"
    path.write_text(text, encoding="utf-8")
    plan = load_plan(path)
    assert plan.fleet.cluster is not None
    serve.run(build_app(plan.fleet, ingress=ingress), name=APP, route_prefix="/" if ingress else None)
    url = f"http://127.0.0.1:{port if ingress else plan.fleet.cluster.front.port}"
    try:
        _wait(lambda: _get(url + "/health/ready")["ready"], 120)
        yield url
    finally:
        serve.delete(APP)


def copies(url: str, model: str) -> int:
    return int(next(m for m in _get(url + "/models")["models"] if m["name"] == model)["cluster"]["copies"])


def measure(store: Path, scratch: Path, seconds: float) -> dict[str, Any]:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"gpu_host": 1},
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"gpu_host": 1})
    ray.init(address=cluster.address, namespace="serve", log_to_driver=False)
    proxy_port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": proxy_port})
    out: dict[str, Any] = {"seconds": seconds}
    try:
        accel = [f"/models/accel/predict={JSON}"]
        rates = {}
        for replicas in (1, 2):
            text = fleet(store, "200MB", ACCEL + NOOP, free_port(), replicas,
                         f"{{accel: {{min: {replicas}, max: {replicas}}}, noop: {{min: 1, max: 1}}}}")
            with deployed(text, scratch) as url:
                _wait(lambda url=url, replicas=replicas: copies(url, "accel") == replicas, 60)
                loadgen(url, accel, "--concurrency", "128", "--duration", "1.5")
                rates[replicas] = loadgen(url, accel, "--concurrency", "128", "--duration", str(seconds))
                if replicas == 1:
                    noop = [f"/models/noop/predict={JSON}"]
                    loadgen(url, noop, "--concurrency", "1", "--duration", "1")
                    front = loadgen(url, noop, "--concurrency", "1", "--duration", str(seconds))
        out["throughput"] = {"one_replica": rates[1], "two_replicas": rates[2],
                             "ratio": round(rates[2]["throughput_rps"] / max(rates[1]["throughput_rps"], 1e-9), 3)}
        one = fleet(store, "200MB", ACCEL + NOOP, free_port(), 1, "{noop: {min: 1, max: 1}}")
        with deployed(one, scratch, ingress=True, port=proxy_port) as url:
            loadgen(url, noop, "--concurrency", "1", "--duration", "1")
            ingress = loadgen(url, noop, "--concurrency", "1", "--duration", str(seconds))
        with serve_router(fleet(store, "200MB", ACCEL + NOOP, free_port(), 1, "{}"), scratch) as single:
            loadgen(single.url, noop, "--concurrency", "1", "--duration", "1")
            alone = loadgen(single.url, noop, "--concurrency", "1", "--duration", str(seconds))
        p50 = {"single_process": alone["ok_ms"]["p50"], "cluster_front": front["ok_ms"]["p50"],
               "ray_proxy_ingress": ingress["ok_ms"]["p50"]}
        out["latency"] = {"p50_ms": p50, "added_p50_ms": {k: round(v - p50["single_process"], 2) for k, v in p50.items()
                                                          if k != "single_process"},
                          "runs": {"single_process": alone, "cluster_front": front, "ray_proxy_ingress": ingress}}
        out["round_robin"] = round_robin(store, scratch, seconds)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    return out


def round_robin(store: Path, scratch: Path, seconds: float) -> dict[str, Any]:
    text = fleet(store, "100MB", FOUR, free_port(), 2, "{}", "  autoscaling: {copy_target_in_flight: 1000}\n")
    targets = [f"/models/m{i}/predict={JSON}" for i in range(4)]
    with deployed(text, scratch) as url:
        loadgen(url, targets, "--concurrency", "16", "--cycle", "--duration", "4")
        before = _get(url + "/models")["models"]
        report = loadgen(url, targets, "--concurrency", "16", "--cycle", "--duration", str(seconds))
        after = _get(url + "/models")["models"]
    ok = sum(m["requests"].get("ok", 0) for m in after) - sum(m["requests"].get("ok", 0) for m in before)
    cold = sum(m["cluster"]["cold_requests"] for m in after) - sum(m["cluster"]["cold_requests"] for m in before)
    serving = {r for m in after for r, v in m["cluster"]["replicas"].items() if v["requests"].get("ok", 0)}
    return {**report, "served_without_load": round(1 - cold / max(ok, 1), 4), "replicas_serving": len(serving),
            "resident": {m["name"]: m["cluster"]["resident_on"] for m in after}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--store", type=Path, default=REPO / "model_store")
    parser.add_argument("--scratch", type=Path, default=REPO / "benchmarks" / "results" / "scratch")
    args = parser.parse_args(argv)
    args.scratch.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    json.dump(measure(args.store.resolve(), args.scratch, args.seconds), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
