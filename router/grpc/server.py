"""The gRPC endpoint: grpcio's asyncio server, on the event loop the HTTP app's lifespan runs on,
serving the Open Inference Protocol (`inference.GRPCInferenceService`) and `grpc.health.v1`.

It is a `router.http.app.Listener`: the app's lifespan starts it after the serving core and stops
it after the drain, so every process that serves the app serves gRPC too. grpcio sets
SO_REUSEPORT on Linux, so several such processes can share the port. Messages are limited to the
HTTP body limit in both directions, and concurrent RPCs to `max_connections` (RESOURCE_EXHAUSTED
beyond). Calls without an inference key that stay open take at most a quarter of those each:
long streams, health Watch and, on a server without keys, ModelStreamInfer (`grpc_keyless_streams`,
`grpc_keyless_streams_per_connection` on one connection; more are refused, `router.grpc.streams`),
and calls whose request message has not
arrived (`grpc_keyless_awaited`; one more ends the longest-waiting one, and a message must arrive
within `body_timeout_s`, `router.grpc.arrival`); so probes and keyed calls always have room.
"""

from __future__ import annotations

import logging
from typing import Final

from grpc import aio
from grpc_health.v1 import health_pb2_grpc

from router.access import AccessPolicy
from router.config import ServerSettings
from router.errors import ConfigError
from router.grpc.arrival import MessageArrival
from router.grpc.health import ReadinessHealth
from router.grpc.inference import Inference
from router.grpc.service import SERVICE_NAME, InferenceService
from router.grpc.streams import OpenStreams, share
from router.inference_protocol.shared_memory import SharedMemoryRegistry
from router.inference_protocol.targets import Pipelines
from router.serving.facade import Serving
from router.tracing.api import Tracing

__all__ = ["GrpcServer", "grpc_server"]

log = logging.getLogger("router.grpc")
STOP_GRACE_S: Final = 5.0


class GrpcServer:
    """Start and stop the gRPC endpoint; `port` is the one bound (the setting's, or the system's choice for 0)."""

    def __init__(self, service: InferenceService, health: ReadinessHealth, *, host: str, port: int,
                 max_message_bytes: int, max_concurrent_rpcs: int, arrival: MessageArrival,
                 reuse_port: bool = False) -> None:
        self.service, self.health, self.arrival = service, health, arrival
        self.address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
        self.options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", int(reuse_port)),  # on: fronts of a split host share it; off: a taken port fails
        ]
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.port: int | None = None
        self._server: aio.Server | None = None

    async def start(self) -> None:
        server = aio.server(options=self.options, maximum_concurrent_rpcs=self.max_concurrent_rpcs,
                            interceptors=(self.arrival,))
        server.add_generic_rpc_handlers((self.service.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        try:
            self.port = server.add_insecure_port(self.address)
        except RuntimeError as exc:
            raise ConfigError(f"MODEL_ROUTER_GRPC_PORT: cannot listen on {self.address}: {exc}") from None
        await server.start()
        self._server = server
        log.info("serving gRPC on %s", self.address.rsplit(":", 1)[0] + f":{self.port}")

    async def stop(self) -> None:
        """Stop taking calls; calls still running get `STOP_GRACE_S`, then are cancelled."""
        if self._server is not None:
            await self._server.stop(STOP_GRACE_S)
            self._server = None


def grpc_server(runtime: Serving, settings: ServerSettings, policy: AccessPolicy,
                shared_memory: SharedMemoryRegistry, pipelines: Pipelines, tracing: Tracing | None = None, *,
                reuse_port: bool = False) -> GrpcServer:
    """The gRPC endpoint the settings ask for (`grpc_port`; the caller skips it for 0). `pipelines`:
    the runner the HTTP app serves pipelines with (one per process: its counters are the pipelines');
    `tracing`: spans for calls, as the app's for requests; `reuse_port`: share the port with the
    other fronts of a split host (whose parent holds it), else a port another process has fails."""
    inference = Inference(runtime, pipelines, shared_memory, policy, max_message_bytes=settings.max_body_bytes,
                          max_items=settings.max_items, frames_in_flight=settings.grpc_stream_frames, tracing=tracing)
    keyless = OpenStreams(settings.grpc_keyless_streams_per_connection,
                          share(settings.grpc_keyless_streams, settings.max_connections))
    service = InferenceService(runtime, pipelines, inference, shared_memory, policy, tracing, keyless=keyless)
    arrival = MessageArrival(policy, limit=share(settings.grpc_keyless_awaited, settings.max_connections),
                             timeout_s=settings.body_timeout_s)
    return GrpcServer(service, ReadinessHealth(runtime, pipelines, policy, SERVICE_NAME, keyless), host=settings.host,
                      port=settings.grpc_port, max_message_bytes=settings.max_body_bytes,
                      max_concurrent_rpcs=settings.max_connections, arrival=arrival, reuse_port=reuse_port)
