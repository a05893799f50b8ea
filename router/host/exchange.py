"""A front's open exchanges with the engine: each Submit waiting for its one Reply, each admin Call
for its CallReply, and the request arena's regions they hold.

At a request's deadline the engine is told (`Cancel`, expired: it withdraws a queued request and
answers 504 itself); past the deadline, the model's execution timeout and a grace, the front
stops waiting for an engine that does not answer. The engine gone: every open exchange is
answered at once with `EngineUnavailable`, and the arena's regions are all free again.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

from router.errors import DeadlineExceeded, EngineUnavailable
from router.host.arena import Arena
from router.host.messages import Call, CallReply, Cancel, Packed, Release, Reply, Submit
from router.host.stream import EngineStream
from router.serving.verbs import AdminVerb

__all__ = ["ENGINE_GONE", "GRACE_S", "Exchanges", "engine_gone", "engine_silent"]

#: After a request's deadline the engine answers at once, or when its running batch ends: past that
#: and this grace the front gives up on it (an engine that hangs).
GRACE_S = 2.0
ENGINE_GONE = "the engine process is restarting; retry shortly"


def engine_gone() -> EngineUnavailable:
    return EngineUnavailable(ENGINE_GONE, retry_after_s=2.0)


def engine_silent(silent_s: float) -> EngineUnavailable:
    """The engine is connected but has published nothing for `silent_s` (stopped, or its loop stuck)."""
    return EngineUnavailable(f"the engine process has not answered for {silent_s:.1f} s; retry shortly",
                             retry_after_s=2.0)


class _Waiting:
    """A request sent to the engine, until its reply."""

    __slots__ = ("expired", "future", "offsets", "timer")

    def __init__(self, future: asyncio.Future[Reply], offsets: list[int]) -> None:
        self.future, self.offsets = future, offsets
        self.timer: asyncio.TimerHandle | None = None
        self.expired = False


class Exchanges:
    """The exchanges of one front over its current stream to the engine (None while there is none)."""

    def __init__(self, arena: Arena, clock: Callable[[], float] = time.monotonic) -> None:
        self.arena = arena
        self.clock = clock
        self.stream: EngineStream | None = None
        self._waiting: dict[int, _Waiting] = {}
        self._calls: dict[int, asyncio.Future[CallReply]] = {}
        self._ids = itertools.count(1)

    @property
    def open(self) -> int:
        return len(self._waiting)

    def number(self) -> int:
        return next(self._ids)

    async def submit(self, submit: Submit, offsets: list[int], deadline: float, grace_s: float) -> Reply:
        """Send a Submit holding the regions at `offsets`, and wait for its Reply (its failure raised)."""
        stream = self.stream
        if stream is None:
            for offset in offsets:
                self.arena.free(offset)
            raise engine_gone()
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        entry = _Waiting(future, offsets)
        self._waiting[submit.id] = entry
        stream.send(submit)
        entry.timer = asyncio.get_running_loop().call_later(max(0.0, deadline - self.clock()), self._expire,
                                                            submit.id, grace_s)
        try:
            reply = await future
        except asyncio.CancelledError:
            if submit.id in self._waiting and self.stream is not None:
                self.stream.send(Cancel(submit.id, False))  # the reply still comes, and frees the regions
            raise
        if reply.failure is not None:
            raise reply.failure.error()
        return reply

    def _expire(self, number: int, grace_s: float) -> None:
        entry = self._waiting.get(number)
        if entry is None or self.stream is None:
            return
        if not entry.expired:
            entry.expired = True
            self.stream.send(Cancel(number, True))
            entry.timer = asyncio.get_running_loop().call_later(grace_s, self._expire, number, grace_s)
        elif not entry.future.done():  # an engine that does not answer: give up on it (the reply may still come)
            entry.future.set_exception(DeadlineExceeded("the engine did not answer within the deadline and the "
                                                        "model's execution timeout"))

    def on_reply(self, reply: Reply) -> None:
        entry = self._waiting.pop(reply.id, None)
        if entry is None:
            return
        for offset in entry.offsets:  # the engine no longer reads them
            self.arena.free(offset)
        if entry.timer is not None:
            entry.timer.cancel()
        if not entry.future.done():
            entry.future.set_result(reply)
        elif reply.output is not None:
            self.release(reply.output)  # nobody waits for it any more

    def release(self, packed: Packed) -> None:
        """Tell the engine it may reuse the answer arena's regions of `packed`."""
        if self.stream is not None and packed.regions:
            self.stream.send(Release(tuple(offset for offset, _ in packed.regions)))

    async def call(self, verb: AdminVerb) -> CallReply:
        stream = self.stream
        if stream is None:
            raise engine_gone()
        number = self.number()
        future: asyncio.Future[CallReply] = asyncio.get_running_loop().create_future()
        self._calls[number] = future
        stream.send(Call(number, verb))
        return await future

    def on_call_reply(self, reply: CallReply) -> None:
        future = self._calls.pop(reply.id, None)
        if future is not None and not future.done():
            future.set_result(reply)

    def cancel_all(self, error: Exception) -> None:
        """Answer every open request with `error` and tell the engine to drop them (a drain's end)."""
        for number, entry in list(self._waiting.items()):
            if not entry.future.done():
                entry.future.set_exception(error)
            if self.stream is not None:
                self.stream.send(Cancel(number, False))

    def lost(self) -> None:
        """The engine is gone: everything open answers 503 at once; its regions are all ours again."""
        self.stream = None
        waiting, self._waiting = self._waiting, {}
        for entry in waiting.values():
            if entry.timer is not None:
                entry.timer.cancel()
            if not entry.future.done():
                entry.future.set_exception(engine_gone())
        calls, self._calls = self._calls, {}
        for call in calls.values():
            if not call.done():
                call.set_exception(engine_gone())
        self.arena.reset()
