"""The virtual-clock loop the timing tests run on (tests/virtual_clock.py): time jumps to the next
timer when nothing can run, thread work holds it still, and `thread_sleep` waits in its time."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.virtual_clock import VirtualClockLoop, VirtualClockStuck, run_virtual


def test_a_sleep_of_an_hour_moves_the_clock_by_exactly_an_hour() -> None:
    async def main(loop: VirtualClockLoop) -> list[float]:
        seen = []
        for seconds in (3600, 0.25, 0.001):
            await asyncio.sleep(seconds)
            seen.append(loop.time())
        return seen

    assert run_virtual(main) == pytest.approx([3600, 3600.25, 3600.251])


def test_timeouts_fire_at_their_virtual_deadline() -> None:
    async def main(loop: VirtualClockLoop) -> float:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 30)
        return loop.time()

    assert run_virtual(main) == 30


def test_thread_work_holds_the_clock_until_it_returns() -> None:
    order: list[str] = []

    def work() -> None:
        time.sleep(0.05)  # real time: the clock must not move meanwhile
        order.append("thread done")

    async def main(loop: VirtualClockLoop) -> float:
        loop.call_later(0.001, order.append, "timer")
        with ThreadPoolExecutor(1) as pool:
            await loop.run_in_executor(pool, work)
        order.append(f"awaited at {loop.time()}")
        await asyncio.sleep(0.01)
        return loop.time()

    assert run_virtual(main) == pytest.approx(0.01)
    assert order == ["thread done", "awaited at 0.0", "timer"]


def test_thread_sleep_passes_virtual_time_and_lets_timers_run_meanwhile() -> None:
    order: list[str] = []

    async def main(loop: VirtualClockLoop) -> float:
        loop.call_later(2, order.append, "timer at 2")

        def work() -> None:
            loop.thread_sleep(5)
            order.append(f"thread woke at {loop.time()}")

        with ThreadPoolExecutor(1) as pool:
            await loop.run_in_executor(pool, work)
        return loop.time()

    assert run_virtual(main) == 5
    assert order == ["timer at 2", "thread woke at 5.0"]


def test_work_queued_behind_a_sleeper_does_not_hold_the_clock() -> None:
    async def main(loop: VirtualClockLoop) -> tuple[float, float]:
        with ThreadPoolExecutor(1) as pool:  # the second call waits for the first one's thread
            first = loop.run_in_executor(pool, loop.thread_sleep, 3)
            second = loop.run_in_executor(pool, loop.time)
            await first
            return await second, loop.time()

    assert run_virtual(main) == (3, 3)


def test_a_cancelled_call_holds_the_clock_until_its_thread_returns() -> None:
    order: list[str] = []
    running = threading.Event()

    def work() -> None:
        running.set()
        time.sleep(0.05)
        order.append("thread done")

    async def main(loop: VirtualClockLoop) -> None:
        with ThreadPoolExecutor(1) as pool:
            call = loop.run_in_executor(pool, work)
            while not running.is_set():
                await asyncio.sleep(0)
            call.cancel()
            await asyncio.sleep(0.001)
            order.append("slept")

    run_virtual(main)
    assert order == ["thread done", "slept"]


def test_thread_work_that_never_returns_is_reported() -> None:
    release = threading.Event()

    async def main(loop: VirtualClockLoop) -> None:
        pool = ThreadPoolExecutor(1)
        try:
            call = loop.run_in_executor(pool, release.wait)
            await asyncio.sleep(1)
            await call
        finally:
            release.set()
            pool.shutdown(wait=True)

    with pytest.raises(VirtualClockStuck, match="held the virtual clock for 0.2 s"):
        run_virtual(main, stuck_after_s=0.2)


def test_the_scripted_plugin_waits_in_virtual_time_only_inside_run_virtual() -> None:
    from router_testkit import scripted

    async def main(loop: VirtualClockLoop) -> object:
        return scripted.sleep

    inside = run_virtual(main)
    assert getattr(inside, "__self__", None).__class__ is VirtualClockLoop
    assert scripted.sleep is time.sleep and scripted.clock is time.monotonic
