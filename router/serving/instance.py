"""A model instance: one plugin object on one device, with a dedicated executor thread.

The instance runs one batch at a time, on its thread; on the CPU, a batch that costs the event
loop about what handing it to the thread and back would runs on the loop instead (the rule that
places hooks, `router.serving.hooks.CallCost`), unless its plugin says `predict_on_own_thread`. For every ticket it is handed it returns, in a
`BatchResult`, an output or a RouterError (model error 500, out-of-memory 503, execution
timeout 504); its scheduler resolves the tickets from it.

It is the one owner of its lifecycle: the state changes only through the transition methods
below, each checked against `TRANSITIONS` and logged once.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from router.errors import (
    BatchSizeMismatch,
    DeviceOutOfMemory,
    ExecutionTimeout,
    ModelError,
    ModelUnavailable,
)
from router.scheduling.queue import BatchResult, Ticket
from router.scheduling.service_time import BatchTime, InstanceLoad
from router.sdk.plugin import MemoryEstimate, ModelPlugin
from router.serving.hooks import CallCost

__all__ = ["InstanceState", "ModelInstance", "is_out_of_memory"]

log = logging.getLogger("router.serving.instance")
T = TypeVar("T")


class InstanceState(enum.Enum):
    PENDING = "pending"  # never loaded
    LOADING = "loading"
    WARMING = "warming"
    READY = "ready"
    FENCED = "fenced"  # a batch overran its execution timeout and still holds the thread
    DRAINING = "draining"  # takes no new batch; the running one finishes
    UNLOADING = "unloading"
    UNLOADED = "unloaded"
    FAILED = "failed"


_S = InstanceState
#: The allowed moves. Anything else is a bug, and raises.
TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    _S.PENDING: frozenset({_S.LOADING, _S.FAILED, _S.UNLOADED}),
    _S.LOADING: frozenset({_S.WARMING, _S.FAILED, _S.UNLOADING}),
    _S.WARMING: frozenset({_S.READY, _S.FAILED, _S.UNLOADING}),
    _S.READY: frozenset({_S.FENCED, _S.DRAINING, _S.UNLOADING, _S.FAILED}),  # failed: its process died
    _S.FENCED: frozenset({_S.READY, _S.DRAINING, _S.UNLOADING, _S.FAILED}),
    _S.DRAINING: frozenset({_S.READY, _S.UNLOADING}),
    _S.UNLOADING: frozenset({_S.UNLOADED, _S.FAILED}),
    _S.UNLOADED: frozenset({_S.LOADING, _S.UNLOADED}),
    _S.FAILED: frozenset({_S.LOADING, _S.UNLOADING, _S.UNLOADED}),
}
#: States in which the instance holds its model on the device.
LOADED_STATES = frozenset({_S.WARMING, _S.READY, _S.FENCED, _S.DRAINING})


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA or host out-of-memory, however the framework reports it."""
    if isinstance(exc, (DeviceOutOfMemory, MemoryError)):
        return True
    torch = sys.modules.get("torch")
    oom_type = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None) if torch else None
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


BatchObserver = Callable[[str, int, float], None]  # (model, batch size, seconds)


class ModelInstance:
    """Owns the plugin object and the thread that runs it. Only the device scheduler dispatches to it."""

    def __init__(
        self,
        model: str,
        index: int,
        device: str,
        plugin: ModelPlugin,  # type: ignore[type-arg]
        *,
        execution_timeout_s: float,
        on_batch: BatchObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        generation: int = 1,
    ) -> None:
        self.model = model
        self.index = index
        self.device = device
        self.plugin = plugin
        self.generation = generation
        self.key = f"{model}/{index}" if generation == 1 else f"{model}/{index}@{generation}"
        self.execution_timeout_s = execution_timeout_s
        self._state = InstanceState.PENDING
        self.error: str | None = None
        self.cause: BaseException | None = None  # what made it fail
        self.estimate: MemoryEstimate | None = None
        self.last_estimate: MemoryEstimate | None = None  # from the last load: sizes the next one
        self.max_batch = 1
        self.loaded_at: float | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.busy = False
        self.busy_until: float | None = None  # expected end of the running batch
        self.batches = 0
        self.times = BatchTime()  # batch execution time, learnt from warm-up and real batches
        self._clock = clock
        self._on_batch = on_batch
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"model-{self.key}")
        self._inflight: asyncio.Future[Any] | None = None
        # A CPU batch's cost on the loop and on the thread: one that is cheap on the loop runs there.
        self._batch_cost = CallCost() if device == "cpu" and not plugin.predict_on_own_thread else None
        self.changes = 0  # counts what its forecast depends on: state, running batch, timings
        self._uses = 0  # hooks running on its plugin (pre- and postprocessing), and answers not yet postprocessed
        self._unused = asyncio.Event()
        self._unused.set()

    @property
    def clock(self) -> Callable[[], float]:
        """The runtime's clock: it times this instance's loads and batches (warm-up ones included)."""
        return self._clock

    # -- lifecycle: the only writers of the state ---------------------------------------------

    @property
    def state(self) -> InstanceState:
        return self._state

    def _move(self, to: InstanceState, why: str = "") -> None:
        if to not in TRANSITIONS[self._state]:
            raise RuntimeError(f"instance {self.key}: no transition from {self._state.value} to {to.value}")
        self.changes += 1
        if to is not self._state:
            log.info("model %s instance %d: %s -> %s%s", self.model, self.index, self._state.value, to.value,
                     f" ({why})" if why else "", extra={"model": self.model})
        self._state = to

    def begin_load(self) -> None:
        self.error = None
        self._move(InstanceState.LOADING, f"on {self.device}")

    def begin_warmup(self) -> None:
        self._move(InstanceState.WARMING)

    def mark_ready(self, estimate: MemoryEstimate, max_batch: int) -> None:
        """Loaded and warmed, with the memory figures and batch cap this instance is held to."""
        self.estimate, self.last_estimate, self.max_batch = estimate, estimate, max_batch
        self.loaded_at = self._clock()
        self._move(InstanceState.READY)

    def fail(self, error: str, cause: BaseException | None = None) -> None:
        self.error, self.cause = error, cause
        self._move(InstanceState.FAILED, error)

    def lose(self, why: str) -> None:
        """Out of service for good: what ran the model is gone (its process died)."""
        self.estimate = None
        self.fail(why)

    def fence(self, why: str) -> None:
        """Out of service until its thread returns (a batch overran its execution timeout)."""
        self._move(InstanceState.FENCED, why)

    def recover(self) -> None:
        self._move(InstanceState.READY, "the stalled batch returned")

    def begin_drain(self) -> None:
        self._move(InstanceState.DRAINING)

    def resume(self) -> None:
        """A drain called off: back in service."""
        self._move(InstanceState.READY, "drain called off")

    def begin_unload(self) -> None:
        self._move(InstanceState.UNLOADING)

    def mark_unloaded(self) -> None:
        self.estimate = None
        self._move(InstanceState.UNLOADED)

    @property
    def loaded(self) -> bool:
        """Holds its model on the device (weights booked)."""
        return self._state in LOADED_STATES

    @property
    def serving(self) -> bool:
        return self._state in (InstanceState.READY, InstanceState.FENCED)

    @property
    def schedulable(self) -> bool:
        return self._state is InstanceState.READY and not self.busy

    def load_view(self) -> InstanceLoad:
        """What the deadline gate needs to predict this instance's answers."""
        return InstanceLoad(self.times, self.busy_until if self.busy else None, self.max_batch)

    def begin_batch(self, size: int, now: float) -> None:
        """Mark the instance busy with a batch of `size` dispatched at `now` (by its scheduler)."""
        self.busy = True
        self.busy_until = now + self.times.seconds(size, now)
        self.changes += 1
        self._idle.clear()

    def end_batch(self) -> None:
        self.busy = False
        self.busy_until = None
        self.changes += 1
        self._idle.set()

    async def until_batch_done(self) -> None:
        """Return once no batch runs on this instance (the scheduler has released it)."""
        await self._idle.wait()

    def begin_use(self) -> None:
        """A hook is about to run on this instance's plugin, or an answer awaits its postprocessing:
        an unload waits for `end_use` (`until_unused`)."""
        self._uses += 1
        self._unused.clear()

    def end_use(self) -> None:
        self._uses -= 1
        if self._uses == 0:
            self._unused.set()

    async def until_unused(self) -> None:
        """Return once no hook runs on this instance's plugin and every answer it gave is postprocessed."""
        await self._unused.wait()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on this instance's thread (loading, warm-up, profiling)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    async def execute(self, tickets: Sequence[Ticket]) -> BatchResult:
        """Run one batch. Tickets already answered (withdrawn, their client gone) are dropped first.
        Every ticket that ran has an output or an error in the result."""
        live = [t for t in tickets if not t.answered]
        outputs: list[tuple[Ticket, Any]] = []
        errors: list[tuple[Ticket, BaseException]] = []
        started = self._clock()
        if live:
            await self._run_split(live, outputs, errors)
        answered = {id(t) for t, _ in outputs} | {id(t) for t, _ in errors}
        errors += [(t, ModelError(f"model {self.model!r}: batch ended without an answer"))
                   for t in live if id(t) not in answered]
        ended = self._clock()
        return BatchResult(outputs, errors, len(live), ended - started, ended, instance=self)

    async def wait_idle(self) -> None:
        """Return once the thread has really finished its last batch (a stalled one included)."""
        if self._inflight is not None and not self._inflight.done():
            await asyncio.shield(self._inflight)

    def shutdown(self) -> None:
        """Stop the thread (at process exit; an unloaded instance may load again until then)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run_split(self, tickets: Sequence[Ticket], outputs: list[tuple[Ticket, Any]],
                         errors: list[tuple[Ticket, BaseException]]) -> None:
        """Predict; on out-of-memory free the cache and retry each half; one item that still fails gets 503."""
        try:
            results = await self._predict([t.item for t in tickets])
        except (ExecutionTimeout, ModelUnavailable) as exc:  # fenced, or its process is gone: answered as is
            errors += [(t, exc) for t in tickets]
            return
        except Exception as exc:
            if not is_out_of_memory(exc):
                log.exception("model %s failed on a batch of %d", self.model, len(tickets))
                error = ModelError(f"model {self.model!r} failed: {type(exc).__name__}: {exc}")
                errors += [(t, error) for t in tickets]
                return
            await self._free_cache()
            if len(tickets) == 1:
                oom = DeviceOutOfMemory(f"model {self.model!r} ran out of memory on a single input", retry_after_s=1.0)
                errors.append((tickets[0], oom))
                return
            log.warning("model %s out of memory on a batch of %d; retrying as two halves", self.model, len(tickets))
            middle = len(tickets) // 2
            await self._run_split(tickets[:middle], outputs, errors)
            await self._run_split(tickets[middle:], outputs, errors)
            return
        if len(results) != len(tickets):
            mismatch = BatchSizeMismatch(
                f"model {self.model!r} returned {len(results)} outputs for a batch of {len(tickets)}"
            )
            errors += [(t, mismatch) for t in tickets]
            return
        outputs += zip(tickets, results, strict=True)

    async def _predict(self, items: list[Any]) -> Sequence[Any]:
        if self._inflight is not None and not self._inflight.done():
            raise ExecutionTimeout(f"model {self.model!r} instance {self.index} is stalled by an earlier batch")
        started = self._clock()
        cost = self._batch_cost
        if cost is not None and cost.inline:  # cheap on the loop: no hand-off to the thread and back
            outputs = cost.timed(True, self.plugin.predict_batch, items)
        else:
            outputs = await self._on_thread(items, cost)
        elapsed = self._clock() - started
        self.batches += 1
        self.times.observe(len(items), elapsed, self._clock())
        self.changes += 1
        if self._on_batch is not None:
            self._on_batch(self.model, len(items), elapsed)
        return outputs

    async def _on_thread(self, items: list[Any], cost: CallCost | None) -> Sequence[Any]:
        """The batch on the instance's thread, fenced if it overruns the execution timeout."""
        fn = self.plugin.predict_batch if cost is None else functools.partial(cost.timed, False, self.plugin.predict_batch)
        # On the loop's executor path like every other call to this thread, so the clock that
        # times the batch (an injected one in tests) also sees it run.
        inflight = asyncio.get_running_loop().run_in_executor(self._executor, fn, items)
        self._inflight = inflight
        try:
            return await asyncio.wait_for(asyncio.shield(inflight), self.execution_timeout_s)  # type: ignore[no-any-return]
        except TimeoutError:
            log.error("model %s instance %d: batch exceeded %.3fs; instance fenced until it returns",
                      self.model, self.index, self.execution_timeout_s)
            if self._state is InstanceState.READY:
                self.fence(f"a batch exceeded {self.execution_timeout_s:.3f}s")
            inflight.add_done_callback(self._stalled_batch_returned)
            raise ExecutionTimeout(
                f"model {self.model!r} execution exceeded its timeout of {self.execution_timeout_s:.3f}s"
            ) from None

    def _stalled_batch_returned(self, batch: asyncio.Future[Any]) -> None:
        if not batch.cancelled():
            batch.exception()  # its requests were answered at the timeout; nobody else reads it
        self._recover()

    def _recover(self) -> None:
        if self._state is InstanceState.FENCED:
            log.warning("model %s instance %d: stalled batch returned; instance back in service", self.model, self.index)
            self.recover()

    async def _free_cache(self) -> None:
        if self.device.startswith("cuda") and "torch" in sys.modules:
            torch = sys.modules["torch"]
            await self.call(torch.cuda.empty_cache)

