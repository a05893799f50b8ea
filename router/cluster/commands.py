"""`model-router cluster deploy | status | shutdown`: a fleet file onto a running Ray cluster."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import ray
from ray import serve

from router.cluster.app import build_app
from router.cluster.layout import PLACEMENT, cluster_of
from router.cluster.reports import ReplicaReport
from router.serving.plan import load_plan

__all__ = ["deploy", "shutdown", "status"]

log = logging.getLogger("router.cluster.commands")


def _connect(address: str) -> None:
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, namespace="serve")


def deploy(config: Path, address: str, *, ingress: bool = False) -> dict[str, Any]:
    """Check the fleet (plugins and options resolved here), then deploy it and wait until it runs."""
    plan = load_plan(config)
    cluster = cluster_of(plan.fleet, str(config))
    _connect(address)
    serve.start(proxy_location="EveryNode" if ingress else "Disabled",
                http_options={"host": cluster.front.host, "port": cluster.front.port} if ingress else None)
    serve.run(build_app(plan.fleet, ingress=ingress), name=cluster.app_name, route_prefix="/" if ingress else None)
    return status(address, cluster.app_name)


def status(address: str, app_name: str = "model-router") -> dict[str, Any]:
    """The application's and deployments' status from Ray, and where each model is resident."""
    _connect(address)
    apps = serve.status().applications
    app = apps.get(app_name)
    if app is None:
        return {"application": app_name, "status": "NOT_DEPLOYED", "deployed": sorted(apps)}
    deployments = {name: {"status": d.status.value if hasattr(d.status, "value") else str(d.status),
                          "replicas": dict(getattr(d, "replica_states", {}) or {}), "message": d.message}
                   for name, d in app.deployments.items()}
    result: dict[str, Any] = {"application": app_name, "status": str(app.status), "deployments": deployments}
    try:
        reports: list[ReplicaReport] = serve.get_deployment_handle(PLACEMENT, app_name).view.remote().result(
            timeout_s=10)
    except Exception as exc:  # noqa: BLE001  # status shows what it can reach
        result["replicas"] = f"placement not reachable: {type(exc).__name__}: {exc}"
        return result
    result["replicas"] = {
        r.replica: {"node_type": r.node_type, "node": r.node_id[:12], "device": r.device, "free_bytes": r.free_bytes,
                    "budget_bytes": r.budget_bytes,
                    "resident": sorted(m for m, load in r.loads.items() if load.resident),
                    "loading": sorted(m for m, load in r.loads.items() if load.loading)}
        for r in reports
    }
    return result


def shutdown(address: str, app_name: str = "model-router") -> None:
    """Delete the application: replicas drain (queued and running work answered), then stop."""
    _connect(address)
    serve.delete(app_name)


def print_json(data: object) -> None:
    print(json.dumps(data, indent=2, default=str))
