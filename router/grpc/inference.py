"""ModelInfer and ModelStreamInfer: a request (or one frame of a stream) through the same path as
V2 over HTTP: the decode (off the event loop), the whole request screened against the queue once,
every item submitted at once with that screen (`router.inference_protocol.submission`).

A stream's frames are each admitted, batched and bounded like a unary request; they enter the
model's queue in the order they were sent (their decoding overlaps only with earlier frames' model
time) and are answered in that order, each as soon as it and the frames before it are done. Back-pressure: at most
`frames_in_flight` frames of one stream are unanswered at once; past that the server stops reading
the stream, and HTTP/2 flow control holds the client's writes. A frame the model cannot take (its
queue full, its deadline out of reach, the server draining) gets an error response in the stream,
as Triton's stream answers, with the retry hint in the message, and the stream stays open.

A pipeline's name is a model here as over HTTP (`router.inference_protocol.targets`): its items go
to the pipeline's runner. Traced, a request (each frame of a stream) has the phases of V2 over
HTTP: receive, decode, then the runtime's (or "items", each item's side by side; or the
pipeline's), respond. A frame's answer names its span in its `traceparent` parameter: a stream
has one metadata for all its frames.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

from grpc import aio

from router.access import AccessPolicy
from router.grpc.calls import Call, access_line, end_span, parse, refusal_of, serving, start_span, trace_metadata
from router.grpc.codec import decode_request, encode_response
from router.grpc.protos import grpc_service_pb2 as pb
from router.inference_protocol.request import router_priority
from router.inference_protocol.shared_memory import Caller, SharedMemoryRegistry
from router.inference_protocol.submission import is_small, item_traces, off_loop, run_request
from router.inference_protocol.targets import Pipelines, find_target, served_version
from router.serving.facade import Serving
from router.tracing.api import Tracing

__all__ = ["Inference", "answer_in_order", "shared_memory_caller"]

log = logging.getLogger("router.grpc")


def shared_memory_caller(registry: SharedMemoryRegistry, policy: AccessPolicy, call: Call) -> Caller:
    """The call's client as shared memory knows it: its peer address and the key it presented."""
    holder = policy.holder(call.authorization)
    return registry.caller(call.peer, holder.id, holder.admin)


class Inference:
    """The inference calls of one gRPC server, on the serving façade."""

    def __init__(self, runtime: Serving, pipelines: Pipelines, shared_memory: SharedMemoryRegistry,
                 policy: AccessPolicy, *, max_message_bytes: int, max_items: int, frames_in_flight: int,
                 tracing: Tracing | None = None) -> None:
        self.runtime = runtime
        self.pipelines = pipelines
        self.tracing = tracing
        self.shared_memory = shared_memory
        self.policy = policy
        self.max_message_bytes = max_message_bytes
        self.max_items = max_items
        self.frames_in_flight = frames_in_flight

    async def infer(self, message: Any, call: Call, in_order: asyncio.Lock | None = None) -> Any:
        """One ModelInfer request (or stream frame): its answer, or a RouterError for the caller to map.
        `in_order` (a stream's) is held from the start until the request has its place in the queue:
        taken without a pause before it, so frames take it, and their places, in the order they came."""
        if in_order is not None:
            await in_order.acquire()

        def placed() -> None:
            if in_order is not None and in_order.locked():
                in_order.release()

        try:
            return await self._infer(message, call, placed)
        finally:
            placed()

    async def _infer(self, message: Any, call: Call, placed: Callable[[], None]) -> Any:
        name = message.model_name
        trace = call.trace.phases() if call.trace is not None else None
        if trace is not None:
            trace.enter("receive", call.received_at)
        target = find_target(self.runtime, self.pipelines, name, message.model_version)
        regions = self.shared_memory.for_client(shared_memory_caller(self.shared_memory, self.policy, call),
                                                self.max_message_bytes)
        model = target.inputs
        max_items = min(self.max_items, model.queue_capacity)
        if trace is not None:
            trace.enter("decode", time.monotonic())
        small = is_small(message.ByteSize(), any("shared_memory_region" in t.parameters for t in message.inputs))
        decoded = await off_loop(small, partial(decode_request, message, max_items=max_items, regions=regions))
        priority = router_priority(decoded.priority, model.priority_levels) if decoded.priority else call.priority
        call.access.update(model=name, input_bytes=message.ByteSize() + regions.bytes_read, items=decoded.items)
        traces = None if trace is None or call.trace is None else item_traces(call.trace, trace, decoded.items)
        ran = await run_request(target.entry, model, decoded, priority=priority,
                                timeout_ms=call.timeout_ms(decoded.timeout_ms), received_at=call.received_at,
                                placed=placed, traces=traces, small=small)
        if trace is not None:
            trace.enter("respond")  # from the answers
        return encode_response(name, decoded, ran.outputs, [answer.output for answer in ran.answers], regions,
                               version=served_version(ran.answers))

    async def stream(self, frames: AsyncIterator[Any], context: aio.ServicerContext[Any, Any],
                     call: Call) -> AsyncIterator[Any]:
        """ModelStreamInfer: each frame's answer (or its error) in the order the frames came."""
        in_order = asyncio.Lock()  # frames enter the model's queue in the order they came

        async def answer(frame: Any, seq: int) -> Any:
            remaining = context.time_remaining()
            frame_call = dataclasses.replace(
                call, request_id=f"{call.request_id}.{seq}", received_at=time.monotonic(), access={},
                deadline_ms=None if remaining is None else max(0.0, remaining * 1000.0))
            frame_call.trace = start_span(self.tracing, frame_call)
            return await self._frame(frame, frame_call, in_order)

        async for response in answer_in_order(frames, answer, self.frames_in_flight):
            yield response

    async def _frame(self, raw: bytes, call: Call, in_order: asyncio.Lock) -> Any:
        """One frame's ModelStreamInferResponse: its answer, or its error with the stream kept open."""
        started = time.perf_counter()
        status, code, error = 200, "OK", None
        frame = pb.ModelInferRequest()
        with serving(call):
            try:
                frame = parse(pb.ModelInferRequest, raw)
                return _traced(pb.ModelStreamInferResponse(infer_response=await self.infer(frame, call, in_order)), call)
            except Exception as exc:  # the frame's fault boundary: its error answers it, the stream goes on
                refusal, error = refusal_of(exc), exc
                if refusal is None:
                    log.error("unhandled error in a stream frame", exc_info=exc)
                    status, code, message = 500, "INTERNAL", "internal server error"
                else:
                    status, code, message = refusal.status, refusal.code.name, refusal.details
                    retry = dict(refusal.trailing).get("retry-after")
                    if retry is not None:
                        message += f" (retry after {retry} s)"
                return _traced(pb.ModelStreamInferResponse(
                    error_message=message, infer_response=pb.ModelInferResponse(model_name=frame.model_name, id=frame.id)),
                    call)
            except BaseException as exc:
                status, code, error = 499, "CANCELLED", exc
                raise
            finally:
                access_line(call, status, code, time.perf_counter() - started)
                end_span(call, status, error)


def _traced(response: Any, call: Call) -> Any:
    """A frame's response with its span's `traceparent` (and `tracestate`) as parameters of its answer."""
    for name, value in trace_metadata(call):
        response.infer_response.parameters[name].string_param = value
    return response


async def answer_in_order(frames: AsyncIterator[Any], answer: Callable[[Any, int], Awaitable[Any]],
                          limit: int) -> AsyncIterator[Any]:
    """Answer each frame concurrently, yield the answers in the frames' order, and read a frame only
    while fewer than `limit` are unanswered (or answered but not yet yielded). Every frame's task is
    awaited or cancelled on every path: the stream's end, its error, its cancellation."""
    slots = asyncio.Semaphore(limit)
    pending: asyncio.Queue[asyncio.Future[Any] | None] = asyncio.Queue()

    async def read() -> None:
        seq = 0
        try:
            while True:
                await slots.acquire()
                try:
                    frame = await anext(frames)
                except StopAsyncIteration:
                    return
                pending.put_nowait(asyncio.ensure_future(answer(frame, seq)))
                seq += 1
        finally:
            pending.put_nowait(None)

    reader = asyncio.ensure_future(read())
    current: asyncio.Future[Any] | None = None
    try:
        while (current := await pending.get()) is not None:
            yield await current
            current = None
            slots.release()
        await reader  # a failed read (a frame over the size limit, a broken stream) fails the stream
    finally:
        reader.cancel()
        left = [reader] if current is None else [reader, current]
        if current is not None:
            current.cancel()
        while not pending.empty():
            if (task := pending.get_nowait()) is not None:
                task.cancel()
                left.append(task)
        await asyncio.gather(*left, return_exceptions=True)
