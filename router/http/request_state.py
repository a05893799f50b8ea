"""Per-request facts: what the ASGI middleware records in the scope (arrival, trace), and the runtime
(and pipeline runner) the app serves."""

from __future__ import annotations

import time
from typing import Any

from litestar import Request
from litestar.types import Scope

from router.pipelines import PipelineRunner
from router.serving.facade import Serving
from router.tracing.api import Phases, RequestSpan

__all__ = ["mark_received", "note_error", "pipelines_of", "received_at", "request_phases", "request_trace", "runtime_of"]
#: The scope state's key for the request's server span (set only while tracing is on).
TRACE = "trace"


def runtime_of(request: Request[Any, Any, Any]) -> Serving:
    """The runtime behind the app that serves `request`."""
    runtime: Serving = request.app.state.runtime
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


def request_trace(scope: Scope) -> RequestSpan | None:
    """The request's server span, when tracing is on."""
    state = scope.get("state")
    trace: RequestSpan | None = state.get(TRACE) if state else None
    return trace


def request_phases(scope: Scope, phase: str) -> Phases | None:
    """A sampled request's path of phases, `phase` open from its arrival; None when it is not recorded."""
    trace = request_trace(scope)
    phases = trace.phases() if trace is not None else None
    if phases is not None:
        phases.enter(phase, scope["state"]["received_at"])  # stamped with the trace, by the middleware
    return phases


def note_error(scope: Scope, error: BaseException) -> None:
    """The error the request is answered with, for its span's status."""
    trace = request_trace(scope)
    if trace is not None:
        trace.fail(error)
