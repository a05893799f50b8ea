"""One decoded V2 request through the serving façade: screened against the model's queue as a whole
(once, with every term the request brings: its items, priority and timeout), split into items,
every item submitted at once with that screen so they share the queue and the batcher, each
committed where its queue is. Every front that speaks V2 (HTTP, gRPC, a gRPC stream's frames) runs
its requests through `run_request`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from router.errors import RouterError
from router.inference_protocol.payloads import select_outputs, signature, to_payloads
from router.inference_protocol.request import InferRequest, RequestedOutput
from router.logs import new_request_id, request_id_var
from router.sdk.plugin import Payload
from router.serving.facade import Answer, ModelInputs, Serving
from router.serving.rules import Screened
from router.tracing.api import Phases, RequestSpan

__all__ = ["SMALL_REQUEST_BYTES", "Entry", "ItemFailed", "Ran", "is_small", "item_traces", "off_loop", "run_request",
           "submit_all"]

T = TypeVar("T")
#: A V2 request body up to this size is decoded and split into items on the event loop.
SMALL_REQUEST_BYTES = 8 * 1024


class ItemFailed(Exception):
    """One item of a V2 batch failed; the request answers with its error, naming the item."""

    def __init__(self, index: int, count: int, error: RouterError) -> None:
        super().__init__(f"item {index} of {count}: {error.detail}")
        self.index, self.count, self.error = index, count, error


@dataclass(frozen=True)
class Entry:
    """Where a V2 request's items go: a model through the serving façade, or a pipeline through its
    runner. `screen(name, ...)` refuses before any item is queued, or gives the request's
    `Screened`; `submit(name, payload, ..., trace=..., screened=...)` answers one item with
    something that has `output`."""

    name: str
    screen: Callable[..., Screened]
    submit: Callable[..., Awaitable[Any]]

    @classmethod
    def model(cls, runtime: Serving, name: str) -> Entry:
        return cls(name, runtime.screen, runtime.submit)


@dataclass(frozen=True)
class Ran:
    """A request's answers, with the outputs to encode them as."""

    outputs: tuple[RequestedOutput, ...]
    answers: list[Any]  # Answer, or a pipeline's answer: each has `output`


async def run_request(entry: Entry | Serving, model: ModelInputs, request: InferRequest, *, priority: int | None,
                      timeout_ms: float | None, received_at: float | None,
                      placed: Callable[[], None] | None = None, traces: Sequence[Phases | None] | None = None,
                      small: bool = False) -> Ran:
    """Screen the whole request against the queue (before any item is queued), make its payloads
    (off the event loop, unless the request is `small`: see `off_loop`), submit them all with that
    screen and wait for every answer. `entry` is where the items go (a serving façade: to `model`).
    `placed` is called once every item's submission has started (each takes its place in the queue
    in its first step); `traces`, one per item, records each item's phases."""
    target = entry if isinstance(entry, Entry) else Entry.model(entry, model.name)
    screened = target.screen(target.name, priority=priority, timeout_ms=timeout_ms, received_at=received_at,
                             items=request.items)
    sig = signature(model.accepts)
    outputs = select_outputs(request, sig)
    payloads = await off_loop(small, to_payloads, request, target.name, sig)
    tasks = _start(target, payloads, priority, timeout_ms, received_at, traces, screened)
    if placed is not None:
        placed()
    return Ran(outputs, await _answers(tasks))


async def off_loop(small: bool, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a thread, off the event loop; on the loop itself for a `small` request, whose
    decoding costs less than the hand-off to a thread and back (some 30 to 60 us of the loop's time,
    and two wake-ups on the request's way)."""
    if small:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def is_small(body_bytes: int, shared_memory: bool) -> bool:
    """A request decoded on the event loop: a body of at most SMALL_REQUEST_BYTES that reads no
    shared memory (a region can hold far more than its request's body)."""
    return body_bytes <= SMALL_REQUEST_BYTES and not shared_memory


def item_traces(span: RequestSpan, trace: Phases, items: int) -> list[Phases | None]:
    """The phases of each item's path: the request's own path for one item; for many, each item has
    its own under the request's span (they run side by side), while the request's is in "items"."""
    if items == 1:
        return [trace]
    trace.enter("items", time.monotonic())
    return [span.phases(item=index) for index in range(items)]


async def submit_all(
    runtime: Serving, model: str, payloads: Sequence[Payload], priority: int | None, timeout_ms: float | None,
    arrived: float | None,
) -> list[Answer]:
    """Submit every item at once so they share the queue and the batcher; answers in item order.

    The first failure (in item order) answers the request, and the remaining items are cancelled."""
    return await _answers(_start(Entry.model(runtime, model), payloads, priority, timeout_ms, arrived))


def _start(entry: Entry, payloads: Sequence[Payload], priority: int | None, timeout_ms: float | None,
           arrived: float | None, traces: Sequence[Phases | None] | None = None,
           screened: Screened | None = None) -> list[asyncio.Future[Any]]:
    base = request_id_var.get() or new_request_id()
    ids = [base] if len(payloads) == 1 else [f"{base}.{i}" for i in range(len(payloads))]
    tasks = []
    for index, (payload, rid) in enumerate(zip(payloads, ids, strict=True)):
        trace = traces[index] if traces else None
        tasks.append(asyncio.ensure_future(entry.submit(entry.name, payload, priority=priority, timeout_ms=timeout_ms,
                                                        request_id=rid, received_at=arrived, trace=trace,
                                                        screened=screened)))
    return tasks


async def _answers(tasks: list[asyncio.Future[Any]]) -> list[Any]:
    """Every task's answer, in order; the first failure (in item order) raises, the rest are cancelled."""
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((i for i, t in enumerate(tasks) if t.done() and not t.cancelled() and t.exception()), None)
    finally:
        for task in tasks:
            task.cancel()  # a no-op for finished ones
        await asyncio.gather(*tasks, return_exceptions=True)
    if failed is not None:
        error = tasks[failed].exception()
        assert error is not None
        if len(tasks) > 1 and isinstance(error, RouterError):
            raise ItemFailed(failed, len(tasks), error) from error  # not by editing it: a batch shares its error
        raise error
    return [task.result() for task in tasks]
