"""`Serving`: a request's life above the serving core, written once, whatever the layout.

The seam is cut at the core (`Core`): what differs between one process (`router.serving.runtime.Runtime`),
a front of a split host (`router.host.client.EngineClient`, the engine over its socket) and a
cluster's front (`router.cluster.front.ClusterRuntime`, device replicas behind Ray handles) is
how a request is committed and answered, how figures are read and where a fleet call runs. The rest
(terms and deadline from the headers, the outcome each request ends with, mirrored copies counted
apart, the trace's phase, the answer's figures, the admin verbs, the drain) is here, once, and the
HTTP app, V2 over HTTP and gRPC, the pipeline runner and the version router talk to `Serving` only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from router.errors import RouterError, ShuttingDown, outcome_of
from router.logs import new_request_id
from router.sdk.plugin import Payload
from router.serving.editor import ReloadReport
from router.serving.plan import PipelinePlan
from router.serving.residency_executor import UnloadReport
from router.serving.rules import Screened, Terms
from router.serving.snapshots import DeviceInfo, ModelInfo
from router.serving.telemetry import Telemetry, TelemetryFanout, mirrored
from router.serving.traffic import Observation, TrafficChange
from router.serving.verbs import (
    DeleteModel,
    DeletePipeline,
    DeleteVersion,
    LoadModel,
    PutModel,
    PutPipeline,
    PutVersion,
    ReleaseModel,
    Reload,
    SetTraffic,
    UnloadModel,
    Verb,
    pipeline_from_wire,
)
from router.serving.versions import VersionRoute
from router.tracing.api import Phases, within_phase

__all__ = ["SCREEN_WAIT_MIN_BYTES", "Answer", "Core", "InFlight", "ModelInputs", "Serving", "screening"]

log = logging.getLogger("router.serving")
H = TypeVar("H")
R = TypeVar("R")
C = TypeVar("C", bound="Core[Any]")


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


@dataclass(frozen=True)
class ModelInputs:
    """What a request must know of its model before it is screened: the media types its plugin
    accepts (a V2 input's signature), how many items its queue holds and its priority levels.
    They change only with the model's section, so reading them costs no snapshot."""

    name: str
    accepts: tuple[str, ...]
    queue_capacity: int
    priority_levels: int


class Core(Protocol[H]):
    """A serving core, as `Serving` uses it: find a model, screen a request on the figures read
    now, commit it and get its answer, make a fleet call, refuse and answer what is left on a drain,
    and read its snapshots. `H` is the core's handle on one model (a deployment, a front's model
    entry, a model's section)."""

    clock: Callable[[], float]
    telemetry: TelemetryFanout
    #: The trace phase that covers a request's stay in the core, from commit to answer.
    phase: ClassVar[str]

    def lookup(self, model: str) -> H:
        """The model's handle: ModelNotFound (404) for an unknown name, or the 503 of a core that
        cannot take requests at all now. Neither is a request's outcome: it names no model."""
        ...

    def inputs(self, model: str) -> ModelInputs:
        """What a request must know of the model before it is screened (`ModelInputs`); the
        errors of `lookup`."""
        ...

    def screen(self, model: H, terms: Terms, *, gate: bool) -> Screened:
        """The rules on the figures the core can read now, taking nothing; `gate`: predict the
        wait too. Raises the refusal."""
        ...

    async def run(self, model: H, terms: Terms, screened: Screened | None, payload: Payload, request_id: str,
                  trace: Phases | None) -> tuple[Answer, float]:
        """Commit the request (once) and answer it: its answer and its deadline. `screened`, the
        request's screen, is not run again; without one the core decides on what it reads."""
        ...

    def ended(self, model: str, outcome: str) -> None:
        """A request for `model` ended with `outcome` (its snapshots count them)."""
        ...

    async def call(self, verb: Verb[R]) -> R:
        """A fleet call, run where the fleet's state is: its result, or its error raised. Once it
        returns, the core's snapshots (models, pipelines, routes) show what it changed."""
        ...

    def begin_drain(self) -> None: ...
    def answer_open(self, error: ShuttingDown) -> None:
        """The end of a drain: answer every request still open with `error`."""
        ...

    @property
    def ready(self) -> bool: ...
    @property
    def draining(self) -> bool: ...
    def model_names(self) -> list[str]: ...
    def models(self) -> list[ModelInfo]: ...
    def model(self, name: str) -> ModelInfo: ...
    def devices(self) -> list[DeviceInfo]: ...
    def pipelines(self) -> list[PipelinePlan]: ...
    def pipeline(self, name: str) -> PipelinePlan | None: ...
    def routes(self) -> Mapping[str, VersionRoute]: ...
    def rollout(self, name: str) -> dict[str, Any] | None: ...
    def agreement(self, model: str, answer: Any, other: Any) -> float | None: ...
    def report_versions(self, observation: Observation) -> None: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


class Serving(Generic[C]):
    """Every request's handling over one core: `screen` where a request arrives (before its body is
    read) and `submit` to commit and answer it, the admin verbs as typed fleet calls, the drain."""

    def __init__(self, core: C) -> None:
        self.core = core
        self.clock = core.clock
        self.telemetry = core.telemetry
        self._inflight = InFlight()

    # -- the request path -----------------------------------------------------------------------

    def screen(self, model: str, *, priority: int | None = None, timeout_ms: float | None = None,
               received_at: float | None = None, items: int = 1, body_bytes: int | None = None) -> Screened:
        """Refuse, from the model name and the request's headers alone, what the commit would refuse
        before running anything (unknown model, bad header, shutting down, model not serving, queue
        full, predicted to miss its deadline), so that the caller need not read the body. With
        `items`, the queue must have room for all of them (else 413 if it never can). A body
        announced as at most SCREEN_WAIT_MIN_BYTES costs less to read than the wait prediction,
        which is left to the commit. A refusal is the request's outcome; it takes nothing."""
        handle = self.core.lookup(model)
        now = self.clock()
        started = now if received_at is None else min(received_at, now)
        gate = body_bytes is None or body_bytes > SCREEN_WAIT_MIN_BYTES
        try:  # as `screening` does, written out: this runs for every request
            return self.core.screen(handle, Terms(model, started, priority, timeout_ms, items), gate=gate)
        except RouterError as exc:
            self._ended(model, outcome_of(exc), started)
            raise

    async def submit(self, model: str, payload: Payload, *, priority: int | None = None, timeout_ms: float | None = None,
                     request_id: str | None = None, received_at: float | None = None, trace: Phases | None = None,
                     wait_for_room: bool = False, must_finish: bool = False, screened: Screened | None = None,
                     shadow: bool = False) -> Answer:
        """Run one input through a model. Raises a RouterError subclass on any failure.
        `screened`: the request's screen (`screen`); the core commits on it without screening again.
        The deadline counts from `received_at` (the core's clock) when the caller knows it.
        With `trace` (a sampled request's), each phase of the path is recorded there as it ends.
        A pipeline's later steps ask for two things more: `wait_for_room`, a full queue is
        waited on until the deadline (then 504, not run) instead of refused with 503; and
        `must_finish`, an input predicted to be answered after its deadline is refused with 504
        without running, even by an idle model (`router.serving.rules.check_gate`). `shadow`: a
        mirrored copy (`router.routing.mirror`), admitted only into spare device capacity and
        counted apart, never as a user's request."""
        handle = self.core.lookup(model)
        request_id = request_id or new_request_id()
        now = self.clock()
        started = now if received_at is None else min(received_at, now)
        terms = Terms(model, started, priority, timeout_ms, must_finish=must_finish, wait_for_room=wait_for_room,
                      shadow=shadow)
        inflight = self._inflight
        inflight.enter()
        if shadow:  # counted by `mirrored`, never as a user's request
            try:
                with mirrored(self.telemetry, model):
                    return (await self.core.run(handle, terms, None, payload, request_id, None))[0]
            finally:
                inflight.leave()
        outcome = "error"  # "ok", the outcome of the RouterError or cancellation that ends it, or "error"
        try:
            work = self.core.run(handle, terms, screened, payload, request_id, trace)
            answer, deadline = await (work if trace is None else within_phase(trace, self.core.phase, self.clock, work))
            self.telemetry.observe_answer(model, self.clock() - started, deadline - started)
            outcome = "ok"
            return answer
        except (RouterError, asyncio.CancelledError) as exc:
            outcome = outcome_of(exc)
            raise
        finally:
            inflight.leave()
            self._ended(model, outcome, started)

    def _ended(self, model: str, outcome: str, started: float) -> None:
        self.core.ended(model, outcome)
        self.telemetry.observe_request(model, outcome, self.clock() - started)

    # -- snapshots: the core's --------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.core.ready

    @property
    def draining(self) -> bool:
        return self.core.draining

    @property
    def in_flight(self) -> int:
        """Requests inside `submit` now."""
        return self._inflight.count

    def model_names(self) -> list[str]:
        return self.core.model_names()

    def models(self) -> list[ModelInfo]:
        return self.core.models()

    def model(self, name: str) -> ModelInfo:
        """One model's snapshot; ModelNotFound (404) for an unknown name."""
        return self.core.model(name)

    def inputs(self, name: str) -> ModelInputs:
        """What a request must know of the model before it is screened, without a snapshot;
        ModelNotFound (404) for an unknown name."""
        return self.core.inputs(name)

    def devices(self) -> list[DeviceInfo]:
        return self.core.devices()

    def add_telemetry(self, sink: Telemetry) -> None:
        """Also report events (requests, queue waits, batches) to `sink`."""
        self.telemetry.add(sink)

    # -- operators' changes: each one typed fleet call (`router.serving.verbs`) ----------------------

    async def load_model(self, name: str) -> ModelInfo:
        """Load a model now and keep it resident until an operator unloads it."""
        return await self.core.call(LoadModel(name))

    async def unload_model(self, name: str) -> tuple[ModelInfo, list[UnloadReport]]:
        """Unload a model now (queued requests get 503) and keep it out until an operator loads it."""
        return await self.core.call(UnloadModel(name))

    async def release_model(self, name: str, *, unload: bool = False) -> tuple[ModelInfo, list[UnloadReport]]:
        """Undo `load_model`'s hold: on demand again; with `unload`, unloaded now if nothing uses it."""
        return await self.core.call(ReleaseModel(name, unload))

    async def put_model(self, name: str, section: Mapping[str, Any],
                        source: str = "PUT /models") -> tuple[str, ModelInfo]:
        """Add or change a model from its fleet-file section: (added | changed | unchanged, its snapshot)."""
        return await self.core.call(PutModel(name, dict(section), source))

    async def delete_model(self, name: str) -> None:
        """Stop taking requests for a model, answer what it accepted, unload it."""
        await self.core.call(DeleteModel(name))

    async def reload(self, path: Path | None = None) -> ReloadReport:
        """Re-read the fleet file (the one served, unless `path`) and apply the difference."""
        return await self.core.call(Reload(str(path) if path else None))

    # Pipelines: their definitions live with the fleet (admin changes, reload, the 409 that keeps a
    # model a pipeline uses); the pipeline runner (router.pipelines) runs them through `submit`.

    def pipelines(self) -> list[PipelinePlan]:
        return self.core.pipelines()

    def pipeline(self, name: str) -> PipelinePlan | None:
        return self.core.pipeline(name)

    async def put_pipeline(self, name: str, section: Mapping[str, Any],
                           source: str = "PUT /pipelines") -> tuple[str, PipelinePlan]:
        """Add or change a pipeline from its fleet-file section: (added | changed | unchanged, its plan)."""
        outcome, wire = await self.core.call(PutPipeline(name, dict(section), source))
        return outcome, pipeline_from_wire(wire)

    async def delete_pipeline(self, name: str) -> None:
        """Stop serving a pipeline (requests inside it finish)."""
        await self.core.call(DeletePipeline(name))

    # Versions: a routed name's route (its versions, split, stable, mirror), changed whole; the
    # version router (router.routing) routes each request and reports what it saw.

    def routes(self) -> Mapping[str, VersionRoute]:
        """The routed names (models with versions) and their routes now."""
        return self.core.routes()

    async def put_version(self, name: str, version: str, section: Mapping[str, Any],
                          source: str = "PUT /models") -> tuple[str, ModelInfo]:
        """Add or change one version of a routed name: (added | changed | unchanged, its snapshot)."""
        return await self.core.call(PutVersion(name, version, dict(section), source))

    async def delete_version(self, name: str, version: str) -> None:
        """Remove a version that takes no traffic (answering what it accepted)."""
        await self.core.call(DeleteVersion(name, version))

    async def set_traffic(self, name: str, change: TrafficChange) -> VersionRoute:
        """Change a routed name's split, stable version or mirror, whole: the new route."""
        return await self.core.call(SetTraffic(name, change))

    def rollout(self, name: str) -> dict[str, Any] | None:
        """The rollout of a routed name, running or ended; None if it has had none."""
        return self.core.rollout(name)

    def agreement(self, model: str, answer: Any, other: Any) -> float | None:
        """How two answers of `model`'s plugin agree (its `agreement` hook)."""
        return self.core.agreement(model, answer, other)

    def report_versions(self, observation: Observation) -> None:
        """An observation of a version's answer, for the route's rollout (where the fleet's state is)."""
        self.core.report_versions(observation)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.core.start()

    async def stop(self) -> None:
        await self.core.stop()

    def begin_drain(self) -> None:
        """From now on refuse new requests (503) and report not ready; queued work goes on."""
        if not self.core.draining:
            log.info("draining: new requests are refused; %d request(s) in flight", self._inflight.count)
        self.core.begin_drain()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work, let queued and running work finish, then answer whatever is left with 503."""
        self.begin_drain()
        log.info("drain: waiting up to %.1fs for %d request(s)", timeout_s, self._inflight.count)
        try:
            await self._inflight.until_idle(timeout_s)
        except TimeoutError:
            log.warning("drain timeout: answering %d remaining request(s) with 503", self._inflight.count)
        self.core.answer_open(ShuttingDown("server is shutting down"))
        try:
            await self._inflight.until_idle(5.0)
        except TimeoutError:
            log.error("%d request(s) still in flight after drain", self._inflight.count)


#: `screen` leaves the wait prediction to the commit for bodies announced at most this size.
SCREEN_WAIT_MIN_BYTES = 64 * 1024


# Every request ends with exactly one outcome counted, whether its screen refused it (`screening`;
# `Serving.screen` writes it out) or it went on to be answered (`Serving.submit`).


@contextmanager
def screening(ended: Callable[[str], None]) -> Iterator[None]:
    """A request's screen: a refusal from it is the request's outcome (`ended(outcome)`), raised on."""
    try:
        yield
    except RouterError as exc:
        ended(outcome_of(exc))
        raise


class InFlight:
    """Requests being answered: their count, and a wait for none (a drain's)."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def until_idle(self, timeout_s: float) -> None:
        """Return once no request is in flight; TimeoutError after `timeout_s`."""
        await asyncio.wait_for(self._idle.wait(), timeout_s)

