"""Cancelling work whose HTTP client went away, so its inputs are dropped before their batch runs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from litestar.types import Receive

from router.errors import ClientDisconnected

__all__ = ["run_unless_disconnected"]

T = TypeVar("T")


async def run_unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected (499,
    for the access log: the client's leaving is not the server's error). Call only after the
    request body has been read: `receive` then yields nothing but the disconnect. The work runs
    in the caller's task (one task per request, the watcher's, not two)."""
    current = asyncio.current_task()
    assert current is not None
    state = {"gone": False, "finished": False}

    def on_disconnect(done: asyncio.Task[None]) -> None:
        if done.cancelled() or done.exception() is not None or state["finished"]:
            return
        state["gone"] = True
        current.cancel()

    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    watcher.add_done_callback(on_disconnect)
    try:
        return await work
    except asyncio.CancelledError:
        if state["gone"] and current.cancelling() == 1:  # our cancel alone, not a shutdown's
            current.uncancel()
            raise ClientDisconnected("the client disconnected before its answer") from None
        raise
    finally:
        state["finished"] = True
        watcher.cancel()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
