"""An event loop whose clock is virtual: time passes only when nothing can run.

`VirtualClockLoop.time()` starts at 0 and moves only when every task waits on a timer (a sleep, a
timeout, a deadline, a batching delay) and no thread is working for the loop: it then jumps to the
next timer. A test of timing logic is exact and takes no real time, on a busy machine as on an
idle one. Give the code under test `loop.time` as its clock (`in_process(plan, clock=loop.time)`).

Threads: work handed to the loop's `run_in_executor` (the runtime's CPU pool, each instance's
thread) holds the clock still until it returns, except while it waits in `thread_sleep`, which
passes virtual time: `run_virtual` puts it under the scripted plugin, so a batch of the scripted
plugin costs its `fixed_ms + per_item_ms * n` of virtual time. Work queued behind a sleeping job
on a full executor does not hold the clock (it cannot start until the sleeper's time passes).
Thread work that never returns is reported after `stuck_after_s` of real time, not left to hang.
"""

from __future__ import annotations

import asyncio
import selectors
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from typing import Any, TypeVar

from router_testkit import scripted

__all__ = ["VirtualClockLoop", "VirtualClockStuck", "run_virtual"]

T = TypeVar("T")


class VirtualClockStuck(RuntimeError):
    """Thread work held the virtual clock still for longer than the loop allows."""


class _Job:
    """One call handed to an executor: its state, as the clock needs to know it."""

    __slots__ = ("executor", "finished", "orphaned", "sleeping", "started")

    def __init__(self, executor: Executor | None) -> None:
        self.executor = executor
        self.started = False  # a worker thread picked it up (set by that thread)
        self.finished = False  # the call returned or raised (set by that thread)
        self.sleeping = False  # waiting in thread_sleep (set on the loop)
        self.orphaned = False  # its future was cancelled while the call ran


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self, stuck_after_s: float = 30.0) -> None:
        self._now = 0.0
        self.stuck_after_s = stuck_after_s
        self._lock = threading.Lock()
        self._jobs: set[_Job] = set()
        self._wakers: set[threading.Event] = set()
        self._current = threading.local()
        super().__init__(_VirtualSelector(self))

    def time(self) -> float:
        return self._now

    def run_in_executor(self, executor: Any, func: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        job = _Job(executor)

        def run() -> T:
            with self._lock:
                job.started = True
            self._current.job = job
            try:
                return func(*args)
            finally:
                self._current.job = None
                self._finished(job)

        with self._lock:
            self._jobs.add(job)
        try:
            future = super().run_in_executor(executor, run)
        except BaseException:
            self._finished(job)
            raise
        future.add_done_callback(lambda done: self._answered(job, done))
        return future

    def _answered(self, job: _Job, future: asyncio.Future[Any]) -> None:
        """The job's result reached the loop: it no longer holds the clock, unless it was cancelled
        while its thread still runs (then it holds it until that thread returns)."""
        with self._lock:
            if future.cancelled() and job.started and not job.finished:
                job.orphaned = True
            else:
                self._jobs.discard(job)

    def _finished(self, job: _Job) -> None:
        with self._lock:
            job.finished = True
            orphaned = job.orphaned or not job.started
            if orphaned:
                self._jobs.discard(job)
        if orphaned and not self.is_closed():
            try:
                self.call_soon_threadsafe(_nothing)  # no result will wake the loop: this does
            except RuntimeError:
                pass

    def thread_sleep(self, seconds: float) -> None:
        """Sleep `seconds` of virtual time, from a thread running loop work (else real time)."""
        job: _Job | None = getattr(self._current, "job", None)
        if job is None or self.is_closed():
            time.sleep(seconds)
            return
        woken = threading.Event()

        def arm() -> None:  # on the loop: from now on this job does not hold the clock
            job.sleeping = True
            self.call_later(seconds, wake)

        def wake() -> None:
            job.sleeping = False
            woken.set()

        with self._lock:
            self._wakers.add(woken)
        try:
            self.call_soon_threadsafe(arm)
        except RuntimeError:  # closed meanwhile
            return
        woken.wait()
        with self._lock:
            self._wakers.discard(woken)

    def close(self) -> None:
        with self._lock:
            wakers = list(self._wakers)
        for woken in wakers:  # no thread waits for a time that will never come
            woken.set()
        super().close()

    def holding_the_clock(self) -> list[str]:
        """The thread work that keeps time from passing now: started and not sleeping, or queued
        on an executor with a thread free of sleepers."""
        with self._lock:
            jobs = list(self._jobs)
        asleep: dict[int, int] = {}
        for job in jobs:
            if job.sleeping:
                asleep[id(job.executor)] = asleep.get(id(job.executor), 0) + 1
        holding = []
        for job in jobs:
            if job.sleeping:
                continue
            if job.started or asleep.get(id(job.executor), 0) < _threads(job.executor):
                holding.append(f"{'running' if job.started else 'queued'} on {job.executor!r}")
        return holding


def _nothing() -> None:
    pass


def _threads(executor: Executor | None) -> int:
    """How many jobs an executor runs at once (the default executor: as many as it likes)."""
    return int(getattr(executor, "_max_workers", 1_000_000))


class _VirtualSelector(selectors.BaseSelector):
    """A real selector for I/O, whose waits move the loop's virtual clock instead of sleeping."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        self._loop = loop
        self._real = selectors.DefaultSelector()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:
            return self._real.select(0)
        if self._loop.holding_the_clock():
            # Thread work answers through the loop's self-pipe, which ends this wait.
            events = self._real.select(self._loop.stuck_after_s)
            holding = self._loop.holding_the_clock()
            if not events and holding:
                raise VirtualClockStuck(f"thread work held the virtual clock for {self._loop.stuck_after_s} s "
                                        f"of real time: {holding}")
            return events
        if timeout is None:
            return self._real.select(None)  # no timer: only I/O can wake the loop
        self._loop._now += timeout
        return self._real.select(0)

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def close(self) -> None:
        self._real.close()

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()


def run_virtual(main: Callable[[VirtualClockLoop], Awaitable[T]], *, stuck_after_s: float = 30.0) -> T:
    """Run `main(loop)` on a fresh virtual-clock loop, with the scripted plugin's costs in its time."""
    previous = scripted.sleep, scripted.clock
    with asyncio.Runner(loop_factory=lambda: VirtualClockLoop(stuck_after_s)) as runner:
        loop = runner.get_loop()
        assert isinstance(loop, VirtualClockLoop)
        scripted.sleep, scripted.clock = loop.thread_sleep, loop.time
        try:
            return runner.run(_awaited(main(loop)))
        finally:
            scripted.sleep, scripted.clock = previous


async def _awaited(work: Awaitable[T]) -> T:
    return await work
