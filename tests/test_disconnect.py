"""Work cancelled when its HTTP client leaves: by the connection's own report of its loss, or,
on a server without one, by a task that waits for the ASGI disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from router.errors import ClientDisconnected
from router.http.disconnect import WATCH_LOSS, run_unless_disconnected


def request(state: dict[str, Any], receive: Callable[[], Any] | None = None) -> Any:
    return SimpleNamespace(scope={"state": state}, receive=receive)


async def test_without_a_watch_a_task_waits_for_the_disconnect_message() -> None:
    left = asyncio.Event()

    async def receive() -> dict[str, str]:
        await left.wait()
        return {"type": "http.disconnect"}

    work = asyncio.ensure_future(asyncio.sleep(30))
    asyncio.get_running_loop().call_later(0.05, left.set)
    with pytest.raises(ClientDisconnected):
        await run_unless_disconnected(request({}, receive), work)
    await asyncio.sleep(0)
    assert work.cancelled()
    assert await run_unless_disconnected(request({}, receive), asyncio.sleep(0, "answer")) == "answer"


async def test_a_watching_connection_cancels_the_work_and_forgets_it_after() -> None:
    callbacks: list[Callable[[], None] | None] = []
    lost = False

    def watch(callback: Callable[[], None], on: bool) -> bool:
        callbacks.append(callback if on else None)
        return not lost

    assert await run_unless_disconnected(request({WATCH_LOSS: watch}), asyncio.sleep(0, "answer")) == "answer"
    assert len(callbacks) == 2 and callbacks[1] is None  # watched while it ran, then not

    callbacks.clear()
    work = asyncio.ensure_future(asyncio.sleep(30))
    running = asyncio.ensure_future(run_unless_disconnected(request({WATCH_LOSS: watch}), work))
    await asyncio.sleep(0.01)
    assert callbacks[0] is not None
    callbacks[0]()  # the connection is lost
    with pytest.raises(ClientDisconnected):
        await running
    assert work.cancelled()

    lost = True
    never = asyncio.sleep(30)
    with pytest.raises(ClientDisconnected):  # lost before the work began: it never runs
        await run_unless_disconnected(request({WATCH_LOSS: watch}), never)
    assert never.cr_frame is None  # closed, not left unawaited


async def test_a_shutdown_s_cancel_is_not_taken_for_the_client_leaving() -> None:
    callbacks: list[Callable[[], None]] = []
    running = asyncio.ensure_future(run_unless_disconnected(
        request({WATCH_LOSS: lambda callback, on: callbacks.append(callback) or True}), asyncio.sleep(30)))
    await asyncio.sleep(0.01)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
