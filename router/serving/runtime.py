"""The runtime: deployments, device schedulers and the request path, usable without HTTP.

`submit` is the whole life of one request: check, preprocess on the CPU pool, queue, wait for
its batch (or its deadline), postprocess. Every accepted request is answered exactly once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any, TypeVar

from router.config import FleetConfig
from router.errors import (
    DeadlineExceeded,
    InputError,
    ModelNotFound,
    ModelUnavailable,
    QueueFull,
    RouterError,
    ShuttingDown,
    UnsupportedMediaType,
)
from router.scheduling.probes import MemoryProbe, make_probe
from router.scheduling.queue import ModelQueue, Ticket, reject
from router.scheduling.scheduler import DeviceScheduler
from router.sdk.plugin import Payload, PluginContext
from router.serving.deployment import Deployment
from router.serving.instance import InstanceState, ModelInstance
from router.serving.loading import load_deployment
from router.serving.plan import FleetPlan
from router.serving.telemetry import Telemetry, TelemetryFanout

__all__ = ["Answer", "Runtime"]

log = logging.getLogger("router.serving.runtime")
T = TypeVar("T")
ProbeFactory = Callable[[str, str], "MemoryProbe | None"]


@dataclass(frozen=True)
class Answer:
    request_id: str
    model: str
    output: Any
    queue_wait_s: float
    batch_size: int
    execution_s: float
    memory_delta_bytes: int | None = None
    input_info: dict[str, Any] = field(default_factory=dict)


def outcome_of(error: BaseException) -> str:
    """The `outcome` label of a failed request."""
    name = type(error).__name__
    labels = {
        "QueueFull": "rejected_full", "ShuttingDown": "rejected_shutdown", "ModelUnavailable": "unavailable",
        "DeviceOutOfMemory": "out_of_memory", "ExecutionTimeout": "execution_timeout",
        "DeadlineExceeded": "deadline", "ModelNotFound": "not_found",
    }
    if name in labels:
        return labels[name]
    if isinstance(error, InputError):
        return "bad_input"
    if isinstance(error, asyncio.CancelledError):
        return "cancelled"
    return "error"


class Runtime:
    def __init__(
        self,
        plan: FleetPlan,
        *,
        cpu_workers: int = 0,
        probe_factory: ProbeFactory = make_probe,
        telemetry: Telemetry | None = None,
        clock: Callable[[], float] = time.monotonic,
        plugin_extra: dict[str, Any] | None = None,
    ) -> None:
        self.plan = plan
        self.fleet: FleetConfig = plan.fleet
        self.clock = clock
        self.telemetry = TelemetryFanout()
        if telemetry is not None:
            self.telemetry.sinks.append(telemetry)
        self._probe_factory = probe_factory
        self._cpu = ThreadPoolExecutor(cpu_workers or os.cpu_count() or 1, thread_name_prefix="router-cpu")
        self.schedulers: dict[str, DeviceScheduler] = {}
        self.device_errors: dict[str, str] = {}
        self.deployments: dict[str, Deployment] = {}
        self._tickets: set[Ticket] = set()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False
        self._closed = False
        self._load_task: asyncio.Task[None] | None = None
        self._build(plugin_extra or {})

    # -- construction and lifecycle ---------------------------------------------------------

    def _build(self, plugin_extra: dict[str, Any]) -> None:
        for name, model_plan in self.plan.models.items():
            config = self.fleet.models[name]
            queue = ModelQueue(name, max_size=config.queue.max_size, priority_levels=config.queue.priority_levels)
            deployment = Deployment(name, config, model_plan.plugin, model_plan.options, queue)
            context = PluginContext(name, self.fleet.model_store, self.fleet.allow_absolute_paths, dict(plugin_extra))
            for index, device in enumerate(config.instance_devices):
                plugin = model_plan.plugin.cls(model_plan.options, context)
                instance = ModelInstance(
                    name, index, device, plugin,
                    execution_timeout_s=config.execution.timeout_ms / 1000.0,
                    on_batch=self.telemetry.observe_batch,
                    clock=self.clock,
                )
                deployment.instances.append(instance)
            self.deployments[name] = deployment

    async def start(self) -> None:
        """Start the device schedulers and begin loading models in the background."""
        for device, config in self.fleet.devices.items():
            try:
                probe = self._probe_factory(device, config.probe)
                scheduler = DeviceScheduler(device, config, probe, clock=self.clock)
                scheduler.resolve_budget()
            except Exception as exc:
                self.device_errors[device] = f"{type(exc).__name__}: {exc}"
                log.error("device %s unavailable: %s", device, exc)
                continue
            self.schedulers[device] = scheduler
            scheduler.start()
        for deployment in self.deployments.values():
            for instance in deployment.instances:
                if instance.device in self.schedulers:
                    self.schedulers[instance.device].attach(deployment, instance)
        self._load_task = asyncio.create_task(self.load_all(), name="load-models")

    async def load_all(self) -> None:
        await asyncio.gather(*(self._load(d) for d in self.deployments.values()))
        # Everything loaded so far (frameworks, weights) lives as long as the process: keep the
        # cyclic collector from scanning it, or each full collection stalls the event loop.
        gc.freeze()

    async def wait_loaded(self) -> None:
        if self._load_task is not None:
            await asyncio.shield(self._load_task)

    async def _load(self, deployment: Deployment) -> None:
        await load_deployment(deployment, self.schedulers, self.device_errors)
        for instance in deployment.instances:
            if instance.device in self.schedulers:
                self.schedulers[instance.device].notify()

    @property
    def ready(self) -> bool:
        """Every required model loaded, warmed and serving, and not shutting down."""
        if self.draining:
            return False
        required = [d for d in self.deployments.values() if d.config.required]
        return all(d.serving for d in required) and all(d.loaded or d.error for d in self.deployments.values())

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work, let queued and running work finish, then answer whatever is left with 503."""
        self.draining = True
        log.info("draining: %d request(s) in flight, timeout %.1fs", self._inflight, timeout_s)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            log.warning("drain timeout: answering %d remaining request(s) with 503", len(self._tickets))
        self._closed = True
        for ticket in list(self._tickets):
            for deployment in self.deployments.values():
                deployment.queue.withdraw(ticket)
            reject(ticket, ShuttingDown("server is shutting down"))
        try:
            await asyncio.wait_for(self._idle.wait(), 5.0)
        except TimeoutError:
            log.error("%d request(s) still in flight after drain", self._inflight)

    async def stop(self) -> None:
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        for scheduler in self.schedulers.values():
            await scheduler.stop()
        for deployment in self.deployments.values():
            for instance in deployment.instances:
                if instance.state is InstanceState.READY:
                    try:
                        await asyncio.wait_for(instance.call(instance.plugin.unload), 5.0)
                    except Exception:
                        log.exception("unloading %s failed", instance.key)
                instance.shutdown()
        self._cpu.shutdown(wait=False, cancel_futures=True)

    # -- the request path -------------------------------------------------------------------

    def deployment(self, name: str) -> Deployment:
        try:
            return self.deployments[name]
        except KeyError:
            known = ", ".join(sorted(self.deployments)) or "none"
            raise ModelNotFound(f"no model named {name!r}; models: {known}") from None

    def precheck(
        self, model: str, *, priority: int | None = None, timeout_ms: float | None = None,
        received_at: float | None = None,
    ) -> None:
        """Refuse, from the model name and the request's headers alone, what `submit` would refuse
        before running anything (unknown model, bad header, shutting down, model not serving,
        queue full, predicted to miss its deadline), so that the caller need not read the body.
        Takes nothing: `submit` decides again."""
        deployment = self.deployment(model)
        now = self.clock()
        started = now if received_at is None else min(received_at, now)
        try:
            self._check_accepting(deployment)
            check_priority(deployment, priority)
            budget_s = check_timeout(deployment, timeout_ms) - (now - started)
            deployment.queue.check_room(now)
            check_predicted_wait(deployment, budget_s, now, take_probe=False)
        except RouterError as exc:
            self._count(deployment, outcome_of(exc), started)
            raise

    def _count(self, deployment: Deployment, outcome: str, started: float) -> None:
        deployment.outcomes[outcome] += 1
        self.telemetry.observe_request(deployment.name, outcome, self.clock() - started)

    async def submit(
        self,
        model: str,
        payload: Payload,
        *,
        priority: int | None = None,
        timeout_ms: float | None = None,
        request_id: str | None = None,
        received_at: float | None = None,
    ) -> Answer:
        """Run one input through a model. Raises a RouterError subclass on any failure.
        The deadline counts from `received_at` (the runtime's clock) when the caller knows it."""
        deployment = self.deployment(model)
        request_id = request_id or uuid.uuid4().hex
        started = self.clock() if received_at is None else min(received_at, self.clock())
        outcome = "error"
        self._inflight += 1
        self._idle.clear()
        try:
            answer = await self._submit(deployment, payload, priority, timeout_ms, request_id, started)
            outcome = "ok"
            self.telemetry.observe_answer(deployment.name, self.clock() - started, check_timeout(deployment, timeout_ms))
            return answer
        except (RouterError, asyncio.CancelledError) as exc:
            outcome = outcome_of(exc)
            raise
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
            self._count(deployment, outcome, started)

    async def _submit(
        self, deployment: Deployment, payload: Payload, priority: int | None,
        timeout_ms: float | None, request_id: str, started: float,
    ) -> Answer:
        self._check_accepting(deployment)
        check_media_type(deployment, payload)
        level = check_priority(deployment, priority)
        deadline = started + check_timeout(deployment, timeout_ms)
        plugin = deployment.front
        queue = deployment.queue
        now = self.clock()
        measure = check_predicted_wait(deployment, deadline - now, now)
        queue.reserve_slot(started)
        try:
            item = await self._before(deadline, deployment, self._on_cpu(plugin.preprocess, payload))
            self._check_accepting(deployment)
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            ticket = Ticket(request_id, item, level, self.clock(), deadline, future, len(payload.body), measure=measure)
        except BaseException:
            queue.release_slot()
            raise
        queue.put(ticket, reserved=True)
        self._tickets.add(ticket)
        try:
            self._notify(deployment)
            output = await self._await_ticket(deployment, ticket, deadline - started)
        finally:
            self._tickets.discard(ticket)
        result = await self._on_cpu(plugin.postprocess, output, item)
        if ticket.dispatched_at is not None:  # batch end to answer: what admission adds after a batch
            now = self.clock()
            deployment.lag.observe(max(0.0, now - ticket.dispatched_at - ticket.execution_s), now)
        wait = (ticket.dispatched_at or ticket.arrived_at) - ticket.arrived_at
        self.telemetry.observe_queue_wait(deployment.name, wait)
        return Answer(request_id, deployment.name, result, wait, ticket.batch_size, ticket.execution_s,
                      ticket.memory_delta_bytes, plugin.describe_input(payload, item))

    def _check_accepting(self, deployment: Deployment) -> None:
        if self.draining or self._closed:
            raise ShuttingDown("server is shutting down; retry on another replica", retry_after_s=5.0)
        if not deployment.serving:
            reason = f": {deployment.error}" if deployment.error else ""
            raise ModelUnavailable(f"model {deployment.name!r} is {deployment.state.value}{reason}", retry_after_s=5.0)

    async def _await_ticket(self, deployment: Deployment, ticket: Ticket, budget_s: float) -> Any:
        """Wait for the ticket's batch. A ticket still queued at its deadline is withdrawn and gets 504 then."""
        try:
            remaining = max(0.0, ticket.deadline - self.clock())
            try:
                return await asyncio.wait_for(asyncio.shield(ticket.future), remaining)
            except TimeoutError:
                if deployment.queue.withdraw(ticket):
                    error = DeadlineExceeded(
                        f"deadline passed after {budget_s * 1000:.0f} ms in the queue of model {deployment.name!r}; "
                        "the input was not run"
                    )
                    ticket.future.cancel()  # resolved: the error goes to the caller directly
                    raise error from None
                return await ticket.future  # already running: its execution timeout bounds the wait
        except asyncio.CancelledError:
            deployment.queue.withdraw(ticket)  # the caller went away: never run it
            ticket.future.cancel()
            raise

    async def _before(self, deadline: float, deployment: Deployment, work: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(work, max(0.0, deadline - self.clock()))
        except TimeoutError:
            raise DeadlineExceeded(f"deadline passed while preparing the input for model {deployment.name!r}") from None

    async def _on_cpu(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    def _notify(self, deployment: Deployment) -> None:
        for device in {i.device for i in deployment.instances}:
            scheduler = self.schedulers.get(device)
            if scheduler is not None:
                scheduler.notify()


def check_predicted_wait(deployment: Deployment, budget_s: float, now: float, *, take_probe: bool = True) -> bool:
    """Refuse at once (503) a request that the work already queued and running would push past
    its deadline, rather than queueing it to answer 504 later. Returns whether the request is
    admitted to measure the model's real answer time (it is then never dropped at dispatch)."""
    decision = deployment.admission(budget_s, now, take_probe=take_probe)
    if not decision.admit:
        raise QueueFull(
            f"model {deployment.name!r} is overloaded: {decision.reason}; retry later",
            retry_after_s=decision.retry_after_s,
        )
    return decision.measure


def check_media_type(deployment: Deployment, payload: Payload) -> None:
    accepts = deployment.plugin.cls.accepts
    media = payload.media_type.split(";", 1)[0].strip().lower()
    if media == "application/octet-stream" and any(a.startswith("image/") for a in accepts):
        return  # bytes of unknown type: the plugin sniffs the real format
    if not any(fnmatch(media, pattern) for pattern in accepts):
        raise UnsupportedMediaType(
            f"model {deployment.name!r} does not accept {media or 'an empty media type'}; accepted: {', '.join(accepts)}"
        )


def check_priority(deployment: Deployment, priority: int | None) -> int:
    levels = deployment.config.queue.priority_levels
    if priority is None:
        return deployment.config.queue.default_priority
    if not 1 <= priority <= levels:
        raise InputError(f"X-Priority must be an integer from 1 to {levels}, got {priority}")
    return priority


def check_timeout(deployment: Deployment, timeout_ms: float | None) -> float:
    """The request's time budget in seconds: the model's queue timeout, or shorter if asked."""
    limit = deployment.config.queue.timeout_ms
    if timeout_ms is None:
        return limit / 1000.0
    if not timeout_ms > 0:
        raise InputError(f"X-Timeout-Ms must be a positive number of milliseconds, got {timeout_ms}")
    return min(timeout_ms, limit) / 1000.0
