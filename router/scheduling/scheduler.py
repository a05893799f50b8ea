"""One scheduler per device: it owns the device's ledger and probe, and dispatches batches.

The decision is `admit_batches` (pure). This module is the thin loop around it: gather the
inputs, read the probe, carry out the plan, and sleep until the next batch is due or something
changes. It sees models and instances only through the `Model` and `Runner` protocols below,
so tests drive it with fakes, and the serving layer above it is free to change.

Mirrored copies (shadow tickets) take only spare capacity: while any real item waits in a queue of
the device (`real_waiting`), only real batches are offered; copies are offered, as batches of
their own, once none does, and meanwhile stay queued until their deadline or a real one's room.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from router.config import BatchPolicy, DeviceConfig
from router.errors import DeadlineExceeded, ModelDoesNotFit, ModelError
from router.scheduling.batch_admission import BatchAdmission, Candidate, DeviceState, admit_batches, fits
from router.scheduling.memory import MemoryLedger, MemoryProbe, MemoryReading, ProbeError, Reservation
from router.scheduling.queue import BatchResult, ModelQueue, Ticket, reject
from router.scheduling.residency import Occupant, plan_residency
from router.scheduling.service_time import BatchTime, DecayingTotal
from router.sdk.plugin import MemoryEstimate
from router.tracing.api import BatchSpan, Tracing

__all__ = ["DeviceScheduler", "Model", "NoRoomYet", "ResidencyActions", "Runner"]

#: The most mirrored copies in one batch: one, so that a shadow batch is never long to wait behind.
SHADOW_BATCH = 1

log = logging.getLogger("router.scheduling.scheduler")
IDLE_REFRESH_S = 1.0


class NoRoomYet(ModelDoesNotFit):
    """The instance fits the device, but not beside what is loaded now: evictions can make room."""


class Runner(Protocol):
    """One model instance on this device, as its scheduler sees it."""

    @property
    def key(self) -> str: ...
    @property
    def schedulable(self) -> bool: ...  # loaded, in service and not running a batch
    @property
    def estimate(self) -> MemoryEstimate | None: ...  # this instance's memory figures
    @property
    def max_batch(self) -> int: ...  # this instance's batch cap (its budget may lower batch.max_size)
    @property
    def times(self) -> BatchTime: ...  # its batch execution time estimate
    def begin_batch(self, size: int, now: float) -> None: ...
    def end_batch(self) -> None: ...
    async def execute(self, tickets: Sequence[Ticket]) -> BatchResult: ...  # an outcome for every ticket that ran
    async def wait_idle(self) -> None: ...  # returns once its thread is really free


class Model(Protocol):
    """A model with instances on this device, as its scheduler sees it."""

    @property
    def name(self) -> str: ...
    @property
    def queue(self) -> ModelQueue: ...
    @property
    def batch_policy(self) -> BatchPolicy: ...
    @property
    def weight(self) -> float: ...  # fair-share weight
    @property
    def budget_bytes(self) -> int | None: ...  # cap on its weights + running batches
    def dispatch_horizon_s(self, runner: Runner, size: int, now: float) -> float: ...
    def occupant(self, runner: Runner, now: float) -> Occupant: ...  # the runner as residency sees it
    def steady(self, runner: Runner) -> bool: ...  # serving, with nothing for residency to decide


class ResidencyActions(Protocol):
    """How the scheduler's residency decisions are carried out (by the serving layer). Each call
    returns at once: the work runs in the background and ends with a `notify()`."""

    def start_load(self, runner_key: str) -> None: ...
    def start_unload(self, runner_key: str, kind: str, detail: str) -> None: ...
    def cannot_load(self, runner_key: str, reason: str) -> None: ...


class DeviceScheduler:
    def __init__(
        self,
        device: str,
        config: DeviceConfig,
        probe: MemoryProbe | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        tracing: Tracing | None = None,
    ) -> None:
        self.device = device
        self.config = config
        self.batch_limit = config.concurrent_batch_limit(device)  # read for every batch: derived once
        self.probe = probe
        self.clock = clock
        self._tracing = tracing
        self.ledger = MemoryLedger(device)
        self.budget_bytes = 0
        self.total_bytes = 0
        self.last_reading: MemoryReading | None = None
        self.paused = False
        self.last_admission = BatchAdmission()
        self.probe_errors = 0
        self.restarts = 0
        self._probe_failing = False
        self._last_read_at = 0.0
        self._members: list[tuple[Model, Runner]] = []
        self._served_s: dict[str, DecayingTotal] = {}
        self._event = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._active = 0  # batches dispatched and not yet returned (what the concurrency limit counts)
        self._ends: dict[int, float] = {}  # expected end of each counted batch, by reservation
        self._stopping = False
        self._actions: ResidencyActions | None = None

    # -- set-up -----------------------------------------------------------------------------

    def resolve_budget(self) -> int:
        """Fix the device budget from the config and a first reading. Raises ProbeError."""
        if self.probe is not None:
            reading = self.probe.read()
            self.last_reading = reading
            self.total_bytes = reading.total_bytes
        elif self.config.memory_budget is None:
            raise ProbeError(f"device {self.device}: probe 'none' needs an explicit memory_budget")
        if self.config.memory_budget is not None:
            self.budget_bytes = int(self.config.memory_budget)
            self.total_bytes = self.total_bytes or self.budget_bytes
        else:
            self.budget_bytes = int(self.total_bytes * self.config.memory_fraction)
        return self.budget_bytes

    def attach(self, model: Model, runner: Runner) -> None:
        self._members.append((model, runner))

    def detach(self, runner: Runner) -> None:
        self._members = [(m, r) for m, r in self._members if r is not runner]

    def check_fits(self, model: Model, estimate: MemoryEstimate) -> None:
        """Refuse an instance whose single-input batch could never fit beside the loaded weights."""
        candidate = self._candidate(model, key="(loading)", estimate=estimate, max_batch=1)
        resident = self.ledger.weights_bytes + estimate.weights_bytes
        if fits(candidate, 1, self._device_state(), resident_bytes=resident):
            return
        need = estimate.weights_bytes + candidate.batch_bytes(1)
        if fits(candidate, 1, self._device_state(), resident_bytes=estimate.weights_bytes):
            raise NoRoomYet(
                f"model {model.name!r} needs {need} bytes (weights {estimate.weights_bytes} + one input "
                f"{candidate.batch_bytes(1)}); with {self.ledger.weights_bytes} bytes of other weights loaded on "
                f"{self.device} that is over the device budget of {self.budget_bytes}"
            )
        over = (f"its own budget of {model.budget_bytes}" if need <= self.budget_bytes
                else f"the device budget of {self.budget_bytes} on {self.device}")
        raise ModelDoesNotFit(f"model {model.name!r} needs {need} bytes (weights {estimate.weights_bytes} + one "
                              f"input {candidate.batch_bytes(1)}), over {over}")

    def book_weights(self, model: Model, runner: Runner, nbytes: int) -> None:
        """An instance's weights are now held on this device (the ledger is written only here)."""
        self.ledger.book_weights(runner.key, model.name, nbytes)
        self.notify()

    def read_now(self) -> int | None:
        """A fresh reading of the device's used bytes (None without a probe, or if it fails)."""
        if self.probe is None:
            return None
        reading = self._read()
        return reading.used_bytes if reading is not None else None

    def release_weights(self, runner: Runner) -> None:
        self.ledger.release_weights(runner.key)
        self.notify()

    def set_actions(self, actions: ResidencyActions) -> None:
        """Decide residency from now on, carried out by `actions`."""
        self._actions = actions

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"scheduler-{self.device}")

    async def stop(self) -> None:
        self._stopping = True
        self._event.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.probe is not None:
            self.probe.close()

    def notify(self) -> None:
        """Something changed: a ticket arrived, a batch finished, an instance became ready. The loop
        steps only if a step could act: an item waits on the device, or a member is not steady (a
        residency decision may be due). A batch that ends with nothing queued, or a request that
        lets go of a steady model, wakes nothing (the loop's timer still refreshes the idle probe)."""
        if not self._event.is_set() and (self._stopping or self._has_work()):
            self._event.set()

    def _has_work(self) -> bool:
        return any(model.queue.depth for model, _ in self._members) or not self._residency_quiet()

    def _residency_quiet(self) -> bool:
        """Nothing for residency to decide here: it is not decided on this device, or every member
        is steady (its plan would be empty)."""
        return self._actions is None or all(model.steady(runner) for model, runner in self._members)

    @property
    def running_batches(self) -> int:
        return self._active

    def free_at(self, now: float) -> float:
        """When the device can next start a batch: now, unless its batch limit is reached; then
        the expected end of the first running batch."""
        limit = self.batch_limit
        if limit is None or self._active < limit or not self._ends:
            return now
        return max(now, min(self._ends.values()))

    # -- the loop ---------------------------------------------------------------------------

    async def _supervise(self) -> None:
        """Keep the loop alive: a crash is logged loudly and the loop restarts."""
        while not self._stopping:
            try:
                await self._loop()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.restarts += 1
                log.exception("scheduler for %s crashed (restart %d)", self.device, self.restarts)
                await asyncio.sleep(0.05)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            self._event.clear()
            wake_at = self.step()
            delay = IDLE_REFRESH_S if wake_at is None else max(0.0, wake_at - self.clock())
            timer = loop.call_later(delay, self._event.set)
            try:
                await self._event.wait()
            finally:
                timer.cancel()

    def step(self) -> float | None:
        """Admit what fits now, then decide what should be resident. Returns when to look again
        (None: only when notified)."""
        wake_at = self._admit()
        idle_due = self._plan_residency()
        if idle_due is not None:
            wake_at = idle_due if wake_at is None else min(wake_at, idle_due)
        return wake_at

    def queues(self) -> list[ModelQueue]:
        """The queues of the models on this device, each once."""
        return list({id(model.queue): model.queue for model, _ in self._members}.values())

    def real_waiting(self) -> int:
        """Real items queued or being prepared in the queues of the models on this device."""
        return sum(queue.real_occupancy for queue in self.queues())

    def _admit(self) -> float | None:
        now = self.clock()
        real_waiting = self.real_waiting()
        shadow = real_waiting == 0  # mirrored copies only when no real item waits on the device
        candidates: list[Candidate] = []
        next_due: float | None = None
        for model, runner in self._members:
            if not runner.schedulable:
                continue
            # A copy runs alone: a real request arriving meanwhile waits for one item's run at most.
            max_batch = SHADOW_BATCH if shadow else runner.max_batch
            due = model.queue.due_at(model.batch_policy, max_batch, shadow=shadow)
            if due is None:
                continue
            if due <= now:
                candidates.append(self._candidate(model, runner.key, runner.estimate, max_batch, shadow))
            elif next_due is None or due < next_due:
                next_due = due
        if not candidates:
            if self.probe is not None and now - self._last_read_at > IDLE_REFRESH_S:
                self._read()
            return next_due
        # Reservations cover what was admitted since; the live reading may be up to one poll old.
        reading = self._read(max_age_s=self.config.poll_interval_ms / 1000.0)
        admission = admit_batches(candidates, self._device_state(reading=reading, real_waiting=real_waiting))
        self._record_admission(admission)
        by_key = {runner.key: (model, runner) for model, runner in self._members}
        for batch in admission.admits:
            model, runner = by_key[batch.instance]
            self._dispatch(model, runner, batch.size, now, shadow=batch.shadow)
        if admission.paused or admission.blocked:
            poll = now + self.config.poll_interval_ms / 1000.0
            next_due = poll if next_due is None else min(next_due, poll)
        return next_due

    def _read(self, max_age_s: float = 0.0) -> MemoryReading | None:
        """Read the probe, or reuse a good reading younger than `max_age_s`; any failure is logged
        once and pauses batch admission until it recovers."""
        if self.probe is None:
            return MemoryReading(self.ledger.weights_bytes, max(self.total_bytes, self.budget_bytes))
        now = self.clock()
        if self.last_reading is not None and not self._probe_failing and now - self._last_read_at < max_age_s:
            return self.last_reading
        self._last_read_at = now
        try:
            reading = self.probe.read().check()
        except Exception as exc:  # noqa: BLE001  # any probe failure pauses admission, counted and logged
            self.probe_errors += 1
            if not self._probe_failing:
                log.error("memory probe for %s failed, batch admission paused: %s", self.device, exc)
            self._probe_failing = True
            return None
        if self._probe_failing:
            log.warning("memory probe for %s recovered; batch admission resumes", self.device)
            self._probe_failing = False
        self.last_reading = reading
        return reading

    def _device_state(self, reading: MemoryReading | None = None, real_waiting: int = 0) -> DeviceState:
        used = reading.used_bytes if reading is not None else None
        if reading is None and self.probe is None:
            used = self.ledger.weights_bytes
        return DeviceState(
            budget_bytes=self.budget_bytes,
            used_bytes=used,
            reserved_bytes=self.ledger.reserved_bytes,
            high_watermark=self.config.high_watermark,
            low_watermark=self.config.low_watermark,
            paused=self.paused,
            running_batches=self._active,
            max_concurrent_batches=self.batch_limit,
            real_waiting=real_waiting,
        )

    def _candidate(self, model: Model, key: str, estimate: MemoryEstimate | None, max_batch: int,
                   shadow: bool = False) -> Candidate:
        queue = model.queue
        return Candidate(
            model=model.name,
            instance=key,
            queued=queue.shadow_depth if shadow else queue.real_depth,
            max_batch=max_batch,
            per_item_bytes=estimate.per_item_bytes if estimate else 0,
            fixed_bytes=estimate.fixed_bytes if estimate else 0,
            model_budget=model.budget_bytes,
            model_bytes=self.ledger.model_bytes(model.name),
            share=self._served(model.name).at(self.clock()) / model.weight,
            shadow=shadow,
        )

    def _plan_residency(self) -> float | None:
        """Plan loads and evictions and hand them to the serving layer. Returns when an idle
        model next falls due for unloading, if any does."""
        if self._actions is None or self._residency_quiet():
            return None
        now = self.clock()
        occupants = [model.occupant(runner, now) for model, runner in self._members]
        # Residency is about what stays: booked weights, or what the probe sees held beyond the
        # running batches' reservations, if more. Reservations end with their batches; counting
        # them here would evict for room that frees itself in a moment.
        reading = self.last_reading if self.probe is not None else None
        committed = self.ledger.weights_bytes
        if reading is not None:
            committed = max(committed, reading.used_bytes - self.ledger.reserved_bytes)
        plan = plan_residency(occupants, budget_bytes=self.budget_bytes, committed_bytes=committed,
                              max_loads=self.config.max_concurrent_loads, now=now)
        for key, kind, detail in plan.evictions:
            log.info("device %s: evicting %s (%s: %s)", self.device, key, kind, detail)
            self._actions.start_unload(key, kind, detail)
        for key, reason in plan.never_fits:
            self._actions.cannot_load(key, reason)
        for key in plan.loads:
            self._actions.start_load(key)
        idle = [o.last_used + o.idle_unload_s for o in occupants
                if o.state == "resident" and o.idle_unload_s is not None and o.work == 0 and not o.pinned]
        return min(idle) if idle else None

    def _served(self, model: str) -> DecayingTotal:
        return self._served_s.setdefault(model, DecayingTotal())

    def _record_admission(self, admission: BatchAdmission) -> None:
        if admission.paused != self.paused:
            log.warning("device %s batch admission %s: %s", self.device, "paused" if admission.paused else "resumed",
                        admission.reason or "below the low watermark")
        self.paused = admission.paused
        self.last_admission = admission

    def _dispatch(self, model: Model, runner: Runner, size: int, now: float, *, shadow: bool = False) -> None:
        horizon = model.dispatch_horizon_s(runner, size, now)
        tickets, doomed = model.queue.take_viable(size, now, horizon, shadow=shadow)
        for ticket in doomed:  # the answer would come after their deadline: answer now, run nothing
            reject(ticket, DeadlineExceeded(
                f"model {model.name!r} cannot answer before the deadline (an answer takes about "
                f"{horizon * 1000:.0f} ms from dispatch); the input was not run"
            ))
        if not tickets:
            return
        estimate = runner.estimate
        nbytes = estimate.batch_bytes(len(tickets)) if estimate else 0
        reservation = self.ledger.reserve(model.name, nbytes)
        runner.begin_batch(len(tickets), now)
        self._active += 1
        self._ends[reservation.batch_id] = now + runner.times.seconds(len(tickets), now)
        span = self._batch_span(model, runner, tickets, reservation, now) if self._tracing is not None else None
        task = asyncio.create_task(self._run(model, runner, tickets, reservation, now, span))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _batch_span(self, model: Model, runner: Runner, tickets: list[Ticket], reservation: Reservation,
                    now: float) -> BatchSpan | None:
        """The span of a batch that serves a sampled request, linked to each one; the batch's result
        carries its ref to the tickets."""
        assert self._tracing is not None
        traced = [(ticket.trace, ticket.request_id) for ticket in tickets if ticket.trace is not None]
        if not traced:
            return None
        return self._tracing.start_batch(traced, now, {
            "router.model": model.name, "router.instance": runner.key, "router.device": self.device,
            "router.batch.size": len(tickets), "router.batch.memory_reserved_bytes": reservation.bytes,
        })

    async def _run(self, model: Model, runner: Runner, tickets: list[Ticket], reservation: Reservation,
                   dispatched_at: float, span: BatchSpan | None = None) -> None:
        started = self.clock()
        before = self.last_reading
        slot = True
        try:
            try:
                result = await runner.execute(tickets)
            except BaseException:
                if span is not None:
                    span.end(self.clock(), "the batch ended without an answer")
                for ticket in tickets:  # every ticket is answered, whatever happened
                    reject(ticket, ModelError(f"model {model.name!r}: batch ended without an answer"))
                raise
            if span is not None:
                span.end(self.clock(), result.error)
            # Resolved before the callers resume, with no await in between: the delta is this batch's.
            result.resolve(dispatched_at, self._memory_change(before), span.ref if span is not None else None)
            # Answered. A batch fenced past its execution timeout keeps its memory until its thread
            # returns, but not its slot: a hung model must not stop the others on its device.
            self._active -= 1
            self._ends.pop(reservation.batch_id, None)
            slot = False
            self.notify()
            await runner.wait_idle()
        finally:
            self.ledger.release(reservation)
            if slot:
                self._active -= 1  # before notify: the next step must see the slot free
                self._ends.pop(reservation.batch_id, None)
            runner.end_batch()
            self._served(model.name).add(self.clock() - started, self.clock())
            self.notify()

    def _memory_change(self, before: MemoryReading | None) -> int | None:
        """Device memory used after the batch minus before it, for each ticket's log line."""
        if self.probe is None or before is None:
            return None
        after = self._read()
        return None if after is None else after.used_bytes - before.used_bytes
