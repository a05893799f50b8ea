"""The HTTP front of a cluster: the router's Litestar app over `ClusterRuntime`.

Two ways to put it in front of the device replicas, both built here:

- `FrontServer` (the default): a Serve replica that runs its own uvicorn server on
  `cluster.front.port`, one hop from the device replicas (deployment handles). Ray's HTTP proxy
  stays off.
- `IngressFront` for `serve.ingress`: the same app behind Ray Serve's HTTP proxy, two hops (proxy
  to ingress replica to device replica). Kept for the benchmark that chose between them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import uvicorn
from litestar import Litestar
from ray.serve.handle import DeploymentHandle

from router.cluster.calls import RayCalls
from router.cluster.front import ClusterRuntime
from router.cluster.metrics import ClusterMetrics
from router.config import FleetConfig, ServerSettings
from router.http.app import create_app
from router.http.auth import policy_from_settings
from router.serving.facade import Serving
from router.tracing import tracing_from_environment

__all__ = ["FrontServer", "IngressFront", "build_front_app"]

log = logging.getLogger("router.cluster.server")


def build_front_app(
    fleet: FleetConfig, devices: Mapping[str, DeploymentHandle[Any]], placement: DeploymentHandle[Any],
) -> Litestar:
    """The router's app (settings from MODEL_ROUTER_* and OTEL_* in the replica's environment) over the cluster."""
    settings = ServerSettings()
    runtime = Serving(ClusterRuntime(fleet, RayCalls(devices, placement)))
    metrics = ClusterMetrics()
    metrics.bind_cluster(runtime)
    return create_app(runtime, max_body_bytes=settings.max_body_bytes, drain_timeout_s=settings.drain_timeout_s,
                      access_policy=policy_from_settings(settings), bound_metrics=metrics,
                      tracing=tracing_from_environment())


class FrontServer:
    """A Serve deployment class: uvicorn serving the app, in the replica's own event loop."""

    async def __init__(  # type: ignore[misc]  # Ray awaits it
        self, fleet: dict[str, Any], devices: dict[str, DeploymentHandle[Any]], placement: DeploymentHandle[Any],
    ) -> None:
        config = FleetConfig.model_validate(fleet)
        assert config.cluster is not None
        front = config.cluster.front
        app = build_front_app(config, devices, placement)
        self.server = uvicorn.Server(uvicorn.Config(app, host=front.host, port=front.port, log_config=None, lifespan="on",
                                                    access_log=False, timeout_graceful_shutdown=5))
        self._serving = asyncio.create_task(self.server.serve(), name="front-http")
        while not self.server.started:  # fail the replica (Ray retries it) if the port cannot be bound
            if self._serving.done():
                raise RuntimeError(f"the front could not serve on {front.host}:{front.port}: "
                                   f"{self._serving.exception() or 'uvicorn exited'}")
            await asyncio.sleep(0.05)
        log.info("cluster front serving on http://%s:%d", front.host, front.port)

    async def check_health(self) -> None:
        if self._serving.done():
            raise RuntimeError("the front's HTTP server stopped")

    async def __del__(self) -> None:
        """Ray Serve's shutdown hook: stop taking connections, let the lifespan drain."""
        if not hasattr(self, "_serving"):  # the constructor failed
            return
        self.server.should_exit = True
        await asyncio.wait_for(self._serving, 30)


class IngressFront:
    """For `serve.ingress()`: the same app, built on the ingress replica behind Ray's HTTP proxy."""

    def __init__(self, fleet: dict[str, Any], devices: dict[str, DeploymentHandle[Any]],
                 placement: DeploymentHandle[Any]) -> None:
        self._fleet = FleetConfig.model_validate(fleet)
        self._devices = devices
        self._placement = placement

    def __serve_build_asgi_app__(self) -> Litestar:
        return build_front_app(self._fleet, self._devices, self._placement)
