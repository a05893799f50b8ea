"""`EngineClient`: the serving core of a front process, the engine behind its socket.

It is the split host's implementation of `router.serving.facade.Core`: the front's `Serving`
(native API, KServe V2, gRPC, pipelines, versions) handles requests exactly as over one process's
`Runtime`. Behind it: refusals from the engine's board with the very rules the engine runs
(`screen`, once per request: where it arrives, or at the start of `run` for a request that comes
unscreened; the engine commits it), `preprocess` and `postprocess` on this process's plugin
objects, and one `Submit` and one `Reply` per request over the engine's socket; each fleet call
is one typed `Call`. Snapshots are the engine's latest,
with the request counts of every front. The engine gone, not yet synced, or silent past
`engine_stale_s` (`router.host.heartbeat`): every open request and every new one is answered 503
with Retry-After at once, the model routes and readiness answer the same 503, `ready` is false,
and the client reconnects to the engine's successor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar, cast

import msgspec

from router.config import ServerSettings
from router.errors import (
    ConfigError,
    EngineUnavailable,
    ModelChanged,
    ModelError,
    ModelNotFound,
    ShuttingDown,
    brief,
)
from router.host.arena import Arena
from router.host.board import BoardReader
from router.host.exchange import GRACE_S, Exchanges, engine_gone
from router.host.front_models import FrontHookFailed, FrontModel, FrontModels, front_hook
from router.host.heartbeat import HEARTBEAT_EVERY_S, Heartbeat
from router.host.messages import CallReply, Lags, Models, Observed, Packed, PayloadRef, Reply, Snapshot, Submit
from router.host.packing import Packer, unpack
from router.host.stream import EngineStream, handshake
from router.sdk.agreement import default_agreement
from router.sdk.plugin import Payload
from router.serving.facade import Answer, ModelInputs
from router.serving.hooks import check_answer, check_media_type
from router.serving.phases import trace_execution
from router.serving.plan import PipelinePlan
from router.serving.rules import Screened, Terms, screen
from router.serving.snapshots import DeviceInfo, ModelInfo
from router.serving.telemetry import TelemetryFanout
from router.serving.traffic import Observation
from router.serving.verbs import AdminVerb, BeginDrain, Verb, pipeline_from_wire
from router.serving.versions import VersionRoute
from router.tracing.api import Phases

__all__ = ["REQUEST_ARENA_BYTES", "EngineClient"]

log = logging.getLogger("router.host.client")
REQUEST_ARENA_BYTES = 256 * 1024 * 1024
RECONNECT_S = 0.1
#: How long a front waits at start for the engine before it serves anyway (answering 503 until then).
START_WAIT_S = 60.0
LAGS_EVERY_S = 0.05
#: Observations of versions kept for the engine between two sends.
MAX_OBSERVED = 10_000
R = TypeVar("R")


class EngineClient:
    phase: ClassVar[str] = "admission"

    def __init__(self, socket_path: Path, front: int, *, cpu_workers: int = 1,
                 arena_bytes: int = REQUEST_ARENA_BYTES, clock: Callable[[], float] = time.monotonic,
                 stale_after_s: float = ServerSettings.model_fields["engine_stale_s"].default) -> None:
        from router.serving.hooks import HookRunner

        self.socket_path = socket_path
        self.front = front
        self.clock = clock
        self.telemetry = TelemetryFanout()
        self.hooks = HookRunner(cpu_workers, name="front", clock=clock)
        self.arena = Arena.create(f"model-router-requests-{front}", arena_bytes)
        self._packer = Packer(self.arena)
        self._fleet = FrontModels()
        self._pipelines: dict[str, PipelinePlan] = {}  # as the engine last described them (`Models`)
        self._routes: dict[str, VersionRoute] = {}  # likewise
        self._generation = 0  # the fleet's generation of the last `Models`
        self._observed: list[Observation] = []  # for the engine's rollouts, sent with the lags
        self._preparing: Counter[str] = Counter()  # requests prepared here, not yet sent
        self._exchanges = Exchanges(self.arena, clock)
        self._stream: EngineStream | None = None
        self._board: BoardReader | None = None
        self._heartbeat = Heartbeat(front, stale_after_s)
        self._answers: Arena | None = None
        self._snapshot: tuple[bool, bool, list[ModelInfo], list[DeviceInfo]] | None = None
        self._raw_snapshot: Snapshot | None = None
        self._lags: dict[str, list[float]] = {}
        self._draining = False
        self._synced = asyncio.Event()  # a snapshot came from the engine connected now
        self._tasks: set[asyncio.Task[Any]] = set()
        self.request_counts: Callable[[], dict[str, dict[str, int]]] = dict
        self.listening: Callable[[], bool] = lambda: True  # every front of the host listens
        self.inline_buffers = 0

    # -- connection -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to the engine and wait (up to START_WAIT_S) for its fleet and first snapshot: the
        app starts serving (its listening socket queues connections meanwhile) only once it can
        answer them."""
        self._spawn(self._keep_connected(), "engine-link")
        self._spawn(self._report_lags(), "report-lags")
        self._spawn(self._watch_heartbeat(), "heartbeat")
        try:
            await asyncio.wait_for(self._synced.wait(), START_WAIT_S)
        except TimeoutError:
            log.error("front %d: no engine after %.0f s; answering 503 until it comes", self.front, START_WAIT_S)

    def _spawn(self, work: Any, name: str) -> None:
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _keep_connected(self) -> None:
        """Connect, and after each loss of the engine connect to its successor."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                shake = await asyncio.to_thread(handshake, self.socket_path, self.front, self.arena)
            except (OSError, ValueError):
                await asyncio.sleep(RECONNECT_S)
                continue
            self._board = BoardReader(shake.board_fd)
            self._heartbeat.reset()
            self._answers = Arena.attach(shake.answer_fd, shake.welcome.arena_bytes)
            stream = EngineStream(shake.frames, self._on_message, self._on_lost)
            await loop.create_unix_connection(lambda stream=stream: stream, sock=shake.sock)  # type: ignore[misc]
            self._stream = self._exchanges.stream = stream
            for message in shake.early:
                self._on_message(message)
            log.info("front %d connected to the engine (pid %d, epoch %d)", self.front, shake.welcome.engine_pid,
                     shake.welcome.epoch)
            while not stream.closed:
                await asyncio.sleep(RECONNECT_S)

    def _on_lost(self) -> None:
        """The engine is gone: answer everything open with 503 at once; its regions were all ours to reuse."""
        if self._stream is None:
            return
        log.error("front %d lost the engine with %d request(s) open", self.front, self._exchanges.open)
        self._stream = None
        self._synced.clear()
        self._board, self._snapshot, self._raw_snapshot = None, None, None
        self._exchanges.lost()
        if self._answers is not None:
            self._answers.close()
            self._answers = None
        for model in self._fleet.models.values():
            model.prepared_generation = 0  # the new engine hands out front states anew
        self._generation = 0  # and counts its fleet's generations from its start

    def _on_message(self, message: Any) -> None:
        if isinstance(message, Reply):
            self._exchanges.on_reply(message)
        elif isinstance(message, Models):
            if message.generation < self._generation:
                return  # an older fleet than the one this front holds
            self._generation = message.generation
            for model in self._fleet.update(message.models):
                self._spawn(self._fleet.adopt(model), f"adopt-{model.name}")
            wires = msgspec.msgpack.decode(message.pipelines) if message.pipelines else []
            self._pipelines = {wire["name"]: pipeline_from_wire(wire) for wire in wires}
            routes = msgspec.msgpack.decode(message.routes, type=list[VersionRoute]) if message.routes else []
            self._routes = {route.name: route for route in routes}
        elif isinstance(message, Snapshot):
            self._raw_snapshot, self._snapshot = message, None
            self._synced.set()
        elif isinstance(message, CallReply):
            self._exchanges.on_call_reply(message)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._stream is not None:
            self._stream.close()
        self.hooks.shutdown()

    # -- snapshots ------------------------------------------------------------------------------

    def _snapshots(self) -> tuple[bool, bool, list[ModelInfo], list[DeviceInfo]]:
        if self._snapshot is None:
            raw = self._raw_snapshot
            if raw is None:
                return False, self._draining, [], []
            models = msgspec.msgpack.decode(raw.models, type=list[ModelInfo])
            devices = msgspec.msgpack.decode(raw.devices, type=list[DeviceInfo])
            self._snapshot = (raw.ready, raw.draining, models, devices)
        return self._snapshot

    def _away(self) -> EngineUnavailable | None:
        """The 503 to answer while the engine cannot be counted on (gone, not synced, silent); None while it can."""
        if self._stream is None or self._board is None or self._raw_snapshot is None:
            return engine_gone()
        return self._heartbeat.silence(self._board)

    async def _watch_heartbeat(self) -> None:
        """An engine gone silent: the requests sent to it are answered 503 at once, as when it dies."""
        while True:
            await asyncio.sleep(HEARTBEAT_EVERY_S)
            if self._stream is not None and self._board is not None:
                silence = self._heartbeat.look(self._board)
                if silence is not None:
                    self._exchanges.cancel_all(silence)

    @property
    def ready(self) -> bool:
        ready, draining, _, _ = self._snapshots()
        return ready and not draining and not self._draining and self._away() is None and self.listening()

    @property
    def draining(self) -> bool:
        return self._draining or self._snapshots()[1]

    def model_names(self) -> list[str]:
        return list(self._fleet.models)

    def models(self) -> list[ModelInfo]:
        if (away := self._away()) is not None:
            raise away
        counts = self.request_counts()
        return [_with_requests(info, counts.get(info.name)) for info in self._snapshots()[2]]

    def model(self, name: str) -> ModelInfo:
        if (away := self._away()) is not None:
            raise away
        for info in self._snapshots()[2]:
            if info.name == name:
                return _with_requests(info, self.request_counts().get(name))
        raise self._not_found(name)

    def devices(self) -> list[DeviceInfo]:
        return list(self._snapshots()[3])

    def _not_found(self, name: str) -> ModelNotFound:
        known = ", ".join(sorted(self._fleet.models)) or "none"
        return ModelNotFound(f"no model named {brief(name, 80)}; models: {known}")

    # -- the request path -----------------------------------------------------------------------

    def _model(self, name: str) -> FrontModel:
        if (away := self._away()) is not None:
            raise away
        model = self._fleet.get(name)
        if model is None:
            raise self._not_found(name)
        return model

    def _open(self) -> None:
        """Refuse every request while the engine is gone or this front drains."""
        if self._board is None or self._stream is None:
            raise engine_gone()
        if self._draining:
            raise ShuttingDown("server is shutting down; retry on another replica", retry_after_s=5.0)

    def _screen(self, model: FrontModel, terms: Terms) -> Screened:
        """The engine's rules on the board's figures, taking nothing: refusals without a round trip.
        A model not on the board yet is left to the engine (the deadline from its entry)."""
        self._open()
        assert self._board is not None
        read = self._board.figures(model.entry.slot, model.name)
        if read is not None:
            return screen(terms, read[1], self.clock(), pending=self._preparing[model.name])
        return Screened(terms, self._deadline(model, terms))

    def _deadline(self, model: FrontModel, terms: Terms) -> float:
        """The request's deadline from its model's queue timeout (or its own, if shorter)."""
        limit = model.entry.queue_timeout_ms
        return terms.received_at + (min(terms.timeout_ms, limit) if terms.timeout_ms else limit) / 1000

    def lookup(self, model: str) -> FrontModel:
        return self._model(model)

    def inputs(self, model: str) -> ModelInputs:
        entry = self._model(model).entry
        return ModelInputs(entry.name, entry.accepts, entry.queue_capacity, entry.priority_levels)

    def screen(self, model: FrontModel, terms: Terms, *, gate: bool) -> Screened:
        return self._screen(model, terms)

    def ended(self, model: str, outcome: str) -> None:
        """Counted by the front's metrics, which every front writes (`request_counts`)."""

    async def run(self, model: FrontModel, terms: Terms, screened: Screened | None, payload: Payload,
                  request_id: str, trace: Phases | None) -> tuple[Answer, float]:
        """With `trace` (a sampled request's), its phases here (preprocess, queue wait, execute
        from the engine's batch facts, linked to the engine's batch span, postprocess).
        `screened`: the request's screen, not run again; without it the request is screened here
        first. `wait_for_room` and `must_finish` (a pipeline's later steps) go to the engine with
        the request; such a request is not screened here (it waits for room in the engine, where
        the room is freed)."""
        return await self._submit(model, terms, payload, request_id, trace, screened)

    async def _submit(self, front: FrontModel, terms: Terms, payload: Payload, request_id: str,
                      trace: Phases | None, screened: Screened | None) -> tuple[Answer, float]:
        self._open()
        if terms.wait_for_room:  # the engine decides, where the room is freed
            deadline = self._deadline(front, terms)
        else:
            deadline = (screened or self._screen(front, terms)).deadline
        if front.accepts:  # else the engine, which has the plugin, checks
            check_media_type(front.name, front.accepts, payload)
        if front.prepares_here:
            try:
                return await self._prepared(front, terms, deadline, payload, request_id, trace), deadline
            except ModelChanged:  # a new version serves: prepared again, in the engine
                pass
            except FrontHookFailed as failed:  # prepared again in the engine: if that works, from now on
                answer = await self._whole(front, terms, deadline, payload, request_id, trace)
                self._fleet.serve_from_engine(front, failed.hook, failed.error)
                return answer, deadline
        return await self._whole(front, terms, deadline, payload, request_id, trace), deadline

    async def _prepared(self, front: FrontModel, terms: Terms, deadline: float, payload: Payload,
                        request_id: str, trace: Phases | None) -> Answer:
        """Preprocess here, the batch in the engine, postprocess here."""
        plugin, name = front.plugin, front.name
        assert plugin is not None
        if trace is not None:
            trace.enter("preprocess", self.clock())
        self._preparing[name] += 1
        try:
            item = await front_hook(self.hooks.run(name, front.entry.plugin, plugin, "preprocess", payload,
                                                    deadline=deadline), "preprocess")
            packed = self._pack(item)
        finally:
            self._preparing[name] -= 1
        reply, queued_at = await self._exchange(front, terms, deadline, request_id, len(payload.body), trace,
                                                item=packed)
        assert reply.output is not None and reply.facts is not None
        if trace is not None:
            trace_execution(trace, reply.facts, self.clock())
        try:
            output = unpack(reply.output, self._answers)
            result = await front_hook(self.hooks.run(name, front.entry.plugin, plugin, "postprocess", output, item,
                                                      deadline=deadline), "postprocess")
        finally:
            self._exchanges.release(reply.output)
        check_answer(name, front.entry.plugin, result)
        facts = reply.facts
        now = self.clock()
        lag = self._lags.setdefault(name, [0, 0.0])
        lag[0] += 1
        lag[1] += max(0.0, now - facts.dispatched_at - facts.execution_s)
        # The wait as this request saw it: from handing it to the engine to its batch's start (the
        # engine's own count, `queue_wait_s`, leaves out the trip over the socket). Its trace's
        # queue-wait phase is the same interval.
        wait = max(0.0, facts.dispatched_at - queued_at)
        self.telemetry.observe_queue_wait(name, wait)
        return Answer(request_id, name, result, wait, facts.size, facts.execution_s, facts.memory_delta_bytes,
                      plugin.describe_input(payload, item))

    async def _whole(self, front: FrontModel, terms: Terms, deadline: float, payload: Payload,
                     request_id: str, trace: Phases | None) -> Answer:
        """Hooks in the engine: the raw body (and a pipeline's decoded pixels) there, the final answer back."""
        body, packing = self._packer.pack(payload.body)
        offsets = list(packing.offsets)
        pixels = None
        if payload.pixels is not None:
            pixels, pixel_packing = self._packer.pack(payload.pixels)
            offsets += pixel_packing.offsets
        ref = PayloadRef(payload.media_type, payload.filename, body, pixels)
        reply, _ = await self._exchange(front, terms, deadline, request_id, len(payload.body), trace, payload=ref,
                                        offsets=offsets)
        assert reply.answer is not None and reply.facts is not None
        facts = reply.facts
        wait = facts.queue_wait_s  # the engine's, as it measured it (it ran the hooks around it)
        self.telemetry.observe_queue_wait(front.name, wait)
        info = msgspec.msgpack.decode(reply.input_info) if reply.input_info else {}
        return Answer(request_id, front.name, msgspec.msgpack.decode(reply.answer), wait, facts.size,
                      facts.execution_s, facts.memory_delta_bytes, info)

    def _pack(self, item: Any) -> tuple[Packed, list[int]]:
        try:
            packed, packing = self._packer.pack(item)
        except Exception as exc:  # noqa: BLE001  # whatever pickling raises: the plugin's item, a 500
            raise ModelError(f"the preprocessed input cannot reach the engine: {type(exc).__name__}: {exc}") from None
        self.inline_buffers += packing.inline_buffers
        return packed, packing.offsets

    async def _exchange(self, front: FrontModel, terms: Terms, deadline: float, request_id: str, input_bytes: int,
                        trace: Phases | None, *, item: tuple[Packed, list[int]] | None = None,
                        payload: PayloadRef | None = None,
                        offsets: list[int] | None = None) -> tuple[Reply, float]:
        """One Submit, its one Reply (`Exchanges.submit`), and when it was handed to the engine."""
        exchanges = self._exchanges
        submit = Submit(exchanges.number(), terms, request_id, front.entry.generation, input_bytes,
                        item[0] if item else None, payload, trace.ref.to_bytes() if trace is not None else None)
        work = exchanges.submit(submit, item[1] if item else offsets or [], deadline,
                                front.entry.execution_timeout_ms / 1000 + GRACE_S)
        queued_at = self.clock()
        if trace is not None:
            trace.enter("queue wait", queued_at)
        return await work, queued_at

    async def _report_lags(self) -> None:
        """The time from batch end to answer, per model, for the engine's deadline gate."""
        while True:
            await asyncio.sleep(LAGS_EVERY_S)
            if self._lags and self._stream is not None:
                lags, self._lags = self._lags, {}
                self._stream.send(Lags({name: (int(n), total) for name, (n, total) in lags.items()}))
            if self._observed and self._stream is not None:
                observed, self._observed = self._observed, []
                self._stream.send(Observed(tuple(observed)))

    # -- operators' changes and lifecycle --------------------------------------------------------

    async def call(self, verb: Verb[R]) -> R:
        """One fleet call run by the engine: what it returns, or its error raised here. The engine
        sends its news first, so this front's models, pipelines and routes show the change when
        the reply comes."""
        await asyncio.wait_for(self._synced.wait(), 30.0)
        if (away := self._away()) is not None:  # silent: it would not answer
            raise away
        reply = await self._exchanges.call(cast(AdminVerb, verb))  # every Verb is one of AdminVerb
        if reply.failure is not None:
            if reply.failure.kind == "ConfigError":
                raise ConfigError(reply.failure.detail)
            raise reply.failure.error()
        return verb.result(reply.result)

    # Pipelines and routes: as the engine last described them (`Models`); this front's pipeline
    # runner and version router read them, and its observations go with its lags.

    def pipelines(self) -> list[PipelinePlan]:
        return list(self._pipelines.values())

    def pipeline(self, name: str) -> PipelinePlan | None:
        return self._pipelines.get(name)

    def routes(self) -> Mapping[str, VersionRoute]:
        return self._routes

    def rollout(self, name: str) -> dict[str, Any] | None:
        raw = self._raw_snapshot
        if raw is None or not raw.rollouts:
            return None
        return msgspec.msgpack.decode(raw.rollouts).get(name)  # type: ignore[no-any-return]

    def agreement(self, model: str, answer: Any, other: Any) -> float | None:
        front = self._fleet.get(model)
        hook = getattr(front.plugin, "agreement", None) if front is not None and front.plugin is not None else None
        return hook(answer, other) if hook is not None else default_agreement(answer, other)

    def report_versions(self, observation: Observation) -> None:
        if len(self._observed) < MAX_OBSERVED:  # an engine away for long: its rollouts miss the rest
            self._observed.append(observation)

    def begin_drain(self) -> None:
        """Refuse new requests here at once, and have the engine refuse them everywhere."""
        if not self._draining and self._stream is not None:
            self._spawn(self.call(BeginDrain()), "begin-drain")
        self._draining = True

    def answer_open(self, error: ShuttingDown) -> None:
        """Answer every request still waiting for the engine with `error`."""
        self._exchanges.cancel_all(error)


def _with_requests(info: ModelInfo, counts: Mapping[str, int] | None) -> ModelInfo:
    """A model's snapshot with the request counts of every front (the engine sees only part of them)."""
    from dataclasses import replace

    return replace(info, requests=dict(counts or {}))
