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
    request body has been read: `receive` then yields nothing but the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    watcher.add_done_callback(lambda done: None if done.cancelled() else task.cancel())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled() and not _being_cancelled():
            raise ClientDisconnected("the client disconnected before its answer") from None
        raise
    finally:
        watcher.cancel()


def _being_cancelled() -> bool:
    """Whether the caller's own task is being cancelled (shutdown), not just the work."""
    current = asyncio.current_task()
    return current is not None and current.cancelling() > 0


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
