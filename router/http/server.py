"""Running the app under uvicorn, with the connection limits, a drain on the first SIGTERM or
SIGINT, and SIGHUP re-reading the fleet file."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn
from litestar import Litestar

from router.config import ServerSettings
from router.http.early import EarlyRefusals
from router.http.protocol import HttpLimits, guarded_protocol
from router.serving.facade import Serving

__all__ = ["DrainingServer", "run_server"]

log = logging.getLogger("router.http.server")


class DrainingServer(uvicorn.Server):
    """First signal: refuse new requests (503), drain queued and running work, then exit.
    A second signal falls through to uvicorn's own handling."""

    def __init__(self, config: uvicorn.Config, runtime: Serving, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Future[Any] | None = None
        self._reload_task: asyncio.Future[Any] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_signal_handler(signal.SIGHUP, self._reload)
        await super().serve(sockets)

    def _reload(self) -> None:
        """SIGHUP: apply the fleet file's changes, in the background, one reload at a time."""
        if self._reload_task is not None and not self._reload_task.done():
            log.warning("received SIGHUP while a reload runs: ignored")
            return

        async def reload() -> None:
            try:
                report = await self.runtime.reload()
            except Exception as exc:  # noqa: BLE001  # a bad file: say so, keep serving what serves
                log.error("reload on SIGHUP failed, nothing changed: %s", exc)
                return
            log.info("reload on SIGHUP: added %s, changed %s, removed %s, errors %s, warnings %s", report.added,
                     report.changed, report.removed, report.errors, report.warnings)

        log.info("received SIGHUP: re-reading the fleet file")
        self._reload_task = asyncio.ensure_future(reload())

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None or self.runtime.draining:
            super().handle_exit(sig, frame)
            return
        self.runtime.begin_drain()
        log.info("received %s: draining before exit", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        async def drain_then_exit() -> None:
            try:
                await self.runtime.drain(self.drain_timeout_s)
            finally:
                self.should_exit = True

        self._drain_task = asyncio.ensure_future(drain_then_exit())


def run_server(app: Litestar, runtime: Serving, settings: ServerSettings, *,
               sockets: list[socket.socket] | None = None, max_connections: int | None = None) -> None:
    """Serve `app` until a signal: HTTP/1.1 with the header, count and read-time limits of the
    settings (`router.http.protocol`), `max_connections` open connections (the longest-idle one
    closed for a new one) and running requests, and predict requests that will be refused answered
    from their headers (`router.http.early`). uvicorn's own `limit_concurrency` is off: it counts
    idle connections too, and refuses liveness with the rest. `sockets`: listening sockets made by
    the caller (a front process of a split host) instead of the settings' host and port;
    `max_connections`: this process's share of the setting. A client's address is the connection's
    peer; X-Forwarded-For is read only with `proxy_headers` on, from `forwarded_allow_ips`."""
    limits = HttpLimits(max_header_bytes=settings.max_header_bytes, max_headers=settings.max_headers,
                        header_timeout_s=settings.header_timeout_s, body_timeout_s=settings.body_timeout_s,
                        max_connections=max_connections or settings.max_connections,
                        max_requests=max_connections or settings.max_connections)
    protocol = guarded_protocol(limits, EarlyRefusals(runtime, app.state.access_policy, app.state.tracing,
                                                      app.state.pipelines))
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, lifespan="on",
                            timeout_graceful_shutdown=5, access_log=False, http=protocol,
                            ws="none", timeout_keep_alive=settings.keep_alive_s,
                            proxy_headers=settings.proxy_headers, forwarded_allow_ips=settings.forwarded_allow_ips)
    server = DrainingServer(config, runtime, settings.drain_timeout_s)
    log.info("serving %s on http://%s:%d", settings.config, settings.host, settings.port)
    server.run(sockets=sockets)
