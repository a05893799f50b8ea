"""A real local Ray cluster of two "GPU hosts" on this machine, and deployments onto it.

`ray.cluster_utils.Cluster` starts a head node and a second node, each with one `gpu_host`
custom resource standing in for a GPU and one CPU. Device replicas ask for `gpu_host: 1` and no
CPU, so there is room for at most two, one per node, as on two single-GPU hosts. Without Ray
installed the cluster tests skip with the reason, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REPO, free_port

APP = "model-router"


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """Module-scoped: Ray's processes are this process's children, and must be gone before other
    tests (which count their children) run."""
    try:
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Ray Serve is not installed (make test installs the ray extra): {exc}")
        pytest.skip(f"Ray Serve is not installed (pip install -e '.[ray]'): {exc}")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"gpu_host": 1},
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"gpu_host": 1})
    ray.init(address=cluster.address, namespace="serve", log_to_driver=False)
    serve.start(proxy_location="Disabled")
    try:
        yield cluster
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def cluster_section(port: int, replicas: str, copies: str, autoscaling: str = "{}") -> str:
    return f"""cluster:
  app_name: {APP}
  node_types:
    host: {{device: cpu, num_gpus: 0, num_cpus: 0, resources: {{gpu_host: 1}}, replicas: {replicas}}}
  models: {copies}
  autoscaling: {autoscaling}
  front: {{host: 127.0.0.1, port: {port}, num_cpus: 0}}
  stats_period_s: 0.25
"""


@contextmanager
def deployed(tmp_path: Path, fleet: str, *, ready_timeout: float = 120.0) -> Iterator[str]:
    """Deploy `fleet` (with a cluster section) as the application; yield the front's URL."""
    from ray import serve

    from router.cluster.app import build_app
    from router.serving.plan import load_plan

    path = tmp_path / f"fleet-{time.monotonic_ns()}.yaml"
    path.write_text(fleet, encoding="utf-8")
    plan = load_plan(path)
    assert plan.fleet.cluster is not None
    serve.run(build_app(plan.fleet), name=APP, route_prefix=None)
    url = f"http://127.0.0.1:{plan.fleet.cluster.front.port}"
    try:
        wait_until(lambda: httpx.get(url + "/health/ready", timeout=2).status_code == 200, ready_timeout)
        yield url
    finally:
        serve.delete(APP)


def wait_until(check: Any, timeout: float, step: float = 0.25) -> float:
    """Seconds until `check()` held; fails after `timeout`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            if check():
                return time.monotonic() - started
        except (httpx.HTTPError, KeyError, IndexError):
            pass
        time.sleep(step)
    raise AssertionError(f"not true after {timeout} s")


def cluster_models(url: str) -> dict[str, Any]:
    return {m["name"]: m for m in httpx.get(url + "/models", timeout=5).json()["models"]}


def replicas_view() -> list[Any]:
    from ray import serve

    from router.cluster.layout import PLACEMENT

    reports: list[Any] = serve.get_deployment_handle(PLACEMENT, APP).view.remote().result(timeout_s=10)
    return reports


def loadgen(url: str, targets: list[str], *args: str, timeout: float = 120.0) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "benchmarks.loadgen", "--url", url,
                           *[f"--target={t}" for t in targets], *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout, check=True)
    report: dict[str, Any] = json.loads(done.stdout)
    return report


__all__ = ["APP", "cluster_models", "cluster_section", "deployed", "free_port", "loadgen", "replicas_view", "wait_until"]
