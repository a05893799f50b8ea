"""One set of request rules, every front: the same cases over the single-process `Runtime`, a split
host's front (`EngineClient` over a real engine process, refusing from its board), and the Ray
cluster's front (`ClusterRuntime`, its replica a real `Runtime` in this process).

Each case drives the façade's verbs and checks the error that answers: its class, status, Retry-After
and words. The rules themselves are `router.serving.rules`; these cases prove that every front
reaches the same answers through them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from router.cluster.front import ClusterRuntime, PredictCall
from router.cluster.reports import ErrorReply, ReplicaReport, Reply
from router.config import ServerSettings, load_fleet
from router.errors import InputError, ModelNotFound, ModelUnavailable, PayloadTooLarge, QueueFull, RouterError, ShuttingDown
from router.host.client import EngineClient
from router.host.handover import write_settings
from router.sdk.plugin import Payload
from router.serving.facade import ModelInputs, Serving
from router.serving.plan import load_plan
from router.serving.runtime import Runtime, in_process
from router.serving.snapshots import ModelInfo

FLEET = """
cluster: {node_types: {host: {device: cpu, num_gpus: 0}}}
models:
  m:
    plugin: scripted
    options: {fixed_ms: 300}
    queue: {max_size: 2, timeout_ms: 5000, priority_levels: 3}
    batch: {max_size: 1}
"""
FRONTS = ("one process", "split host", "cluster front")


def ask(ident: str) -> Payload:
    return Payload(json.dumps({"id": ident}).encode(), "application/json")


class InProcessReplica:
    """`ReplicaCalls` to one device replica's core, a `Runtime` in this process (Ray's place)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    async def predict(self, node_type: str, call: PredictCall, avoid: tuple[str, ...], wait_s: float) -> Reply:
        try:
            answer = await self.runtime.submit(call.model, Payload(call.body, call.media_type, call.filename),
                                               priority=call.priority, timeout_ms=call.timeout_ms,
                                               request_id=call.request_id)
        except RouterError as exc:
            return Reply("replica-1", error=ErrorReply.of(exc))
        return Reply("replica-1", answer=answer)

    async def view(self) -> list[ReplicaReport]:
        return []

    async def admin(self, verb: str, model: str) -> None:
        await (self.runtime.unload_model(model) if verb == "unload" else self.runtime.load_model(model))


@dataclass(frozen=True)
class Front:
    facade: Serving
    core: Callable[[], ModelInfo]  # model m as the serving core behind the front sees it now


@asynccontextmanager
async def front(kind: str, tmp_path: Path) -> AsyncIterator[Front]:
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET, encoding="utf-8")
    if kind == "split host":
        async with _split_host(path, tmp_path) as client:
            serving = Serving(client)
            yield Front(serving, lambda: serving.model("m"))
        return
    runtime = in_process(load_plan(path))
    await runtime.start()
    await runtime.core.wait_loaded()
    facade: Serving = runtime if kind == "one process" else Serving(ClusterRuntime(load_fleet(path), InProcessReplica(runtime)))
    if facade is not runtime:
        await facade.start()
    try:
        yield Front(facade, lambda: runtime.model("m"))
    finally:
        await runtime.drain(2.0)
        await runtime.stop()
        if facade is not runtime:
            await facade.stop()


@asynccontextmanager
async def _split_host(path: Path, tmp_path: Path) -> AsyncIterator[EngineClient]:
    socket_path, settings = tmp_path / "engine.sock", tmp_path / "settings.json"
    write_settings(ServerSettings(config=path), settings)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    engine = await asyncio.create_subprocess_exec(sys.executable, "-m", "router.host.engine_main", "--socket",
                                                  str(socket_path), "--parent", str(os.getpid()), "--settings",
                                                  str(settings), env=env)
    client = EngineClient(socket_path, 1)
    try:
        await client.start()
        async with asyncio.timeout(60):
            while not client.ready:
                await asyncio.sleep(0.05)
        yield client
    finally:
        await client.stop()
        engine.terminate()
        await asyncio.wait_for(engine.wait(), 30)


async def error_of(work: Callable[[], Awaitable[Any]] | Callable[[], Any]) -> RouterError:
    try:
        result = work()
        if asyncio.iscoroutine(result):
            await result
    except RouterError as exc:
        return exc
    raise AssertionError("no error answered the request")


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def unknown_model(front: Front) -> RouterError:
    return await error_of(lambda: front.facade.screen("nope"))


async def priority_out_of_range(front: Front) -> RouterError:
    return await error_of(lambda: front.facade.submit("m", ask("p"), priority=9))


async def timeout_not_positive(front: Front) -> RouterError:
    return await error_of(lambda: front.facade.screen("m", timeout_ms=0))


async def more_items_than_the_queue_holds(front: Front) -> RouterError:
    return await error_of(lambda: front.facade.screen("m", items=3))


async def queue_full(front: Front) -> RouterError:
    facade = front.facade
    held = [asyncio.ensure_future(facade.submit("m", ask("running")))]
    await until(lambda: front.core().instances[0].busy)
    held += [asyncio.ensure_future(facade.submit("m", ask(f"waiting{i}"))) for i in range(2)]
    await until(lambda: front.core().queue_depth == 2)
    error = await error_of(lambda: facade.submit("m", ask("late")))
    await asyncio.gather(*held)
    return error


async def predicted_past_its_deadline(front: Front) -> RouterError:
    facade = front.facade
    busy = [asyncio.ensure_future(facade.submit("m", ask("busy0")))]
    await until(lambda: front.core().instances[0].busy)
    busy += [asyncio.ensure_future(facade.submit("m", ask(f"busy{i}"))) for i in (1, 2)]
    # A real batch has ended (the estimate is fresh) and the next one has left the queue: room for
    # one more, so the answer is the deadline's, not a full queue's (which a slow machine reaches first).
    await until(lambda: front.core().instances[0].batches >= 1 and front.core().queue_depth < 2)
    error = await error_of(lambda: facade.submit("m", ask("hurried"), timeout_ms=100))
    await asyncio.gather(*busy)
    return error


async def shutting_down(front: Front) -> RouterError:
    front.facade.begin_drain()
    return await error_of(lambda: front.facade.submit("m", ask("d")))


async def unloaded_by_an_operator(front: Front) -> RouterError:
    await front.facade.unload_model("m")
    await until(lambda: front.core().state == "unloaded")
    return await error_of(lambda: front.facade.submit("m", ask("u")))


@dataclass(frozen=True)
class Expected:
    error: type[RouterError]
    status: int
    words: str  # a regular expression the detail must match
    retry_after: bool = False


CASES: dict[Callable[[Front], Awaitable[RouterError]], Expected] = {
    unknown_model: Expected(ModelNotFound, 404, r"no model named 'nope'; models: m"),
    priority_out_of_range: Expected(InputError, 400, r"X-Priority must be an integer from 1 to 3, got 9"),
    timeout_not_positive: Expected(InputError, 400, r"X-Timeout-Ms must be a positive number of milliseconds, got 0"),
    more_items_than_the_queue_holds: Expected(PayloadTooLarge, 413,
                                              r"queues at most 2 requests; 3 items in one request can never fit"),
    queue_full: Expected(QueueFull, 503, r"model 'm' queue is full \(2 requests\)", retry_after=True),
    predicted_past_its_deadline: Expected(QueueFull, 503, r"model 'm' is overloaded: an answer is predicted in about "
                                                          r"\d+ ms.*more than this request's \d+ ms deadline",
                                          retry_after=True),
    shutting_down: Expected(ShuttingDown, 503, r"shutting down; retry", retry_after=True),
    unloaded_by_an_operator: Expected(ModelUnavailable, 503, r"model 'm' was unloaded by an operator",
                                      retry_after=True),
}


@pytest.mark.parametrize("kind", FRONTS)
@pytest.mark.parametrize("case", list(CASES), ids=lambda case: case.__name__)
async def test_every_front_answers_a_request_by_the_same_rules(
    kind: str, case: Callable[[Front], Awaitable[RouterError]], tmp_path: Path
) -> None:
    expected = CASES[case]
    async with front(kind, tmp_path) as served:
        error = await case(served)
    assert type(error) is expected.error, f"{kind}: {type(error).__name__}: {error.detail}"
    assert error.status_code == expected.status
    assert re.search(expected.words, error.detail), f"{kind}: {error.detail!r}"
    assert ("Retry-After" in error.headers) == expected.retry_after, error.headers


@pytest.mark.parametrize("kind", FRONTS)
async def test_what_a_request_needs_of_its_model_is_what_its_snapshot_says(kind: str, tmp_path: Path) -> None:
    """`Serving.inputs` (V2's signature, its item limit and priorities, a pipeline's entry) reads
    no snapshot, and says what the model's snapshot says, on every front; 404 for an unknown name."""
    async with front(kind, tmp_path) as served:
        info = served.facade.model("m")
        inputs = served.facade.inputs("m")
        error = await error_of(lambda: served.facade.inputs("nope"))
    assert inputs == ModelInputs("m", info.accepts, info.queue_capacity, info.priority_levels)
    if kind != "cluster front":  # a cluster front knows a model's inputs from its replicas' reports
        assert (inputs.accepts, inputs.queue_capacity, inputs.priority_levels) == (("application/json", "application/octet-stream"), 2, 3)
    assert isinstance(error, ModelNotFound) and error.status_code == 404
