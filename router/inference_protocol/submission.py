"""One decoded V2 request through the serving façade: checked against the model's queue as a whole,
split into items, every item submitted at once so they share the queue and the batcher. Every
front that speaks V2 (HTTP, gRPC, a gRPC stream's frames) runs its requests through `run_request`."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.errors import RouterError
from router.inference_protocol.payloads import select_outputs, signature, to_payloads
from router.inference_protocol.request import InferRequest, RequestedOutput
from router.logs import request_id_var
from router.sdk.plugin import Payload
from router.serving.facade import ServingFacade
from router.serving.runtime import Answer
from router.serving.snapshots import ModelInfo
from router.tracing.api import Phases

__all__ = ["ItemFailed", "Ran", "run_request", "submit_all"]


class ItemFailed(Exception):
    """One item of a V2 batch failed; the request answers with its error, naming the item."""

    def __init__(self, index: int, count: int, error: RouterError) -> None:
        super().__init__(f"item {index} of {count}: {error.detail}")
        self.index, self.count, self.error = index, count, error


@dataclass(frozen=True)
class Ran:
    """A request's answers, with the outputs to encode them as."""

    outputs: tuple[RequestedOutput, ...]
    answers: list[Answer]


async def run_request(runtime: ServingFacade, model: ModelInfo, request: InferRequest, *, priority: int | None,
                      timeout_ms: float | None, received_at: float | None,
                      placed: Callable[[], None] | None = None, traces: Sequence[Phases | None] | None = None) -> Ran:
    """Check the whole request against the queue (before any item is queued), make its payloads
    (off the event loop), submit them all and wait for every answer. `placed` is called once every
    item's submission has started (each takes its place in the queue in its first step); `traces`,
    one per item, records each item's phases."""
    runtime.precheck(model.name, priority=priority, timeout_ms=timeout_ms, received_at=received_at, items=request.items)
    sig = signature(model.accepts)
    outputs = select_outputs(request, sig)
    payloads = await asyncio.to_thread(to_payloads, request, model.name, sig)
    tasks = _start(runtime, model.name, payloads, priority, timeout_ms, received_at, traces)
    if placed is not None:
        placed()
    return Ran(outputs, await _answers(tasks))


async def submit_all(
    runtime: ServingFacade, model: str, payloads: Sequence[Payload], priority: int | None, timeout_ms: float | None,
    arrived: float | None,
) -> list[Answer]:
    """Submit every item at once so they share the queue and the batcher; answers in item order.

    The first failure (in item order) answers the request, and the remaining items are cancelled."""
    return await _answers(_start(runtime, model, payloads, priority, timeout_ms, arrived))


def _start(runtime: ServingFacade, model: str, payloads: Sequence[Payload], priority: int | None,
           timeout_ms: float | None, arrived: float | None,
           traces: Sequence[Phases | None] | None = None) -> list[asyncio.Future[Answer]]:
    base = request_id_var.get() or uuid.uuid4().hex
    ids = [base] if len(payloads) == 1 else [f"{base}.{i}" for i in range(len(payloads))]
    return [
        asyncio.ensure_future(runtime.submit(model, p, priority=priority, timeout_ms=timeout_ms, request_id=rid,
                                            received_at=arrived, trace=traces[index] if traces else None))
        for index, (p, rid) in enumerate(zip(payloads, ids, strict=True))
    ]


async def _answers(tasks: list[asyncio.Future[Answer]]) -> list[Answer]:
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
