"""`Runtime`: the serving core of one process, its devices and their schedulers.

It is the in-process implementation of `router.serving.facade.Core`: `Serving` above it handles
every request the same way whatever the layout, and the engine process of a split host
(`router.host.engine`) hosts one for its fronts, using the request path's lower verbs (`intake`,
`until_serving`) for items that front processes prepared. Nothing outside `router.serving`
touches the deployments, instances or schedulers behind it.

`run` is the commit and the answer of one request in one process: the rules' commit
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
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from router.config import FleetConfig
from router.errors import DeadlineExceeded, ShuttingDown
from router.scheduling.memory import MemoryProbe, make_probe
from router.scheduling.queue import ModelQueue, Outcome, Refused, Served, Ticket, end_lease
from router.scheduling.scheduler import DeviceScheduler
from router.sdk.agreement import default_agreement
from router.sdk.plugin import Payload, PluginContext
from router.serving.deployment import Deployment
from router.serving.editor import FleetEditor, ReloadReport
from router.serving.facade import Answer, ModelInputs, Serving
from router.serving.fleet_state import FleetState, Serve, Stage
from router.serving.hooks import HookRunner, check_answer, check_media_type
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
from router.serving.telemetry import Telemetry, TelemetryFanout
from router.serving.traffic import Observation, TrafficChange
from router.serving.verbs import Verb
from router.serving.versions import VersionRoute, deployment_name
from router.tracing.api import Phases, Tracing

__all__ = ["Runtime", "in_process"]

log = logging.getLogger("router.serving.runtime")
R = TypeVar("R")
ProbeFactory = Callable[[str, str], "MemoryProbe | None"]


class Runtime:
    phase: ClassVar[str] = "admission"

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
        self.tracing = tracing  # batch spans, made by the device schedulers
        self.clock = clock
        self.telemetry = TelemetryFanout()
        if telemetry is not None:
            self.telemetry.add(telemetry)
        self._probe_factory = probe_factory
        self.hooks = HookRunner(cpu_workers or os.cpu_count() or 1, clock=clock)
        self._state = FleetState(plan)
        self.intake = Intake(self._state, clock)
        self._draining = False
        self._load_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._plugin_extra = dict(plugin_extra or {})
        self._residency = ResidencyExecutor(self._state, self.telemetry, self.clock)
        for name in plan.models:
            self._state.apply(Serve(self._build(name, plan, 1)))
        self._editor = FleetEditor(self._state, self._residency, self._build, self.clock)
        self.rollouts = Rollouts(self._editor.set_traffic, lambda: (self._state.plan.routes,
                                                                    self._state.plan.fleet.routes), self.clock)

    @property
    def plan(self) -> FleetPlan:
        """The fleet plan served now, which every change replaces whole."""
        return self._state.plan

    @property
    def fleet(self) -> FleetConfig:
        return self._state.plan.fleet

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
                on_batch=self._observe_batch,
                clock=self.clock,
                generation=generation,
            )
            if isinstance(plugin, RemotePlugin):
                plugin.on_exit = partial(self._instance_exited, instance.key)
            deployment.instances.append(instance)
        return deployment

    def _observe_batch(self, model: str, size: int, seconds: float) -> None:
        self.telemetry.observe_batch(model, size, seconds)  # the sinks as they are when the batch ends

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
            self._state.apply(Stage(deployment))
        self._load_task = asyncio.create_task(self.load_all(), name="load-models")
        await self.rollouts.start()

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
    def generation(self) -> int:
        """The fleet's generation: every change to the plan or to what serves advances it."""
        return self._state.generation

    @property
    def deployments(self) -> Mapping[str, Deployment]:
        """The serving deployments, read-only: for the engine process that hosts this runtime (what
        its fronts need to know of each model), never for a front."""
        return self._state.deployments

    # -- operators' changes: `call` runs each typed verb (`router.serving.verbs`) on these -----------

    async def call(self, verb: Verb[R]) -> R:
        return await verb.apply(self)

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
        route = self._state.plan.routes.get(name)  # a model with versions: its stable version's snapshot
        return outcome, self.model(route.deployment(route.stable) if route is not None else name)

    async def delete_model(self, name: str) -> None:
        """Stop taking requests for a model, answer what it accepted, unload it."""
        await self._editor.delete(name)

    async def reload(self, path: Path | None = None) -> ReloadReport:
        """Re-read the fleet file (the one served, unless `path`) and apply the difference."""
        self._check_open()
        report = await self._editor.reload(path or Path(self._state.plan.source))
        await self.rollouts.start()
        return report

    def pipelines(self) -> list[PipelinePlan]:
        """The pipelines served now (their runner, a front, reads them here: they change at run time)."""
        return list(self._state.plan.pipelines.values())

    def pipeline(self, name: str) -> PipelinePlan | None:
        return self._state.plan.pipelines.get(name)

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
        return self._state.plan.routes

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
        self._draining = True
        self.intake.closing = True

    def answer_open(self, error: ShuttingDown) -> None:
        """Answer every request still queued with `error`."""
        self.intake.answer_all(error)

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

    def lookup(self, model: str) -> Deployment:
        return self._state.get(model)

    def inputs(self, model: str) -> ModelInputs:
        deployment = self._state.get(model)
        return ModelInputs(deployment.name, tuple(deployment.plugin.cls.accepts), deployment.queue.max_size,
                           deployment.config.queue.priority_levels)

    def screen(self, model: Deployment, terms: Terms, *, gate: bool) -> Screened:
        return self.intake.screen(model, terms, gate=gate)

    def ended(self, model: str, outcome: str) -> None:
        deployment = self._state.deployments.get(model)
        if deployment is not None:
            deployment.outcomes[outcome] += 1

    async def run(self, model: Deployment, terms: Terms, screened: Screened | None, payload: Payload,
                  request_id: str, trace: Phases | None) -> tuple[Answer, float]:
        """The commit decides on the live figures of its moment whatever the screen read, so
        nothing of `screened` is read again."""
        return await self._admitted(model, terms, payload, request_id, trace, terms.wait_for_room)

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
            reply: asyncio.Future[Outcome | None] = asyncio.get_running_loop().create_future()
            ticket = self.intake.enqueue(accepted, item, partial(_deliver, reply), request_id, len(payload.body),
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

    async def _served(self, accepted: Accepted, ticket: Ticket, reply: asyncio.Future[Outcome | None],
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

    async def _await_ticket(self, accepted: Accepted, ticket: Ticket, reply: asyncio.Future[Outcome | None]) -> Outcome:
        """Wait for the ticket's outcome, up to its deadline: then a ticket still queued is withdrawn
        (it never runs), and one whose batch is running gets 504 all the same; no answer comes late.

        The reply is resolved once, by whichever comes first: the outcome, or the deadline's timer
        (with None). An outcome that finds it resolved (or cancelled with its caller) only ends its
        lease. One future and one timer, so the answer wakes the request in one turn of the loop."""
        timer = asyncio.get_running_loop().call_later(max(0.0, ticket.deadline - self.clock()), _deliver, reply, None)
        try:
            outcome = await reply
        except asyncio.CancelledError:
            _abandon(ticket, reply)
            self.intake.withdraw(accepted, ticket)  # the caller went away: never run it
            raise
        finally:
            timer.cancel()
        if outcome is not None:
            return outcome
        _abandon(ticket, reply)
        if self.intake.withdraw(accepted, ticket):
            raise expired(accepted)
        # Running: the deadline still holds. The batch goes on; this input's answer is dropped.
        raise DeadlineExceeded(f"deadline passed after {_budget_ms(accepted)} ms while the batch of model "
                               f"{accepted.admission.model!r} holding this input ran")


def _deliver(reply: asyncio.Future[Outcome | None], outcome: Outcome | None) -> None:
    """Resolve a request's reply with its ticket's outcome, or None at its deadline; the first
    stands, and an outcome that comes second (or to a caller gone) only ends its lease."""
    if not reply.done():
        reply.set_result(outcome)
    elif outcome is not None:
        end_lease(outcome)


def _abandon(ticket: Ticket, reply: asyncio.Future[Outcome | None]) -> None:
    """Nobody will read this ticket's outcome: one that came already, or that comes later, ends its lease."""
    ticket.abandon()
    if reply.done() and not reply.cancelled() and (outcome := reply.result()) is not None:
        end_lease(outcome)


def _budget_ms(accepted: Accepted) -> str:
    admission = accepted.admission
    return f"{(admission.deadline - admission.arrived_at) * 1000:.0f}"


def expired(accepted: Accepted) -> DeadlineExceeded:
    """The 504 of a request still queued at its deadline."""
    return DeadlineExceeded(f"deadline passed after {_budget_ms(accepted)} ms in the queue of model "
                            f"{accepted.admission.model!r}; the input was not run")


def in_process(plan: FleetPlan, **kwargs: Any) -> Serving[Runtime]:
    """One process: `Serving` over this process's runtime (`Runtime`'s keyword arguments)."""
    return Serving(Runtime(plan, **kwargs))
