"""The pipeline runner: a front that runs a pipeline's steps through the serving façade.

A request's input is decoded once (an image), submitted to the first model like any request
(503 with Retry-After at the door when that model cannot serve it in time), and its answer goes
through the transform, whose items (crops) are submitted to the next model one by one as they
are made: each is one input of that model's queue, batched with the inputs of other requests.
Every step runs under the request's one deadline and priority; a later step's item waits for
room in a full queue while its deadline allows and is answered 504, not run, once it can no
longer finish (`submit(wait_for_room=True, must_finish=True)`). The first failure answers the
request, naming the step, and cancels every other item of it.

Traced (a `trace` path given, as to `submit`), the pipeline is one phase of that path, "pipeline",
and each step a stage beside it (`RequestSteps`): every item a model step submits carries its own
phases under its step's stage, linked to the batch it rode.

It uses only `Serving`'s verbs (`screen`, `submit`, `model`, `pipeline`), so it runs
unchanged wherever its core puts the queues. A request is screened once, at the
door (the first model's screen); its first step is committed with that screen, each later step's
item committed where its queue is, unscreened (it waits for room instead of being refused).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from router.errors import DeadlineExceeded, InputError, ModelError, ModelNotFound, RouterError, brief, outcome_of, with_detail
from router.pipeline_config import StepConfig
from router.pipelines.info import PipelineInfo, pipeline_info
from router.pipelines.steps import PipelineAnswer, PipelineTelemetry, RequestSteps
from router.routing import VersionRouter
from router.sdk.images import decode_image
from router.sdk.plugin import Payload
from router.sdk.transforms import StepItem, Transform, Transformed
from router.serving.facade import ModelInputs, Serving, screening
from router.serving.plan import PipelinePlan
from router.serving.rules import Screened
from router.serving.snapshots import ModelInfo
from router.serving.transforms import TransformRegistry
from router.tracing.api import Phases, within_phase

__all__ = ["MAX_STEP_ITEMS", "PipelineRunner"]

log = logging.getLogger("router.pipelines")
T = TypeVar("T")
#: The most items one step may make from one input, whatever a plugin's transform does.
MAX_STEP_ITEMS = 4096


@dataclass
class _Request:
    """One pipeline request on its way: what every step of it shares."""

    pipeline: str
    request_id: str
    priority: int | None
    started: float
    budget_ms: float
    steps: RequestSteps = field(default_factory=RequestSteps)
    items: int = 0
    failures: dict[str, RouterError] = field(default_factory=dict)  # by step key: what each failed step answered
    screened: Screened | None = None  # the door's screen of the first model, for its commit

    @property
    def deadline(self) -> float:
        return self.started + self.budget_ms / 1000

    def item_id(self) -> str:
        self.items += 1
        return f"{self.request_id}.{self.items}"

    def failed(self, key: str, error: RouterError) -> RouterError:
        failure = with_detail(error, f"pipeline {self.pipeline!r}, step {key}: {error.detail}")
        self.failures.setdefault(key, failure)
        return failure


class PipelineRunner:
    """Runs the façade's pipelines; owns only their request counters and transform objects."""

    def __init__(self, facade: Serving, *, clock: Callable[[], float] = time.monotonic,
                 transforms: TransformRegistry | None = None, versions: VersionRouter | None = None) -> None:
        self.facade = facade
        # Every model name a front serves goes through the version router (a pipeline's steps too):
        # this runner holds the front's one router, which the other ways in use.
        self.versions = versions if versions is not None else VersionRouter(facade, clock=clock)
        self.clock = clock
        self.telemetry: list[PipelineTelemetry] = []
        self.requests: defaultdict[str, Counter[str]] = defaultdict(Counter)
        # Where the counts shown come from: this runner's own, or (a front of a split host) every
        # front's, summed from the metrics they all write (`RouterMetrics.pipeline_counts`).
        self.counts: Callable[[], Mapping[str, Mapping[str, int]]] = lambda: self.requests
        self._transforms: dict[tuple[str, int], tuple[StepConfig, Transform]] = {}  # type: ignore[type-arg]
        self._registry = transforms  # by default the installed ones, looked up at the first transform

    def add_telemetry(self, sink: PipelineTelemetry) -> None:
        self.telemetry.append(sink)

    # -- snapshots ------------------------------------------------------------------------------

    def plan(self, name: str) -> PipelinePlan:
        plan = self.facade.pipeline(name)
        if plan is None:
            known = ", ".join(sorted(p.name for p in self.facade.pipelines())) or "none"
            raise ModelNotFound(f"no pipeline named {brief(name, 80)}; pipelines: {known}")
        return plan

    def known_model(self, name: str) -> ModelInfo:
        """The model called `name`, for a route where the name could be a pipeline's too: its 404 lists both."""
        try:
            return self.facade.model(self.versions.target(name))
        except ModelNotFound as exc:
            raise self.not_found(name, exc) from None

    def known_inputs(self, name: str) -> ModelInputs:
        """As `known_model`, what a request needs of the model (no snapshot)."""
        try:
            return self.facade.inputs(self.versions.target(name))
        except ModelNotFound as exc:
            raise self.not_found(name, exc) from None

    def not_found(self, name: str, error: ModelNotFound) -> ModelNotFound:
        """The façade's 404 for a model `name` where the name could be a pipeline's too: with the
        pipelines listed after the models (as it is where there are none)."""
        pipelines = sorted(plan.name for plan in self.facade.pipelines())
        if not pipelines:
            return error
        models = ", ".join(sorted(self.facade.model_names())) or "none"
        return ModelNotFound(f"no model or pipeline named {brief(name, 80)}; models: {models}; "
                             f"pipelines: {', '.join(pipelines)}")

    def infos(self) -> list[PipelineInfo]:
        counts = self.counts()
        return [pipeline_info(plan, self.facade, counts.get(plan.name, {})) for plan in self.facade.pipelines()]

    def info(self, name: str) -> PipelineInfo:
        return pipeline_info(self.plan(name), self.facade, self.counts().get(name, {}))

    # -- the request path ------------------------------------------------------------------------

    def screen(self, name: str, *, priority: int | None = None, timeout_ms: float | None = None,
               received_at: float | None = None, items: int = 1, body_bytes: int | None = None) -> Screened:
        """What the first model would refuse before running anything (`Serving.screen`): its
        screen, which `run` takes on to the first step."""
        plan = self.plan(name)
        started = self.clock() if received_at is None else received_at
        try:
            with screening(lambda outcome: self._count(name, outcome, started)):
                return self.versions.screen(plan.entry, priority=priority, timeout_ms=_budget_ms(plan, timeout_ms),
                                          received_at=received_at, items=items, body_bytes=body_bytes)
        except RouterError as exc:
            raise with_detail(exc, f"pipeline {name!r}: {exc.detail}") from None

    async def run(self, name: str, payload: Payload, *, priority: int | None = None, timeout_ms: float | None = None,
                  request_id: str | None = None, received_at: float | None = None,
                  trace: Phases | None = None, screened: Screened | None = None) -> PipelineAnswer:
        """Run one input through a pipeline. Raises a RouterError whose detail names the step.
        With `trace`, the run is its "pipeline" phase and each step a stage of it. `screened`: the
        request's screen (`screen`), which its first step is committed with."""
        plan = self.plan(name)
        started = self.clock() if received_at is None else min(received_at, self.clock())
        request: _Request | None = None
        try:
            request = _Request(name, request_id or uuid.uuid4().hex, priority, started, _budget_ms(plan, timeout_ms),
                               RequestSteps(trace), screened=screened)
            for index, step in enumerate(plan.config.steps):  # the answer lists every step, run or not
                request.steps.step(f"{index}:{step.name}", step.kind, step.name)
            work = self._run(request, plan, payload)
            output = await (work if trace is None else within_phase(trace, "pipeline", self.clock, work))
        except BaseException as exc:
            self._count(name, outcome_of(exc), started)
            raise
        finally:
            if request is not None:
                request.steps.end_stages(self.clock(), request.failures)
        assert request is not None
        seconds = self.clock() - started
        self._count(name, "ok", started)
        request.steps.report(self.telemetry, name)
        return PipelineAnswer(request.request_id, name, output, seconds, list(request.steps.steps.values()))

    async def _run(self, request: _Request, plan: PipelinePlan, payload: Payload) -> Any:
        source = await self._entry_input(request, plan, payload)
        return await self._chain(request, plan.name, plan.config.steps, 0, source, "", entry=True)

    def _count(self, name: str, outcome: str, started: float) -> None:
        self.requests[name][outcome] += 1
        for sink in self.telemetry:
            sink.observe_pipeline(name, outcome, self.clock() - started)

    async def _entry_input(self, request: _Request, plan: PipelinePlan, payload: Payload) -> Payload:
        """The input decoded once, when the first model takes images: every step after it cuts from these pixels."""
        accepts = self.facade.inputs(self.versions.target(plan.entry)).accepts
        if payload.pixels is not None or not any(a.lower().startswith("image/") for a in accepts):
            return payload
        pixels = await self._off_loop(request, "input", decode_image, payload)
        return Payload(payload.body, payload.media_type, payload.filename, pixels=pixels)

    async def _chain(self, request: _Request, owner: str, steps: list[StepConfig], start: int, payload: Payload,
                     prefix: str, *, entry: bool) -> Any:
        """The answer of `steps[start:]` for one input: the first one's answer, the rest's attached to it."""
        head = steps[start]
        key = f"{prefix}{start}:{head.name}"
        if head.kind == "model":
            answer = await self._model(request, key, head.name, payload, entry)
        else:
            inner = self.facade.pipeline(head.name)
            if inner is None:
                raise request.failed(key, ModelNotFound(f"no pipeline named {head.name!r} (removed meanwhile)"))
            started = self.clock()
            request.steps.reached(key, "pipeline", head.name, started)
            answer = await self._chain(request, head.name, inner.config.steps, 0, payload, f"{key}/", entry=entry)
            request.steps.step(key, "pipeline", head.name).span(started, self.clock())
        if start == len(steps) - 1:
            return answer
        transformed = await self._transform(request, owner, steps, start + 1, payload, answer, prefix)
        attach_as = steps[start + 2].name

        async def attach(item: StepItem) -> None:
            item.into[attach_as] = await self._chain(request, owner, steps, start + 2, item.payload, prefix, entry=False)

        await self._fan_out(request, f"{prefix}{start + 1}:{steps[start + 1].name}", transformed.items, attach)
        return transformed.answer

    async def _model(self, request: _Request, key: str, model: str, payload: Payload, entry: bool) -> Any:
        """One input through one model: the entry as any request; later steps within what is left."""
        now = self.clock()
        left_ms = (request.deadline - now) * 1000
        trace = request.steps.item_path(key, model, now)
        try:
            if entry:
                answer = await self.versions.submit(model, payload, priority=request.priority, timeout_ms=request.budget_ms,
                                                  request_id=request.request_id, received_at=request.started, trace=trace,
                                                  screened=request.screened)
            elif left_ms <= 0:
                raise DeadlineExceeded(f"the deadline passed before model {model!r}; the input was not run")
            else:
                answer = await self.versions.submit(model, payload, priority=request.priority, timeout_ms=left_ms,
                                                  request_id=request.item_id(), received_at=now, trace=trace,
                                                  wait_for_room=True, must_finish=True)
        except RouterError as exc:
            raise request.failed(key, exc) from None
        request.steps.model_step(key, model, now, self.clock(), answer.queue_wait_s, answer.execution_s,
                                 answer.batch_size)
        return answer.output

    async def _transform(self, request: _Request, owner: str, steps: list[StepConfig], index: int, payload: Payload,
                         answer: Any, prefix: str) -> Transformed:
        key = f"{prefix}{index}:{steps[index].name}"
        transform = self._transform_object(owner, index, steps[index])
        started = self.clock()
        request.steps.reached(key, "transform", steps[index].name, started)
        try:
            transformed = await self._off_loop(request, key, transform.apply, payload, answer)
        except DeadlineExceeded as exc:
            raise request.failed(key, exc) from None
        except Exception as exc:  # noqa: BLE001  # a plugin's transform: its failure answers the request, 500
            raise request.failed(key, _transform_error(steps[index].name, exc)) from None
        request.steps.step(key, "transform", steps[index].name).span(started, self.clock())
        return transformed

    def _transform_object(self, owner: str, index: int, step: StepConfig) -> Transform:  # type: ignore[type-arg]
        """The step's transform with its options, made once per step definition."""
        cached = self._transforms.get((owner, index))
        if cached is not None and cached[0] == step:
            return cached[1]
        if self._registry is None:
            self._registry = TransformRegistry.from_entry_points()
        info = self._registry.get(step.name)
        if info is None:
            raise ModelError(self._registry.why_missing(step.name))
        transform = info.cls(info.cls.Options.model_validate(step.options))
        self._transforms[(owner, index)] = (step, transform)
        return transform

    async def _fan_out(self, request: _Request, key: str, items: Iterable[StepItem],
                       attach: Callable[[StepItem], Awaitable[None]]) -> None:
        """Each item to the next step as soon as it is made; the first failure cancels the rest."""
        stats = request.steps.step(key, "transform", key.rpartition(":")[2])
        tasks: list[asyncio.Future[None]] = []
        try:
            for item in _made(items, key, request):
                if len(tasks) >= MAX_STEP_ITEMS:
                    raise request.failed(key, ModelError(f"the transform made more than {MAX_STEP_ITEMS} items from "
                                                         "one input"))
                stats.items += 1
                tasks.append(asyncio.ensure_future(attach(item)))
            if tasks:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                failed = next((t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception()), None)
                if failed is not None:
                    raise failed
        finally:
            for task in tasks:
                task.cancel()  # a no-op for finished ones: nothing of an answered request keeps running
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _off_loop(self, request: _Request, key: str, fn: Callable[..., T], *args: Any) -> T:
        """CPU work (a decode, a transform) on a worker thread, within the request's deadline."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args), max(0.0, request.deadline - self.clock()))
        except TimeoutError:
            raise DeadlineExceeded(f"pipeline {request.pipeline!r}: the deadline passed at step {key}") from None
        except RouterError as exc:
            if key == "input":
                raise with_detail(exc, f"pipeline {request.pipeline!r}: {exc.detail}") from None
            raise


def _made(items: Iterable[StepItem], key: str, request: _Request) -> Iterable[StepItem]:
    """A transform's items, its failure while making them named as the step's."""
    iterator = iter(items)
    while True:
        try:
            item = next(iterator)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001  # a plugin's transform making its items: as above
            raise request.failed(key, _transform_error(key, exc)) from None
        if not isinstance(item, StepItem):
            raise request.failed(key, ModelError(f"the transform made a {type(item).__name__}, not a StepItem"))
        yield item


def _transform_error(name: str, exc: Exception) -> RouterError:
    """A transform that cannot read the answer before it fails the request (500): neither the
    client's input nor its retry is the problem."""
    if isinstance(exc, RouterError) and not isinstance(exc, InputError):
        return exc
    detail = exc.detail if isinstance(exc, RouterError) else f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, RouterError):
        log.error("transform %s raised: %s", name, detail, exc_info=exc)
    return ModelError(f"transform {name} failed: {detail}")


def _budget_ms(plan: PipelinePlan, timeout_ms: float | None) -> float:
    """The request's time, in ms: the pipeline's timeout_ms, or shorter if asked."""
    if timeout_ms is None:
        return float(plan.config.timeout_ms)
    if not timeout_ms > 0:
        raise InputError(f"X-Timeout-Ms must be a positive number of milliseconds, got {timeout_ms}")
    return min(timeout_ms, plan.config.timeout_ms)
