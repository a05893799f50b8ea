"""Where a plugin's hooks and a CPU instance's batches run: on the event loop when they are cheap
there, else on their thread.

A thread's timing says whether a call is worth trying on the loop; its timings on the loop, against
its thread's plus the hand-off, decide whether it stays there.
"""

from __future__ import annotations

import asyncio
import threading
import time

from router.serving.hooks import (
    HAND_OFF_S,
    INLINE_AFTER_CALLS,
    INLINE_BELOW_S,
    RETRY_INLINE_EVERY,
    TRIAL_CALLS,
    TRY_ENDS_ABOVE_S,
    TRY_INLINE_BELOW_S,
    CallCost,
    HookRunner,
)


def _pooled(cost: CallCost, seconds: float, calls: int) -> None:
    for _ in range(calls):
        assert not cost.inline
        cost.observe(seconds, inline=False)


def test_a_hook_slower_on_its_pool_than_the_threshold_is_tried_on_the_loop_and_stays_if_cheap_there() -> None:
    cost = CallCost()
    # 120 us on a pool (a short parse waiting for the GIL): under the try threshold
    assert 120e-6 < TRY_INLINE_BELOW_S
    _pooled(cost, 120e-6, INLINE_AFTER_CALLS)
    assert cost.inline
    for _ in range(1000):
        cost.observe(20e-6, inline=True)
        assert cost.inline


def test_a_hook_not_yet_timed_on_its_pool_runs_there() -> None:
    cost = CallCost()
    _pooled(cost, 1e-6, INLINE_AFTER_CALLS)
    assert cost.inline


def test_a_dear_hook_is_never_tried_on_the_loop() -> None:
    cost = CallCost()
    _pooled(cost, 2e-3, 10 * RETRY_INLINE_EVERY)  # image decoding: milliseconds


def test_a_hook_that_gets_dear_on_the_loop_goes_back_to_its_pool_and_is_tried_again_later() -> None:
    cost = CallCost()
    _pooled(cost, 60e-6, INLINE_AFTER_CALLS)
    for _ in range(20):
        cost.observe(20e-6, inline=True)
    cost.observe(5e-3, inline=True)  # a call that costs the loop 5 ms: back to the pool at once
    assert not cost.inline
    _pooled(cost, 60e-6, RETRY_INLINE_EVERY)
    assert cost.inline  # tried once more: the try's own calls decide, whatever the pause before it was
    cost.observe(20e-6, inline=True)
    assert cost.inline


def test_a_hook_dear_on_the_loop_is_tried_there_once_per_retry_period() -> None:
    cost = CallCost()
    _pooled(cost, 60e-6, INLINE_AFTER_CALLS)
    on_loop = 0
    for _ in range(4 * RETRY_INLINE_EVERY):
        if cost.inline:
            on_loop += 1
            cost.observe(400e-6, inline=True)
        else:
            cost.observe(60e-6, inline=False)
    assert on_loop == 4 * TRIAL_CALLS  # four tries of TRIAL_CALLS calls each


def test_a_call_dearer_than_a_millisecond_ends_its_try_at_once() -> None:
    cost = CallCost()
    _pooled(cost, 60e-6, INLINE_AFTER_CALLS)
    assert cost.inline
    cost.observe(TRY_ENDS_ABOVE_S * 2, inline=True)
    assert not cost.inline


async def test_the_runner_runs_a_cheap_hook_on_the_loop_and_a_dear_one_on_its_pool() -> None:
    runner = HookRunner(2, name="placement")
    loop_thread = threading.get_ident()
    where: dict[str, list[bool]] = {"cheap": [], "dear": []}

    class Plugin:
        def preprocess(self, kind: str) -> str:
            if kind == "dear":
                time.sleep(2e-3)
            where[kind].append(threading.get_ident() == loop_thread)
            return kind

    try:
        for _ in range(200):
            assert await runner.run("m", "p", Plugin(), "preprocess", "cheap") == "cheap"
            assert await runner.run("d", "p", Plugin(), "preprocess", "dear") == "dear"
            await asyncio.sleep(0)
    finally:
        runner.shutdown()
    assert not any(where["cheap"][:INLINE_AFTER_CALLS])  # timed on the pool first
    assert where["cheap"][-1] and sum(where["cheap"]) > 100
    assert not any(where["dear"])


def test_a_try_on_the_loop_is_judged_by_its_calls_not_its_first() -> None:
    cost = CallCost()
    _pooled(cost, 80e-6, INLINE_AFTER_CALLS)
    cost.observe(200e-6, inline=True)  # the first call on the loop: the other thread's caches
    assert cost.inline  # the try goes on
    for _ in range(TRIAL_CALLS - 1):
        cost.observe(40e-6, inline=True)
    assert cost.inline  # its mean, 60 us, is under 80 us on the thread plus the hand-off


def test_a_call_that_costs_the_loop_more_than_the_thread_and_the_hand_off_goes_back_after_its_try() -> None:
    cost = CallCost()
    _pooled(cost, 80e-6, INLINE_AFTER_CALLS)
    seconds = 80e-6 + HAND_OFF_S + 20e-6  # under the cap, over the thread's mean and the hand-off
    assert INLINE_BELOW_S < seconds < TRY_INLINE_BELOW_S
    for _ in range(TRIAL_CALLS):
        assert cost.inline
        cost.observe(seconds, inline=True)
    assert not cost.inline
    _pooled(cost, 80e-6, RETRY_INLINE_EVERY - 1)
    cost.observe(80e-6, inline=False)
    assert cost.inline  # tried again after the retry period


def test_a_call_under_its_threads_mean_plus_the_hand_off_and_under_the_cap_stays_on_the_loop() -> None:
    cost = CallCost()
    _pooled(cost, 200e-6, INLINE_AFTER_CALLS)  # a thread that waits for the GIL under load
    for _ in range(1000):
        cost.observe(240e-6, inline=True)  # dear, but under the thread's mean plus the hand-off and the cap
        assert cost.inline
    cost.observe(5e-3, inline=True)  # then a call dearer than the cap pulls its mean over it
    assert not cost.inline


def test_a_call_under_a_tenth_of_a_millisecond_on_the_loop_stays_there_however_cheap_on_its_thread() -> None:
    cost = CallCost()
    _pooled(cost, 4e-6, INLINE_AFTER_CALLS)  # a JSON field: a few microseconds on its thread
    for _ in range(TRIAL_CALLS):
        cost.observe(INLINE_BELOW_S * 0.9, inline=True)  # a garbage collection's share, say
    assert cost.inline  # over the thread's mean plus the hand-off, under INLINE_BELOW_S
    cost.observe(INLINE_BELOW_S * 3, inline=True)
    assert not cost.inline  # its mean went over both
