"""The runtime: the serving core's façade, usable without HTTP.

Callers use its verbs and read its snapshots: `screen` and `submit` on the request path,
`models()`, `model()`, `devices()` and `ready` to look, `begin_drain`/`drain`, `start`/`stop`.
Nothing outside `router.serving` touches the deployments, instances or schedulers behind it;
the engine process of a split host (`router.host.engine`) uses the request path's lower verbs
(`intake`, `until_serving`) for items that front processes prepared.

`submit` is the whole life of one request in one process: the rules' commit
(`router.serving.rules`), preprocess (`router.serving.hooks`), queue, wait for its batch (or its
deadline), postprocess. Every accepted request is answered exactly once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from router.config import FleetConfig
from router.errors import DeadlineExceeded, ShuttingDown
from router.logs import new_request_id
from router.scheduling.probes import MemoryProbe, make_probe
from router.scheduling.queue import ModelQueue, Outcome, Refused, Served, Ticket, end_lease
from router.scheduling.scheduler import DeviceScheduler
from router.sdk.agreement import default_agreement
from router.sdk.plugin import Payload, PluginContext
from router.serving.checks import check_answer, check_media_type
from router.serving.deployment import Deployment
from router.serving.editor import FleetEditor, ReloadReport
from router.serving.fleet_state import FleetState
from router.serving.hooks import HookRunner
from router.serving.inflight import InFlight, screening
from router.serving.instance import ModelInstance
from router.serving.intake import SHUTTING_DOWN, Accepted, Intake
from router.serving.isolation import RemotePlugin
from router.serving.loading import load_deployment
from router.serving.phases import trace_execution
from router.serving.plan import FleetPlan, PipelinePlan
from router.serving.residency_executor import ResidencyExecutor, UnloadReport
from router.serving.rollouts import Rollouts
from router.serving.rules import Screened, Terms, budget_s, check_gate, has_room
from router.serving.snapshots import DeviceInfo, ModelInfo, device_info, model_info
from router.serving.telemetry import Telemetry, TelemetryFanout, mirrored
from router.serving.traffic import Observation, TrafficChange
from router.serving.versions import VersionRoute, deployment_name
from router.tracing.api import Phases, Tracing, within_phase

__all__ = ["Answer", "Runtime"]

log = logging.getLogger("router.serving.runtime")
T = TypeVar("T")
ProbeFactory = Callable[[str, str], "MemoryProbe | None"]
#: `screen` leaves the wait prediction to `submit` for bodies announced at most this size.
SCREEN_WAIT_MIN_BYTES = 64 * 1024


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
        self.hooks = HookRunner(cpu_workers or os.cpu_count() or 1, clock=clock)
        self._state = FleetState()
        self.intake = Intake(self._state, clock)
        self._inflight = InFlight()
        self._draining = False
        self._load_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._plugin_extra = dict(plugin_extra or {})
        self._residency = ResidencyExecutor(self._state, self.telemetry, self.clock)
        for name in self.plan.models:
            self._state.put(self._build(name, self.plan, 1))
        self._editor = FleetEditor(plan, self._state, self._residency, self._build, self.clock)
        self.rollouts = Rollouts(self._editor.set_traffic, lambda: (self._editor.plan.routes,
                                                                    self._editor.plan.fleet.routes), self.clock)

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
                self._state.device_failed(device, f"{type(exc).__name__}: {exc}")
                log.error("device %s unavailable: %s", device, exc)
                continue
            self._state.add_device(device, scheduler)
            scheduler.set_actions(self._residency)
            scheduler.start()
        for deployment in self._state:
            self._state.attach(deployment)
        self._load_task = asyncio.create_task(self.load_all(), name="load-models")
        await self.rollouts.start()

    def add_telemetry(self, sink: Telemetry) -> None:
        """Also report events (requests, queue waits, batches) to `sink`."""
        self.telemetry.sinks.append(sink)

    # -- snapshots --------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        return list(self._state.deployments)

    def models(self) -> list[ModelInfo]:
        now = self.clock()
        return [model_info(d, now) for d in self._state]

    def model(self, name: str) -> ModelInfo:
        """One model's snapshot; ModelNotFound (404) for an unknown name."""
        return model_info(self._state.get(name), self.clock())

    def is_serving(self, name: str) -> bool:
        """The model has an instance serving now (False for an unknown name); cheaper than `model()`."""
        deployment = self._state.deployments.get(name)
        return deployment is not None and deployment.serving

    def devices(self) -> list[DeviceInfo]:
        """Every configured device: budget, live reading and ledger, or why it is unavailable."""
        infos = [device_info(s) for s in self._state.schedulers.values()]
        infos += [DeviceInfo(name, available=False, error=error) for name, error in self._state.device_errors.items()]
        return infos

    @property
    def in_flight(self) -> int:
        """Requests inside `submit` now."""
        return self._inflight.count

    @property
    def deployments(self) -> Mapping[str, Deployment]:
        """The serving deployments, read-only: for the engine process that hosts this runtime (what
        its fronts need to know of each model), never for a front."""
        return self._state.deployments

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
        route = self._editor.plan.routes.get(name)  # a model with versions: its stable version's snapshot
        return outcome, self.model(route.deployment(route.stable) if route is not None else name)

    async def delete_model(self, name: str) -> None:
        """Stop taking requests for a model, answer what it accepted, unload it."""
        await self._editor.delete(name)

    async def reload(self, path: Path | None = None) -> ReloadReport:
        """Re-read the fleet file (the one served, unless `path`) and apply the difference."""
        self._check_open()
        report = await self._editor.reload(path or Path(self._editor.plan.source))
        await self.rollouts.start()
        return report

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

    # -- versions -------------------------------------------------------------------------------

    def routes(self) -> Mapping[str, VersionRoute]:
        """The routed names (models with versions) and their routes now."""
        return self._editor.plan.routes

    async def put_version(self, name: str, version: str, section: Mapping[str, Any],
                          source: str = "PUT /models") -> tuple[str, ModelInfo]:
        """Add or change one version of a routed name: (added | changed | unchanged, its snapshot)."""
        self._check_open()
        outcome = await self._editor.put_version(name, version, section, f"{source}/{name}/versions/{version}")
        return outcome, self.model(deployment_name(name, version))

    async def delete_version(self, name: str, version: str) -> None:
        """Remove a version that takes no traffic (answering what it accepted)."""
        await self._editor.delete_version(name, version)

    async def set_traffic(self, name: str, change: TrafficChange) -> VersionRoute:
        """Change a routed name's split, stable version or mirror, whole: the new route."""
        return await self.rollouts.set_traffic(name, change)

    def rollout(self, name: str) -> dict[str, Any] | None:
        """The rollout of a routed name, running or ended; None if it has had none."""
        return self.rollouts.describe(name)

    def agreement(self, model: str, answer: Any, other: Any) -> float | None:
        """How two answers of `model`'s plugin agree (its `agreement` hook)."""
        plugin = self._state.get(model).front_instance().plugin
        hook = getattr(plugin, "agreement", None)
        return hook(answer, other) if hook is not None else default_agreement(answer, other)

    def report_versions(self, observation: Observation) -> None:
        """A front's observation of a version's answer, for the route's rollout."""
        self.rollouts.observe(observation)

    # -- lifecycle ------------------------------------------------------------------------------

    async def load_all(self) -> None:
        """Load every always-resident model (on-demand ones load with their first request)."""
        await asyncio.gather(*(self._load(d) for d in self._state if not d.on_demand))
        # Everything loaded so far (frameworks, weights) lives as long as the process: keep the
        # cyclic collector from scanning it, or each full collection stalls the event loop.
        gc.freeze()

    async def wait_loaded(self) -> None:
        if self._load_task is not None:
            await asyncio.shield(self._load_task)

    async def _load(self, deployment: Deployment) -> None:
        await load_deployment(deployment, self._state.schedulers, self._state.device_errors)
        self._state.notify(deployment)

    @property
    def ready(self) -> bool:
        """Every required model loaded, warmed and serving, no load in progress, not shutting down."""
        if self._draining:
            return False
        deployments = list(self._state)
        return all(d.serving for d in deployments if d.config.is_required) and all(d.settled for d in deployments)

    @property
    def draining(self) -> bool:
        return self._draining

    def begin_drain(self) -> None:
        """From now on refuse new requests (503) and report not ready; queued work goes on."""
        if not self._draining:
            log.info("draining: new requests are refused; %d request(s) in flight", self._inflight.count)
        self._draining = True
        self.intake.closing = True

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work, let queued and running work finish, then answer whatever is left with 503."""
        self.begin_drain()
        log.info("drain: waiting up to %.1fs for %d request(s)", timeout_s, self._inflight.count)
        try:
            await self._inflight.until_idle(timeout_s)
        except TimeoutError:
            log.warning("drain timeout: answering %d remaining request(s) with 503", len(self.intake.tickets))
        self.intake.answer_all(ShuttingDown("server is shutting down"))
        try:
            await self._inflight.until_idle(5.0)
        except TimeoutError:
            log.error("%d request(s) still in flight after drain", self._inflight.count)

    async def stop(self) -> None:
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        await self.rollouts.stop()
        await self._residency.stop()
        for scheduler in self._state.schedulers.values():
            await scheduler.stop()
        for deployment in self._state:
            for instance in deployment.instances:
                if instance.loaded:
                    try:
                        await asyncio.wait_for(instance.call(instance.plugin.unload), 5.0)
                    except Exception:
                        log.exception("unloading %s failed", instance.key)
                instance.shutdown()
        self.hooks.shutdown()

    # -- the request path -------------------------------------------------------------------

    def screen(
        self, model: str, *, priority: int | None = None, timeout_ms: float | None = None,
        received_at: float | None = None, items: int = 1, body_bytes: int | None = None,
    ) -> Screened:
        """The rules' screen: refuse, from the model name and the request's headers alone, what
        `submit` would refuse before running anything (unknown model, bad header, shutting down,
        model not serving, queue full, predicted to miss its deadline), so that the caller need not
        read the body. With `items`, the queue must have room for all of them (else 413 if it never
        can). A body announced as at most SCREEN_WAIT_MIN_BYTES costs less to read than the wait
        prediction, which is left to the commit. Takes nothing: `submit` commits each item."""
        deployment = self._state.get(model)
        now = self.clock()
        started = now if received_at is None else min(received_at, now)
        gate = body_bytes is None or body_bytes > SCREEN_WAIT_MIN_BYTES
        with screening(lambda outcome: self._count(deployment.name, outcome, started)):
            return self.intake.screen(deployment, Terms(model, started, priority, timeout_ms, items), gate=gate)

    def _count(self, model: str, outcome: str, started: float) -> None:
        deployment = self._state.deployments.get(model)
        if deployment is not None:
            deployment.outcomes[outcome] += 1
        self.telemetry.observe_request(model, outcome, self.clock() - started)

    async def submit(self, model: str, payload: Payload, *, priority: int | None = None, timeout_ms: float | None = None,
                     request_id: str | None = None, received_at: float | None = None, trace: Phases | None = None,
                     wait_for_room: bool = False, must_finish: bool = False, screened: Screened | None = None,
                     shadow: bool = False) -> Answer:
        """Run one input through a model. Raises a RouterError subclass on any failure.
        `screened`: the request's screen (`screen`); here the commit decides on the live figures
        of its moment all the same, so nothing of it is read again.
        The deadline counts from `received_at` (the runtime's clock) when the caller knows it.
        With `trace` (a sampled request's), each phase of the path is recorded there as it ends.
        A pipeline's later steps ask for two things more: `wait_for_room`, a full queue is
        waited on until the deadline (then 504, not run) instead of refused with 503; and
        `must_finish`, an input predicted to be answered after its deadline is refused with 504
        without running, even by an idle model (`router.serving.rules.check_gate`). `shadow`: a
        mirrored copy (`router.routing.mirror`), admitted only into spare device capacity."""
        deployment = self._state.get(model)
        request_id = request_id or new_request_id()
        started = self.clock() if received_at is None else min(received_at, self.clock())
        terms = Terms(deployment.name, started, priority, timeout_ms, must_finish=must_finish, shadow=shadow)
        if shadow:  # a mirrored copy: counted apart, never as a user's request
            return await self._shadow(deployment, terms, payload, request_id)
        with self._inflight.request(lambda outcome: self._count(deployment.name, outcome, started)):
            work = self._admitted(deployment, terms, payload, request_id, trace, wait_for_room)
            answer, deadline = await (work if trace is None else within_phase(trace, "admission", self.clock, work))
            self.telemetry.observe_answer(deployment.name, self.clock() - started, deadline - started)
            return answer

    async def _shadow(self, deployment: Deployment, terms: Terms, payload: Payload, request_id: str) -> Answer:
        with mirrored(self.telemetry, deployment.name), self._inflight.request(lambda outcome: None):
            answer, _ = await self._admitted(deployment, terms, payload, request_id, None)
            return answer

    async def _admitted(self, deployment: Deployment, terms: Terms, payload: Payload, request_id: str,
                        trace: Phases | None, wait_for_room: bool = False) -> tuple[Answer, float]:
        if wait_for_room:
            await self.until_room(deployment, terms)
        admission = self.intake.decide(deployment, terms)
        check_media_type(deployment.name, deployment.plugin.cls.accepts, payload)
        accepted = self.intake.commit(deployment, admission)
        try:
            return await self._held(accepted, payload, request_id, trace), admission.deadline
        finally:
            self.intake.release(accepted)

    async def until_serving(self, accepted: Accepted) -> None:
        """An admitted request for a model that is not loaded waits for its load (counted in its queue)."""
        deployment = accepted.deployment
        if not deployment.serving:
            waited = await self._residency.until_serving(deployment, accepted.admission.deadline)
            self.telemetry.observe_cold_wait(deployment.name, waited)

    async def _held(self, accepted: Accepted, payload: Payload, request_id: str, trace: Phases | None) -> Answer:
        deployment, deadline = accepted.deployment, accepted.admission.deadline
        try:
            if trace is not None and not deployment.serving:
                trace.enter("wait for load", self.clock())
            await self.until_serving(accepted)
            if trace is not None:
                trace.enter("preprocess", self.clock())
            front = deployment.front_instance()
            front.begin_use()  # an unload waits until its plugin is done preparing this input
            try:
                item = await self.hooks.run(deployment.name, deployment.plugin.name, front.plugin, "preprocess",
                                            payload, deadline=deadline)
            finally:
                front.end_use()
            reply: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
            ticket = self.intake.enqueue(accepted, item, reply.set_result, request_id, len(payload.body),
                                         trace=trace.ref if trace is not None else None)
        except BaseException:
            self.intake.unreserve(accepted)
            raise
        if trace is not None:
            trace.enter("queue wait", ticket.arrived_at)
        try:
            served = await self._served(accepted, ticket, reply, trace)
        finally:
            self.intake.tickets.discard(ticket)
        batch, lease = served.batch, served.lease
        try:
            # The instance that ran the batch postprocesses its answer, and stays loaded until it has.
            plugin = lease.instance.plugin if lease is not None else front.plugin
            result = await self.hooks.run(deployment.name, deployment.plugin.name, plugin, "postprocess",
                                          served.output, item, deadline=deadline)
            check_answer(deployment.name, deployment.plugin.name, result)
            described = await self.hooks.described(plugin, payload, item)
        finally:
            if lease is not None:
                lease.end()
        now = self.clock()  # batch end to answer: what the deadline gate adds after a batch
        deployment.lag.observe(max(0.0, now - batch.dispatched_at - batch.execution_s), now)
        wait = batch.dispatched_at - ticket.arrived_at
        self.telemetry.observe_queue_wait(deployment.name, wait)
        return Answer(request_id, deployment.name, result, wait, batch.size, batch.execution_s,
                      batch.memory_delta_bytes, described)

    async def _served(self, accepted: Accepted, ticket: Ticket, reply: asyncio.Future[Outcome],
                      trace: Phases | None) -> Served:
        """The ticket's outcome when it is served; the error that answers it otherwise."""
        try:
            outcome = await self._await_ticket(accepted, ticket, reply)
        except BaseException as exc:
            if trace is not None:
                trace_execution(trace, None, self.clock(), exc)
            raise
        if isinstance(outcome, Refused):
            if trace is not None:
                trace_execution(trace, outcome.batch, self.clock(), outcome.error)
            raise outcome.error
        if trace is not None:
            trace_execution(trace, outcome.batch, self.clock())
        return outcome

    async def until_room(self, deployment: Deployment, terms: Terms) -> None:
        """Wait until the model's queue has room for the request; 504 (never run) if its deadline
        comes first, or, for one that must finish, as soon as the work ahead makes it miss."""
        while True:
            room = deployment.room.next()  # taken before looking: no freed room falls in between
            now = self.clock()
            figures = self.intake.figures(deployment, now, gate=terms.must_finish)
            if figures.refusal is not None:
                raise figures.refusal.error()
            if has_room(figures, terms.items):
                return
            if terms.must_finish:
                check_gate(terms, figures, now)
            deadline = terms.received_at + budget_s(figures, terms.timeout_ms)
            try:
                await asyncio.wait_for(room.wait(), max(0.0, deadline - self.clock()))
            except TimeoutError:
                raise DeadlineExceeded(f"deadline passed waiting for room in the queue of model "
                                       f"{deployment.name!r}; the input was not run") from None

    def _check_open(self) -> None:
        if self.intake.closing:
            raise ShuttingDown(SHUTTING_DOWN.detail, retry_after_s=SHUTTING_DOWN.retry_after_s)

    async def _await_ticket(self, accepted: Accepted, ticket: Ticket, reply: asyncio.Future[Outcome]) -> Outcome:
        """Wait for the ticket's outcome, up to its deadline: then a ticket still queued is withdrawn
        (it never runs), and one whose batch is running gets 504 all the same; no answer comes late."""
        try:
            remaining = max(0.0, ticket.deadline - self.clock())
            try:
                return await asyncio.wait_for(asyncio.shield(reply), remaining)
            except TimeoutError:
                _abandon(ticket, reply)
                if self.intake.withdraw(accepted, ticket):
                    raise expired(accepted) from None
                # Running: the deadline still holds. The batch goes on; this input's answer is dropped.
                raise DeadlineExceeded(f"deadline passed after {_budget_ms(accepted)} ms while the batch of model "
                                       f"{accepted.admission.model!r} holding this input ran") from None
        except asyncio.CancelledError:
            _abandon(ticket, reply)
            self.intake.withdraw(accepted, ticket)  # the caller went away: never run it
            raise


def _abandon(ticket: Ticket, reply: asyncio.Future[Outcome]) -> None:
    """Nobody will read this ticket's outcome: one that came already, or that comes later, ends its lease."""
    ticket.abandon()
    if reply.done():
        end_lease(reply.result())


def _budget_ms(accepted: Accepted) -> str:
    admission = accepted.admission
    return f"{(admission.deadline - admission.arrived_at) * 1000:.0f}"


def expired(accepted: Accepted) -> DeadlineExceeded:
    """The 504 of a request still queued at its deadline."""
    return DeadlineExceeded(f"deadline passed after {_budget_ms(accepted)} ms in the queue of model "
                            f"{accepted.admission.model!r}; the input was not run")
