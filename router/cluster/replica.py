"""A device replica: the router's `Runtime` for one device, inside one Ray Serve replica.

Ray reserves the device (`num_gpus`, or a CPU slice), starts the replica, restarts it when it
dies and adds or removes replicas as load changes. Inside, everything is the single-process
router's: per-model queues, batching, batch admission, memory ledger and residency. The replica
reports to the placement controller every `cluster.stats_period_s` and carries out the commands
it gets back (hold a copy, release one); Ray's request routers see the same report, compacted,
through `record_routing_stats`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from router.cluster.layout import replica_fleet
from router.cluster.reports import Command, ErrorReply, ReplicaReport, Reply, model_loads
from router.config import FleetConfig
from router.errors import RouterError
from router.http.metrics import RouterMetrics
from router.sdk.plugin import Payload
from router.serving.plan import resolve_fleet
from router.serving.registry import PluginRegistry
from router.serving.runtime import in_process

__all__ = ["DeviceReplica"]

log = logging.getLogger("router.cluster.replica")
#: How long a retiring replica lets its queued and running work finish.
DRAIN_S = 20.0


class DeviceReplica:
    """One device's router, as a Serve deployment class (options come from `router.cluster.app`)."""

    async def __init__(  # type: ignore[misc]  # Ray awaits it
        self, fleet: dict[str, Any], node_type: str, placement: DeploymentHandle[Any],
    ) -> None:
        config = FleetConfig.model_validate(fleet)
        assert config.cluster is not None
        self._period_s = config.cluster.stats_period_s
        mine = replica_fleet(config, node_type)
        registry = PluginRegistry.from_entry_points(only={m.plugin for m in mine.models.values()})
        node = config.cluster.node_types[node_type]
        self.runtime = in_process(resolve_fleet(mine, registry, f"cluster replica ({node_type})"),
                                   cpu_workers=max(1, int(node.num_cpus)))
        self.metrics = RouterMetrics()
        self.metrics.bind(self.runtime)
        await self.runtime.start()
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.node_type = node_type
        self._node_id = ray.get_runtime_context().get_node_id()
        self._started_at = time.time()
        self._placement = placement
        self._applying: set[asyncio.Task[None]] = set()
        self._reporter = asyncio.create_task(self._report_loop(), name="cluster-report")
        log.info("device replica %s (%s) serving %d model(s) on %s", self.replica, node_type, len(mine.models),
                 ", ".join(mine.devices))

    # -- requests ---------------------------------------------------------------------------

    async def predict(
        self, model: str, body: bytes, media_type: str, filename: str | None = None, *, priority: int | None = None,
        timeout_ms: float | None = None, request_id: str | None = None, avoid: tuple[str, ...] = (),
        pixels: Any = None, wait_for_room: bool = False, must_finish: bool = False, shadow: bool = False,
    ) -> Reply:
        """One input through the model (a pipeline's step: decoded `pixels`, and how it waits).
        `avoid` is for the request router only (replicas that refused)."""
        cold = not self.runtime.core.is_serving(model)
        try:
            answer = await self.runtime.submit(model, Payload(body, media_type, filename, pixels=pixels),
                                               priority=priority, timeout_ms=timeout_ms, request_id=request_id,
                                               wait_for_room=wait_for_room, must_finish=must_finish,
                                               shadow=shadow)
        except RouterError as exc:
            return Reply(self.replica, error=ErrorReply.of(exc), cold=cold)
        return Reply(self.replica, answer=answer, cold=cold)

    # -- reports and commands ---------------------------------------------------------------

    def report(self, full: bool = True) -> ReplicaReport:
        models = self.runtime.models()
        devices = self.runtime.devices()
        device = next((d for d in devices if d.available), None)
        budget = device.budget_bytes if device else 0
        committed = (device.weights_bytes + device.reserved_bytes) if device else 0
        used = max(committed, device.used_bytes or 0) if device else 0
        return ReplicaReport(
            replica=self.replica, node_type=self.node_type, node_id=self._node_id, pid=os.getpid(),
            device=device.name if device else "", budget_bytes=budget, free_bytes=max(0, budget - used),
            draining=self.runtime.draining, loads=model_loads(models),
            models=tuple(models) if full else (), devices=tuple(devices) if full else (),
            metrics_text=self.metrics.render().decode() if full else "", started_at=self._started_at, at=time.time(),
        )

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray's routers read this (every `cluster.stats_period_s`, through Ray's controller)."""
        return self.report(full=False).route_view().as_stats()

    async def _report_loop(self) -> None:
        """Report, then carry out what placement answers. A failed report (placement restarting)
        is logged and retried; the loop never ends while the replica lives."""
        while True:
            try:
                commands: list[Command] = await self._placement.heartbeat.remote(self.report())
                for command in commands:
                    self._apply(command)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  # a failed report is retried next period
                log.warning("report to placement failed (retrying): %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(self._period_s)

    def _apply(self, command: Command) -> None:
        async def apply() -> None:
            try:
                if command.verb == "load":
                    await self.runtime.load_model(command.model)
                elif command.verb == "release":
                    await self.runtime.release_model(command.model, unload=command.unload)
                elif command.verb == "unload":
                    await self.runtime.unload_model(command.model)
            except RouterError as exc:
                log.warning("placement's %s of %s failed: %s", command.verb, command.model, exc.detail)

        log.info("placement: %s %s", command.verb, command.model)
        task = asyncio.create_task(apply(), name=f"{command.verb}-{command.model}")
        self._applying.add(task)
        task.add_done_callback(self._applying.discard)

    # -- Ray's lifecycle hooks --------------------------------------------------------------

    async def check_health(self) -> None:
        if self._reporter.done():
            raise RuntimeError("the report loop ended")  # Ray restarts the replica

    async def __del__(self) -> None:
        """Ray Serve's shutdown hook (called explicitly, not by the garbage collector): refuse new
        work, answer what was accepted, unload."""
        self._reporter.cancel()
        await self.runtime.drain(DRAIN_S)
        await self.runtime.stop()
