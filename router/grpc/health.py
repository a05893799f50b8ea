"""The standard `grpc.health.v1.Health` service, reflecting readiness: SERVING once every required
model serves, NOT_SERVING before that and while draining (what /health/ready says over HTTP).

Services: "" (the server) and `inference.GRPCInferenceService` report the server's readiness; a
model's name reports whether that model serves, a pipeline's whether every model it uses does (a
pipeline is a model to V2 clients); anything else is unknown (NOT_FOUND for Check,
SERVICE_UNKNOWN for Watch, as the health protocol asks). While a split host's engine is away or
hung, every service is NOT_SERVING.

A Watch stays open as long as its client likes and needs no key unless health is protected, so
Watch streams without an inference key are bounded per connection and in total, with the other
long streams (`router.grpc.streams`): over either bound a Watch is RESOURCE_EXHAUSTED, and the rest
of the server's concurrent calls stay for probes and keyed calls. A Watch with a key is not counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Final

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.access import Access, AccessPolicy
from router.errors import EngineUnavailable, ModelNotFound
from router.grpc.calls import call_of, check_access, hold_stream
from router.grpc.streams import OpenStreams
from router.inference_protocol.targets import Pipelines, find_target
from router.serving.facade import Serving

__all__ = ["ReadinessHealth", "health_status"]

#: How often a Watch re-reads readiness.
WATCH_INTERVAL_S: Final = 0.5


def health_status(runtime: Serving, pipelines: Pipelines, service: str, server_services: frozenset[str]) -> Any:
    """The health of `service`: the server's readiness, a model's or a pipeline's, or SERVICE_UNKNOWN."""
    if service in server_services:
        return health_pb2.HealthCheckResponse.SERVING if runtime.ready else health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        serving = find_target(runtime, pipelines, service).serving and not runtime.draining
    except ModelNotFound:
        return health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    except EngineUnavailable:  # a split host's engine away or hung: no model serves
        return health_pb2.HealthCheckResponse.NOT_SERVING
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


class ReadinessHealth(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """Check and Watch on the serving façade's readiness, behind the access policy's health level."""

    def __init__(self, runtime: Serving, pipelines: Pipelines, policy: AccessPolicy, service_name: str,
                 keyless: OpenStreams) -> None:
        self.runtime = runtime
        self.pipelines = pipelines
        self.policy = policy
        self.server_services = frozenset({"", service_name})
        self.keyless = keyless  # open long streams without an inference key

    async def Check(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        await check_access(self.policy, Access.HEALTH, call_of(context, "Check"), context)
        status = health_status(self.runtime, self.pipelines, request.service, self.server_services)
        if status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service[:64]!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: Any, context: aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        """The status now, then each change, until the client leaves."""
        call = call_of(context, "Watch")
        await check_access(self.policy, Access.HEALTH, call, context)
        counted = await hold_stream(self.keyless, self.policy, call, context)
        try:
            last = None
            while True:
                status = health_status(self.runtime, self.pipelines, request.service, self.server_services)
                if status != last:
                    yield health_pb2.HealthCheckResponse(status=status)
                    last = status
                await asyncio.sleep(WATCH_INTERVAL_S)
        finally:
            if counted is not None:
                self.keyless.closed(counted)
