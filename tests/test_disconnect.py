"""Work cancelled when its HTTP client leaves: by the connection's own report of its loss (which
keeps no connection alive after its end), or, on a server without one, by a task that waits for
the ASGI disconnect."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import uvicorn

from router.errors import ClientDisconnected
from router.http.protocol import HttpLimits, guarded_protocol
from router.http.request import WATCH_LOSS, run_unless_disconnected
from tests.conftest import free_port


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


def test_a_closed_connection_is_freed_without_the_cycle_collector() -> None:
    """The scope a request leaves behind (and the body Litestar caches in it) goes with its
    connection once that closes: the connection's watch holds no reference back to it, so
    reference counting frees it, as uvicorn's own protocol is freed. Were it kept alive until a
    full collection, a burst of large bodies would stay resident (tests/e2e/test_memory_after_bursts.py)."""
    made: list[weakref.ref[Any]] = []

    class Recorded(guarded_protocol(HttpLimits())):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        assert scope["state"][WATCH_LOSS] is not None
        while (await receive()).get("more_body", False):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="off",
                                           access_log=False, http=Recorded, ws="none"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    gc.disable()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 5
        while made and made[0]() is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(made) == 1 and made[0]() is None, "the closed connection is still referenced"
    finally:
        gc.enable()
        server.should_exit = True
        thread.join(10)
