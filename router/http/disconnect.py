"""Cancelling work whose HTTP client went away, so its inputs are dropped before their batch runs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final, TypeVar

from litestar.connection import ASGIConnection
from litestar.types import Receive

from router.errors import ClientDisconnected

__all__ = ["WATCH_LOSS", "Watch", "run_unless_disconnected"]

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
