"""The request message of every call that takes one message (unary calls, and server-streaming
ones such as health `Watch`), read here: within a time bound, and, for a call without an inference
key, in a bounded number of calls waiting at once.

grpcio hands a call to the server when its headers arrive and counts it against
`maximum_concurrent_rpcs` from then on, but reads a unary call's message itself, with no time
bound: a client that sends the headers and never the message holds a slot for as long as it
likes, and 100 of them, no key needed, refused every other call on a server of 64. So a server
interceptor serves each such method as its request-streaming twin (the same bytes on the wire) and
reads the one message here, then runs the method's own handler on it, as grpcio would have:

- a message that takes longer than `timeout_s` (the HTTP body timeout) ends the call with
  DEADLINE_EXCEEDED, as a body too slow is 408 over HTTP;
- calls without an inference key waiting for their message are at most `limit`; one more ends
  the longest-waiting one with RESOURCE_EXHAUSTED to make room, as the HTTP server closes its
  longest-idle connection (`router.http.connections`). A client that sends its message with its
  headers, a probe, is never the one waiting longest; refusing the new call instead would let
  stalled calls refuse every probe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from router.access import AccessPolicy
from router.grpc.streams import Reports

__all__ = ["MessageArrival"]

log = logging.getLogger("router.grpc")
Context = aio.ServicerContext[Any, Any]


class MessageArrival(aio.ServerInterceptor):  # type: ignore[misc]
    """Serve each method that takes one message through `read`, the rest unchanged."""

    def __init__(self, policy: AccessPolicy, *, limit: int, timeout_s: float) -> None:
        self.policy = policy
        self.limit = limit
        self.timeout_s = timeout_s
        self._waiting: OrderedDict[asyncio.Future[Any], None] = OrderedDict()  # reads without a key, oldest first
        self._stopped: dict[asyncio.Future[Any], str] = {}  # reads stopped, and why
        self.ended_for_room = Reports()

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        serialization = {"request_deserializer": handler.request_deserializer,
                         "response_serializer": handler.response_serializer}
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(self._streamed(handler.unary_stream), **serialization)
        return grpc.stream_unary_rpc_method_handler(self._unary(handler.unary_unary), **serialization)

    def _unary(self, method: Callable[[Any, Context], Awaitable[Any]]) -> Callable[[Any, Context], Awaitable[Any]]:
        async def unary(_requests: Any, context: Context) -> Any:
            return await method(await self.read(context), context)

        return unary

    def _streamed(self, method: Callable[[Any, Context], AsyncIterator[Any]]) -> Callable[[Any, Context], AsyncIterator[Any]]:
        async def streamed(_requests: Any, context: Context) -> AsyncIterator[Any]:
            async for response in method(await self.read(context), context):
                yield response

        return streamed

    async def read(self, context: Context) -> Any:
        """The call's one request message; the call ended instead when it is too slow or makes room."""
        authorization = tuple(v for k, v in (context.invocation_metadata() or ()) if k == "authorization")
        reading = asyncio.ensure_future(context.read())
        timer = asyncio.get_running_loop().call_later(self.timeout_s, self._stop, reading, "timeout")
        if not self.policy.holds_key(authorization):
            self._wait(reading)
        try:
            message = await reading
        except asyncio.CancelledError:
            if (why := self._stopped.pop(reading, None)) is None:
                raise  # the call itself was cancelled: the client left
            await self._end(context, why == "room")
        finally:
            timer.cancel()
            self._waiting.pop(reading, None)
            self._stopped.pop(reading, None)
        if message is aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended before its request message")
        return message

    def _stop(self, reading: asyncio.Future[Any], why: str) -> None:
        """Stop waiting for a message (`why`: 'room' or 'timeout'); `read` ends the call."""
        if not reading.done():
            self._stopped[reading] = why
            reading.cancel()

    async def _end(self, context: Context, for_room: bool) -> None:
        """End a call whose message has not arrived: it made room for another, or took too long."""
        if for_room:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"ended to make room: more than {self.limit} calls without an inference key were "
                                "waiting for their request message; send the message with the call, or the key")
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"the request message did not arrive within {self.timeout_s:g} s of the call")

    def _wait(self, reading: asyncio.Future[Any]) -> None:
        """Count a call waiting for its message; over the limit, end the longest-waiting one."""
        self._waiting[reading] = None
        if len(self._waiting) > self.limit:
            oldest, _ = self._waiting.popitem(last=False)
            self._stop(oldest, "room")
            self.ended_for_room.count += 1
            if (ended := self.ended_for_room.due(time.monotonic())) is not None:
                log.warning("%d gRPC call(s) without a key ended to make room: more than %d were waiting for "
                            "their request message", ended, self.limit, extra={"ended_for_room": ended})
