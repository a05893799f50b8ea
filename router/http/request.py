"""One HTTP request around its handler: what every route reads the same way, in one place.

- its headers (`X-Priority`, `X-Timeout-Ms`, `Content-Length`), parsed the same way by the app and
  by the connection's early refusal (`router.http.early`), so both give the same answer and words;
- the facts kept in its scope (arrival, trace) and the runtime and pipeline runner the app serves;
- its work cancelled if the client goes away, so its inputs are dropped before their batch runs;
- its structured access line, whoever answered it: the app, or the connection itself when it
  refused the request from its headers;
- its body's bytes counted, to hand memory back after bursts of large bodies: glibc's allocator
  keeps what bodies, decoded tensors and images leave behind when they are freed (after 64
  concurrent 15 MB bodies the process stays gigabytes larger, though it does not keep growing);
  `malloc_trim(0)` returns the free pages, off the event loop, once a burst's requests have
  finished. Elsewhere than glibc it is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Final, TypeVar

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.types import Receive, Scope

from router.errors import ClientDisconnected, InputError, brief
from router.logs import REQUEST_ID_PATTERN, incoming_or_new, info_line
from router.pipelines import PipelineRunner
from router.serving.facade import Serving
from router.serving.memory import malloc_trim
from router.tracing.api import Phases, RequestSpan

__all__ = [
    "QUIET_PATHS", "REQUEST_ID_PATTERN", "TRACE", "WATCH_LOSS", "BodyMemory", "Watch", "access_line", "announced_length",
    "incoming_or_new", "malloc_trim", "mark_received", "note_error", "number_header", "pipelines_of", "priority_header",
    "received_at", "request_phases", "request_trace", "run_unless_disconnected", "runtime_of",
]


# -- headers ---------------------------------------------------------------------------------------


#: A decimal number as people write it: no '1_0', no 'inf', no hex.
DECIMAL = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
INTEGER = re.compile(r"^[+-]?\d{1,6}$")


def number_header(name: str, raw: str | None) -> float | None:
    """A finite number (X-Timeout-Ms), or None when the header is absent; InputError otherwise."""
    if raw is None:
        return None
    value = float(raw.strip()) if DECIMAL.match(raw.strip()) else math.nan
    if not math.isfinite(value):
        raise InputError(f"{name} must be a number, like 500 or 2.5, got {brief(raw, 40)}")
    return value


def priority_header(raw: str | None) -> int | None:
    """X-Priority as an integer, or None when absent; InputError otherwise."""
    if raw is None:
        return None
    if not INTEGER.match(raw.strip()):
        raise InputError(f"X-Priority must be an integer, got {brief(raw, 40)}")
    return int(raw.strip())


def announced_length(raw: str | None) -> int | None:
    """The body's Content-Length, or None when it is not announced (chunked) or unreadable."""
    return int(raw) if raw is not None and raw.isdigit() else None


# -- the scope's facts ------------------------------------------------------------------------


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


# -- the client gone --------------------------------------------------------------------------


T = TypeVar("T")
#: `watch(callback, True)`: call `callback` once if the connection is lost (False: it is lost
#: already); `watch(callback, False)`: not any more.
Watch = Callable[[Callable[[], None], bool], bool]
#: Where a request's scope state holds its connection's `Watch`, if the connection offers one.
WATCH_LOSS: Final = "watch_loss"


async def run_unless_disconnected(request: ASGIConnection[Any, Any, Any, Any], work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected (499,
    for the access log: the client's leaving is not the server's error). Call only after the
    request body has been read: `receive` then yields nothing but the disconnect. The work runs
    in the caller's task. A connection that reports its own loss (`router.http.protocol`, under
    `WATCH_LOSS` in the scope state) calls back when it is lost; elsewhere a task waits on
    `receive` for the disconnect."""
    current = asyncio.current_task()
    assert current is not None
    state = {"gone": False, "finished": False}

    def gone() -> None:
        if not state["finished"]:
            state["gone"] = True
            current.cancel()

    watch: Watch | None = request.scope["state"].get(WATCH_LOSS)
    watcher = None
    if watch is None:
        watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
        watcher.add_done_callback(lambda done: None if done.cancelled() or done.exception() is not None else gone())
    elif not watch(gone, True):  # lost already
        if isinstance(work, Coroutine):
            work.close()
        raise ClientDisconnected("the client disconnected before its answer")
    try:
        return await work
    except asyncio.CancelledError:
        if state["gone"] and current.cancelling() == 1:  # our cancel alone, not a shutdown's
            current.uncancel()
            raise ClientDisconnected("the client disconnected before its answer") from None
        raise
    finally:
        state["finished"] = True
        if watcher is not None:
            watcher.cancel()
        else:
            assert watch is not None
            watch(gone, False)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# -- the access line --------------------------------------------------------------------------


access_log = logging.getLogger("router.access")
MODEL_PATH = re.compile(r"^/models/([^/]+)")
#: Polled paths: not worth a line each.
QUIET_PATHS = frozenset({"/metrics", "/health/live", "/health/ready", "/ui/state"})


def access_line(method: str | None, path: str, status: int, seconds: float,
                fields: Mapping[str, Any] | None = None, request_id: str | None = None) -> None:
    """Log `request` with the method, path, status (499 when none was sent), duration, the model
    named in the path, and `fields` (what the handler recorded)."""
    if path in QUIET_PATHS:
        return
    line: dict[str, Any] = {"method": method, "path": path[:256], "status": status or 499,
                            "duration_ms": round(seconds * 1000, 3)}
    match = MODEL_PATH.match(path)
    if match:
        line["model"] = match.group(1)[:64]
    line.update(fields or {})
    info_line(access_log, "request", line, request_id)


# -- body memory ------------------------------------------------------------------------------


memory_log = logging.getLogger("router.http.memory")
TRIM_AFTER_BYTES = 64 * 1024 * 1024
CHECK_INTERVAL_S = 1.0
BUSY_TRIM_INTERVAL_S = 10.0


class BodyMemory:
    """Counts body bytes and requests in flight; trims once a burst of large bodies is over (or
    every 10 s while one lasts)."""

    def __init__(self, threshold_bytes: int = TRIM_AFTER_BYTES, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold_bytes = threshold_bytes
        self.clock = clock
        self.since_trim = 0
        self.in_flight = 0
        self.last_trim = clock()
        self.trims = 0

    def received(self, size: int) -> None:
        self.since_trim += size

    def due(self) -> bool:
        """Enough body bytes since the last trim, and the burst is over or has lasted a while."""
        if self.since_trim < self.threshold_bytes:
            return False
        return self.in_flight == 0 or self.clock() - self.last_trim >= BUSY_TRIM_INTERVAL_S

    async def trim_after_bursts(self) -> None:
        """Run for the app's lifetime (the lifespan starts and cancels it)."""
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            if self.due():
                self.since_trim = 0
                self.last_trim = self.clock()
                started = time.perf_counter()
                if not await asyncio.to_thread(malloc_trim):
                    return
                self.trims += 1
                memory_log.debug("returned free heap memory to the system in %.1f ms", (time.perf_counter() - started) * 1000)
