"""The runtime: the serving core's façade, usable without HTTP.

Callers use its verbs and read its snapshots: `submit` and `precheck` on the request path,
`models()`, `model()`, `devices()` and `ready` to look, `begin_drain`/`drain`, `start`/`stop`.
Nothing outside `router.serving` touches the deployments, instances or schedulers behind it.

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
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from router.config import FleetConfig
from router.errors import (
    DeadlineExceeded,
    InstanceLost,
    ModelUnavailable,
    QueueFull,
    RouterError,
    ShuttingDown,
    outcome_of,
)
from router.scheduling.probes import MemoryProbe, make_probe
from router.scheduling.queue import ModelQueue, Ticket, reject
from router.scheduling.scheduler import DeviceScheduler
from router.sdk.plugin import Payload, PluginContext
from router.serving.checks import check_answer, check_deadline_gate, check_media_type, check_priority, check_timeout
from router.serving.deployment import Deployment, find_deployment
from router.serving.editor import FleetEditor, ReloadReport
from router.serving.hooks import HookRunner
from router.serving.inflight import InFlight
from router.serving.instance import ModelInstance
from router.serving.isolation import RemotePlugin
from router.serving.loading import load_deployment
from router.serving.phases import trace_execution
from router.serving.plan import FleetPlan, PipelinePlan
from router.serving.residency_executor import ResidencyExecutor, UnloadReport
from router.serving.snapshots import DeviceInfo, ModelInfo, device_info, model_info
from router.serving.telemetry import Telemetry, TelemetryFanout
from router.tracing.api import Phases, Tracing, within_phase

__all__ = ["Answer", "Runtime"]

log = logging.getLogger("router.serving.runtime")
T = TypeVar("T")
ProbeFactory = Callable[[str, str], "MemoryProbe | None"]
#: `precheck` leaves the wait prediction to `submit` for bodies announced at most this size.
PRECHECK_WAIT_MIN_BYTES = 64 * 1024


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
        tracing: Tracing | None = None,
    ) -> None:
        self.plan = plan
        self.tracing = tracing  # batch spans, made by the device schedulers
        self.fleet: FleetConfig = plan.fleet
        self.clock = clock
        self.telemetry = TelemetryFanout()
        if telemetry is not None:
            self.telemetry.sinks.append(telemetry)
        self._probe_factory = probe_factory
        self._hooks = HookRunner(cpu_workers or os.cpu_count() or 1)
        self._schedulers: dict[str, DeviceScheduler] = {}
        self._device_errors: dict[str, str] = {}
        self._deployments: dict[str, Deployment] = {}
        self._tickets: set[Ticket] = set()
        self._inflight = InFlight()
        self._draining = False
        self._closed = False
        self._load_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._plugin_extra = dict(plugin_extra or {})
        self._residency = ResidencyExecutor(self._deployments, self._schedulers, self.telemetry, self.clock)
        for name in self.plan.models:
            self._deployments[name] = self._build(name, self.plan, 1)
        self._editor = FleetEditor(plan, self._deployments, self._schedulers, self._residency, self._build, self.clock)

    # -- construction and lifecycle ---------------------------------------------------------

    def _build(self, name: str, plan: FleetPlan, generation: int) -> Deployment:
        """A model's deployment from a plan: its queue and one instance per device entry."""
        model_plan, fleet = plan.models[name], plan.fleet
        config = fleet.models[name]
        queue = ModelQueue(name, max_size=config.queue.max_size, priority_levels=config.queue.priority_levels)
        deployment = Deployment(name, config, model_plan.plugin, model_plan.options, queue, generation=generation)
        context = PluginContext(name, fleet.model_store, fleet.allow_absolute_paths, dict(self._plugin_extra))
        timeout_s = config.execution.timeout_ms / 1000.0
        for index, device in enumerate(config.instance_devices):
            cls = model_plan.plugin.cls
            plugin = (RemotePlugin(cls, model_plan.options, context, call_timeout_s=timeout_s)
                      if config.isolation == "process" else cls(model_plan.options, context))
            instance = ModelInstance(
                name, index, device, plugin,
                execution_timeout_s=timeout_s,
                on_batch=self.telemetry.observe_batch,
                clock=self.clock,
                generation=generation,
            )
            if isinstance(plugin, RemotePlugin):
                plugin.on_exit = partial(self._instance_exited, instance.key)
            deployment.instances.append(instance)
        return deployment

    def _instance_exited(self, key: str, why: str) -> None:
        """An instance's process died (told from its reader thread): the fleet fails and restarts it."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._residency.instance_lost, key, why)
        except RuntimeError:  # the loop is closed: the server is stopping
            pass

    async def start(self) -> None:
        """Start the device schedulers and begin loading models in the background."""
        self._loop = asyncio.get_running_loop()
        for device, config in self.fleet.devices.items():
            try:
                probe = self._probe_factory(device, config.probe)
                scheduler = DeviceScheduler(device, config, probe, clock=self.clock, tracing=self.tracing)
                scheduler.resolve_budget()
            except Exception as exc:  # noqa: BLE001  # a device that cannot be budgeted fails its own models only
                self._device_errors[device] = f"{type(exc).__name__}: {exc}"
                log.error("device %s unavailable: %s", device, exc)
                continue
            self._schedulers[device] = scheduler
            scheduler.set_actions(self._residency)
            scheduler.start()
        for deployment in self._deployments.values():
            for instance in deployment.instances:
                if instance.device in self._schedulers:
                    self._schedulers[instance.device].attach(deployment, instance)
        self._load_task = asyncio.create_task(self.load_all(), name="load-models")

    def add_telemetry(self, sink: Telemetry) -> None:
        """Also report events (requests, queue waits, batches) to `sink`."""
        self.telemetry.sinks.append(sink)

    # -- snapshots --------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        return list(self._deployments)

    def models(self) -> list[ModelInfo]:
        now = self.clock()
        return [model_info(d, now) for d in self._deployments.values()]

    def model(self, name: str) -> ModelInfo:
        """One model's snapshot; ModelNotFound (404) for an unknown name."""
        return model_info(self._deployment(name), self.clock())

    def is_serving(self, name: str) -> bool:
        """The model has an instance serving now (False for an unknown name); cheaper than `model()`."""
        deployment = self._deployments.get(name)
        return deployment is not None and deployment.serving

    def devices(self) -> list[DeviceInfo]:
        """Every configured device: budget, live reading and ledger, or why it is unavailable."""
        infos = [device_info(s) for s in self._schedulers.values()]
        infos += [DeviceInfo(name, available=False, error=error) for name, error in self._device_errors.items()]
        return infos

    @property
    def in_flight(self) -> int:
        """Requests inside `submit` now."""
        return self._inflight.count

    # -- operators' changes ---------------------------------------------------------------------

    async def load_model(self, name: str) -> ModelInfo:
        """Load a model now and keep it resident until an operator unloads it."""
        await self._editor.load(name)
        return self.model(name)

    async def unload_model(self, name: str) -> tuple[ModelInfo, list[UnloadReport]]:
        """Unload a model now (queued requests get 503) and keep it out until an operator loads it."""
        reports = await self._editor.unload(name)
        return self.model(name), reports

    async def release_model(self, name: str, *, unload: bool = False) -> tuple[ModelInfo, list[UnloadReport]]:
        """Undo `load_model`'s hold: on demand again; with `unload`, unloaded now if nothing uses it."""
        reports = await self._editor.release(name, unload)
        return self.model(name), reports

    async def put_model(self, name: str, section: Mapping[str, Any], source: str = "PUT /models") -> tuple[str, ModelInfo]:
        """Add or change a model from its fleet-file section: (added | changed | unchanged, its snapshot)."""
        self._check_open()
        outcome = await self._editor.put(name, section, f"{source}/{name}")
        return outcome, self.model(name)

    async def delete_model(self, name: str) -> None:
        """Stop taking requests for a model, answer what it accepted, unload it."""
        await self._editor.delete(name)

    async def reload(self, path: Path | None = None) -> ReloadReport:
        """Re-read the fleet file (the one served, unless `path`) and apply the difference."""
        self._check_open()
        return await self._editor.reload(path or Path(self._editor.plan.source))

    def pipelines(self) -> list[PipelinePlan]:
        """The pipelines served now (their runner, a front, reads them here: they change at run time)."""
        return list(self._editor.plan.pipelines.values())

    def pipeline(self, name: str) -> PipelinePlan | None:
        return self._editor.plan.pipelines.get(name)

    async def put_pipeline(self, name: str, section: Mapping[str, Any],
                           source: str = "PUT /pipelines") -> tuple[str, PipelinePlan]:
        """Add or change a pipeline from its fleet-file section: (added | changed | unchanged, its plan)."""
        self._check_open()
        return await self._editor.put_pipeline(name, section, f"{source}/{name}")

    async def delete_pipeline(self, name: str) -> None:
        """Stop serving a pipeline (requests inside it finish)."""
        await self._editor.delete_pipeline(name)

    # -- lifecycle ------------------------------------------------------------------------------

    async def load_all(self) -> None:
        """Load every always-resident model (on-demand ones load with their first request)."""
        await asyncio.gather(*(self._load(d) for d in self._deployments.values() if not d.on_demand))
        # Everything loaded so far (frameworks, weights) lives as long as the process: keep the
        # cyclic collector from scanning it, or each full collection stalls the event loop.
        gc.freeze()

    async def wait_loaded(self) -> None:
        if self._load_task is not None:
            await asyncio.shield(self._load_task)

    async def _load(self, deployment: Deployment) -> None:
        await load_deployment(deployment, self._schedulers, self._device_errors)
        for instance in deployment.instances:
            if instance.device in self._schedulers:
                self._schedulers[instance.device].notify()

    @property
    def ready(self) -> bool:
        """Every required model loaded, warmed and serving, no load in progress, not shutting down."""
        if self._draining:
            return False
        required = [d for d in self._deployments.values() if d.config.is_required]
        return all(d.serving for d in required) and all(d.settled for d in self._deployments.values())

    @property
    def draining(self) -> bool:
        return self._draining

    def begin_drain(self) -> None:
        """From now on refuse new requests (503) and report not ready; queued work goes on."""
        if not self._draining:
            log.info("draining: new requests are refused; %d request(s) in flight", self._inflight.count)
        self._draining = True

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work, let queued and running work finish, then answer whatever is left with 503."""
        self.begin_drain()
        log.info("drain: waiting up to %.1fs for %d request(s)", timeout_s, self._inflight.count)
        try:
            await self._inflight.until_idle(timeout_s)
        except TimeoutError:
            log.warning("drain timeout: answering %d remaining request(s) with 503", len(self._tickets))
        self._closed = True
        for ticket in list(self._tickets):
            for deployment in self._deployments.values():
                deployment.queue.withdraw(ticket)
            reject(ticket, ShuttingDown("server is shutting down"))
        try:
            await self._inflight.until_idle(5.0)
        except TimeoutError:
            log.error("%d request(s) still in flight after drain", self._inflight.count)

    async def stop(self) -> None:
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        await self._residency.stop()
        for scheduler in self._schedulers.values():
            await scheduler.stop()
        for deployment in self._deployments.values():
            for instance in deployment.instances:
                if instance.loaded:
                    try:
                        await asyncio.wait_for(instance.call(instance.plugin.unload), 5.0)
                    except Exception:
                        log.exception("unloading %s failed", instance.key)
                instance.shutdown()
        self._hooks.shutdown()

    # -- the request path -------------------------------------------------------------------

    def _deployment(self, name: str) -> Deployment:
        return find_deployment(self._deployments, name)

    def precheck(
        self, model: str, *, priority: int | None = None, timeout_ms: float | None = None,
        received_at: float | None = None, items: int = 1, body_bytes: int | None = None,
    ) -> None:
        """Refuse, from the model name and the request's headers alone, what `submit` would refuse
        before running anything (unknown model, bad header, shutting down, model not serving,
        queue full, predicted to miss its deadline), so that the caller need not read the body.
        With `items`, the queue must have room for all of them (a request that the queue can never
        hold is 413). A body announced as at most PRECHECK_WAIT_MIN_BYTES costs less to read than
        the wait prediction, which `submit` makes anyway: for it that one is left to `submit`.
        Takes nothing: `submit` decides again, item by item."""
        deployment = self._deployment(model)
        now = self.clock()
        started = now if received_at is None else min(received_at, now)
        try:
            self._check_accepting(deployment)
            check_priority(deployment, priority)
            budget_s = check_timeout(deployment, timeout_ms) - (now - started)
            deployment.queue.check_room(now, items)
            if body_bytes is None or body_bytes > PRECHECK_WAIT_MIN_BYTES:
                check_deadline_gate(deployment, budget_s, now, take_turn=False, device_free_at=self._free_at(now))
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
        trace: Phases | None = None,
        wait_for_room: bool = False,
        must_finish: bool = False,
    ) -> Answer:
        """Run one input through a model. Raises a RouterError subclass on any failure.
        The deadline counts from `received_at` (the runtime's clock) when the caller knows it.
        With `trace` (a sampled request's), each phase of the path is recorded there as it ends.
        A pipeline's later steps ask for two things more: `wait_for_room`, a full queue is
        waited on until the deadline (then 504, not run) instead of refused with 503; and
        `must_finish`, an input predicted to be answered after its deadline is refused with 504
        without running, even by an idle model (see `check_deadline_gate`)."""
        deployment = self._deployment(model)
        request_id = request_id or uuid.uuid4().hex
        started = self.clock() if received_at is None else min(received_at, self.clock())
        with self._inflight.request(lambda outcome: self._count(deployment, outcome, started)):
            work = self._submit(deployment, payload, priority, timeout_ms, request_id, started, trace,
                                wait_for_room, must_finish)
            answer = await (work if trace is None else within_phase(trace, "admission", self.clock, work))
            self.telemetry.observe_answer(deployment.name, self.clock() - started, check_timeout(deployment, timeout_ms))
            return answer

    async def _submit(
        self, deployment: Deployment, payload: Payload, priority: int | None,
        timeout_ms: float | None, request_id: str, started: float, trace: Phases | None,
        wait_for_room: bool, must_finish: bool,
    ) -> Answer:
        self._check_accepting(deployment)
        check_media_type(deployment, payload)
        level = check_priority(deployment, priority)
        deadline = started + check_timeout(deployment, timeout_ms)
        queue = deployment.queue
        if wait_for_room:
            await self._room(deployment, deadline, must_finish)
        now = self.clock()
        measure = check_deadline_gate(deployment, deadline - now, now, device_free_at=self._free_at(now),
                                      must_finish=must_finish)
        queue.reserve_slot(started)
        deployment.residency.hold(now)  # in use: not evicted until answered
        try:
            return await self._held(deployment, payload, level, deadline, measure, request_id, started, trace)
        finally:
            deployment.residency.release(self.clock())
            if deployment.residency.holders == 0:
                self._notify(deployment)  # no longer in use: residency may act on it

    async def _held(
        self, deployment: Deployment, payload: Payload, level: int, deadline: float, measure: bool,
        request_id: str, started: float, trace: Phases | None,
    ) -> Answer:
        queue = deployment.queue
        try:
            if not deployment.serving:  # an on-demand model: wait for its load (counted in its queue)
                if trace is not None:
                    trace.enter("wait for load", self.clock())
                waited = await self._residency.until_serving(deployment, deadline)
                self.telemetry.observe_cold_wait(deployment.name, waited)
            if trace is not None:
                trace.enter("preprocess", self.clock())
            front = deployment.front_instance()
            front.begin_use()  # an unload waits until its plugin is done preparing this input
            try:
                item = await self._before(deadline, deployment, "preparing the input",
                                          self._hooks.run(deployment.name, deployment.plugin.name, front.plugin,
                                                          "preprocess", payload))
            finally:
                front.end_use()
            self._check_open()
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            ticket = Ticket(request_id, item, level, self.clock(), deadline, future, len(payload.body), measure=measure,
                            trace=trace.ref if trace is not None else None)
        except BaseException:
            queue.release_slot()
            raise
        queue.put(ticket, reserved=True)
        if trace is not None:
            trace.enter("queue wait", ticket.arrived_at)
        self._tickets.add(ticket)
        try:
            self._notify(deployment)
            try:
                output = await self._await_ticket(deployment, ticket, deadline - started)
            except BaseException as exc:
                if trace is not None:
                    trace_execution(trace, ticket, self.clock(), exc)
                raise
            if trace is not None:
                trace_execution(trace, ticket, self.clock())
            # The instance that ran the batch postprocesses its answer, and stays loaded until it has.
            plugin = ticket.answered_by.plugin if ticket.answered_by is not None else front.plugin
            result = await self._before(deadline, deployment, "preparing the answer",
                                        self._hooks.run(deployment.name, deployment.plugin.name, plugin,
                                                        "postprocess", output, item))
            check_answer(deployment, result)
            described = await self._hooks.described(plugin, payload, item)
        finally:
            self._tickets.discard(ticket)
            if ticket.answered_by is not None:
                ticket.answered_by.end_use()
        if ticket.dispatched_at is not None:  # batch end to answer: what the deadline gate adds after a batch
            now = self.clock()
            deployment.lag.observe(max(0.0, now - ticket.dispatched_at - ticket.execution_s), now)
        wait = (ticket.dispatched_at or ticket.arrived_at) - ticket.arrived_at
        self.telemetry.observe_queue_wait(deployment.name, wait)
        return Answer(request_id, deployment.name, result, wait, ticket.batch_size, ticket.execution_s,
                      ticket.memory_delta_bytes, described)

    async def _room(self, deployment: Deployment, deadline: float, must_finish: bool) -> None:
        """Wait until the queue has room for one more input; 504 (never run) if the deadline comes
        first, or, with `must_finish`, as soon as the work ahead already makes it miss."""
        while True:
            room = deployment.room.next()
            now = self.clock()
            try:
                deployment.queue.check_room(now)
                return
            except QueueFull:
                if must_finish:
                    check_deadline_gate(deployment, deadline - now, now, take_turn=False,
                                        device_free_at=self._free_at(now), must_finish=True)
                try:
                    await asyncio.wait_for(room.wait(), max(0.0, deadline - self.clock()))
                except TimeoutError:
                    raise DeadlineExceeded(f"deadline passed waiting for room in the queue of model "
                                           f"{deployment.name!r}; the input was not run") from None
            self._check_accepting(deployment)

    def _free_at(self, now: float) -> dict[str, float]:
        """When each device can next start a batch (now, unless all its batch slots are taken)."""
        return {device: scheduler.free_at(now) for device, scheduler in self._schedulers.items()}

    def _check_open(self) -> None:
        if self._draining or self._closed:
            raise ShuttingDown("server is shutting down; retry on another replica", retry_after_s=5.0)

    def _check_accepting(self, deployment: Deployment) -> None:
        """Shutting down, or a model that cannot serve soon: 503 at once. An on-demand model that
        is not loaded is accepted (the request waits for its load)."""
        self._check_open()
        if deployment.serving:
            return
        if deployment.waits_for_load:
            self._residency.check_loadable(deployment)
            return
        if deployment.residency.held_down:
            self._residency.check_loadable(deployment)
        if deployment.residency.lost is not None:
            raise InstanceLost(f"model {deployment.name!r} is restarting: {deployment.residency.lost}",
                               retry_after_s=self._residency.load_left_s(deployment))
        reason = f": {deployment.error}" if deployment.error else ""
        raise ModelUnavailable(f"model {deployment.name!r} is {deployment.state.value}{reason}", retry_after_s=5.0)

    async def _await_ticket(self, deployment: Deployment, ticket: Ticket, budget_s: float) -> Any:
        """Wait for the ticket's batch, up to its deadline: then a ticket still queued is withdrawn (it
        never runs), and one whose batch is running gets 504 all the same; no answer comes late."""
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
                # Running: the deadline still holds. The batch goes on; this input's answer is dropped.
                ticket.future.cancel()
                raise DeadlineExceeded(
                    f"deadline passed after {budget_s * 1000:.0f} ms while the batch of model {deployment.name!r} "
                    "holding this input ran"
                ) from None
        except asyncio.CancelledError:
            deployment.queue.withdraw(ticket)  # the caller went away: never run it
            ticket.future.cancel()
            raise

    async def _before(self, deadline: float, deployment: Deployment, doing: str, work: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(work, max(0.0, deadline - self.clock()))
        except TimeoutError:
            raise DeadlineExceeded(f"deadline passed while {doing} for model {deployment.name!r}") from None

    def _notify(self, deployment: Deployment) -> None:
        for device in {i.device for i in deployment.instances}:
            scheduler = self._schedulers.get(device)
            if scheduler is not None:
                scheduler.notify()
