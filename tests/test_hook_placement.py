"""Where a plugin's hooks run: on the event loop when they are cheap there, else on a pool.

A pool thread's timing counts its waits for the GIL, so it only says whether a hook is worth
trying on the loop; its timings on the loop decide whether it stays there.
"""

from __future__ import annotations

import asyncio
import threading
import time

from router.serving.hooks import (
    INLINE_AFTER_CALLS,
    INLINE_BELOW_S,
    RETRY_INLINE_EVERY,
    TRY_INLINE_BELOW_S,
    HookCost,
    HookRunner,
)


def _pooled(cost: HookCost, seconds: float, calls: int) -> None:
    for _ in range(calls):
        assert not cost.inline
        cost.observe(seconds, inline=False)


def test_a_hook_slower_on_its_pool_than_the_threshold_is_tried_on_the_loop_and_stays_if_cheap_there() -> None:
    cost = HookCost()
    # 120 us on a pool (a short parse waiting for the GIL): over INLINE_BELOW_S, under the try threshold
    assert INLINE_BELOW_S < 120e-6 < TRY_INLINE_BELOW_S
    _pooled(cost, 120e-6, INLINE_AFTER_CALLS)
    assert cost.inline
    for _ in range(1000):
        cost.observe(20e-6, inline=True)
        assert cost.inline


def test_a_hook_not_yet_timed_on_its_pool_runs_there() -> None:
    cost = HookCost()
    _pooled(cost, 1e-6, INLINE_AFTER_CALLS)
    assert cost.inline


def test_a_dear_hook_is_never_tried_on_the_loop() -> None:
    cost = HookCost()
    _pooled(cost, 2e-3, 10 * RETRY_INLINE_EVERY)  # image decoding: milliseconds


def test_a_hook_that_gets_dear_on_the_loop_goes_back_to_its_pool_and_is_tried_again_later() -> None:
    cost = HookCost()
    _pooled(cost, 60e-6, INLINE_AFTER_CALLS)
    for _ in range(20):
        cost.observe(20e-6, inline=True)
    cost.observe(5e-3, inline=True)  # a call that costs the loop 5 ms: back to the pool at once
    assert not cost.inline
    _pooled(cost, 60e-6, RETRY_INLINE_EVERY)
    assert cost.inline  # tried once more; one try decides, whatever the pause before it was
    cost.observe(20e-6, inline=True)
    assert cost.inline


def test_a_hook_dear_on_the_loop_is_tried_there_once_per_retry_period() -> None:
    cost = HookCost()
    _pooled(cost, 60e-6, INLINE_AFTER_CALLS)
    tries = 0
    for _ in range(4 * RETRY_INLINE_EVERY):
        if cost.inline:
            tries += 1
            cost.observe(400e-6, inline=True)
        else:
            cost.observe(60e-6, inline=False)
    assert tries == 4


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
