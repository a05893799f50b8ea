"""Per-request facts: what the ASGI middleware records in the scope, and the runtime (and pipeline runner) the app serves."""

from __future__ import annotations

import time
from typing import Any

from litestar import Request
from litestar.types import Scope

from router.pipelines import PipelineRunner
from router.serving.facade import ServingFacade

__all__ = ["mark_received", "pipelines_of", "received_at", "runtime_of"]


def runtime_of(request: Request[Any, Any, Any]) -> ServingFacade:
    """The runtime behind the app that serves `request`."""
    runtime: ServingFacade = request.app.state.runtime
    return runtime


def pipelines_of(request: Request[Any, Any, Any]) -> PipelineRunner:
    """The pipeline runner in front of that runtime."""
    runner: PipelineRunner = request.app.state.pipelines
    return runner


def mark_received(scope: Scope) -> None:
    """Stamp when the request reached the app, so its deadline counts from there."""
    scope.setdefault("state", {})["received_at"] = time.monotonic()


def received_at(request: Request[Any, Any, Any]) -> float | None:
    """When the request reached the app (time.monotonic), if the middleware stamped it."""
    stamp = request.scope.get("state", {}).get("received_at")
    return float(stamp) if stamp is not None else None
