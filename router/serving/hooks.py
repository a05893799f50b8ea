"""Running plugins' host-side hooks (`preprocess`, `postprocess`): on the CPU pool, or on the event
loop itself once they have proven cheap.

Handing a call to a pool thread and back costs the event loop about 30 to 60 us here (a future, a
wake-up of the thread, a wake-up of the loop). A hook that costs a few microseconds (a JSON field, a
dict) is cheaper to run in place, and with one core busy with the loop the pool cannot run it
sooner anyway. So each model's hooks are timed (a decaying mean of their own duration, wherever
they ran), and a hook whose mean is under `INLINE_BELOW_S` runs inline; one that gets dearer goes
back to the pool at its next call. Image decoding (milliseconds) always stays on the pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from router.errors import DeadlineExceeded, ModelError, RouterError

__all__ = ["INLINE_BELOW_S", "HookCost", "HookRunner"]

log = logging.getLogger("router.serving.hooks")
T = TypeVar("T")
#: A hook whose calls average less than this runs on the event loop.
INLINE_BELOW_S = 50e-6
#: Calls timed on the pool before a hook may run inline.
INLINE_AFTER_CALLS = 8


class HookCost:
    """One hook's duration: a decaying mean (a tenth of each new call), and how many calls it has seen."""

    __slots__ = ("calls", "mean_s")

    def __init__(self) -> None:
        self.calls = 0
        self.mean_s = 0.0

    def observe(self, seconds: float) -> None:
        self.mean_s = seconds if self.calls == 0 else self.mean_s + 0.1 * (seconds - self.mean_s)
        self.calls += 1

    @property
    def inline(self) -> bool:
        return self.calls >= INLINE_AFTER_CALLS and self.mean_s < INLINE_BELOW_S


class HookRunner:
    """The CPU pool, and where each (model, hook) runs."""

    def __init__(self, workers: int, *, name: str = "router-cpu", clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix=name)
        self._costs: dict[tuple[str, str], HookCost] = {}
        self._clock = clock

    def cost(self, model: str, hook: str) -> HookCost:
        key = (model, hook)
        cost = self._costs.get(key)
        if cost is None:
            cost = self._costs[key] = HookCost()
        return cost

    async def run(self, model: str, plugin: str, hook: str, fn: Callable[..., T], *args: Any,
                  deadline: float | None = None) -> T:
        """Run a plugin hook. Its RouterErrors (InputError...) answer the request; anything else is
        the plugin's bug: 500, logged once naming plugin, hook and exception. With `deadline`
        (on the runner's clock), a call still waiting for the pool then answers 504."""
        cost = self.cost(model, hook)
        try:
            if cost.inline:
                return _timed(cost, fn, *args)
            work = self._on_pool(cost, fn, *args)
            if deadline is None:
                return await work
            try:
                return await asyncio.wait_for(work, max(0.0, deadline - self._clock()))
            except TimeoutError:
                raise DeadlineExceeded(f"deadline passed while preparing the input for model {model!r}") from None
        except RouterError:
            raise
        except Exception as exc:
            log.error("model %s: plugin %s raised in %s: %s: %s", model, plugin, hook, type(exc).__name__, exc,
                      exc_info=exc, extra={"model": model, "plugin": plugin, "hook": hook})
            raise ModelError(f"model {model!r}: plugin {plugin!r} failed in {hook}: {type(exc).__name__}: {exc}") from None

    async def _on_pool(self, cost: HookCost, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on the pool. Work whose request was answered (deadline, client gone) before a pool
        thread picked it up is skipped, not run for nobody."""
        abandoned = [False]  # a flag, not a threading.Event: set on the loop, read once by the pool thread

        def unless_abandoned() -> T:
            if abandoned[0]:
                raise asyncio.CancelledError
            return _timed(cost, fn, *args)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, unless_abandoned)
        except BaseException:
            abandoned[0] = True
            raise

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _timed(cost: HookCost, fn: Callable[..., T], *args: Any) -> T:
    started = time.perf_counter()
    try:
        return fn(*args)
    finally:
        cost.observe(time.perf_counter() - started)
