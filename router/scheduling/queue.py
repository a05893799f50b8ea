"""A model's bounded priority queue. It owns its tickets, their order and batch formation.

The queue is plain state driven with explicit timestamps; it never sleeps and never touches the
event loop, so tests drive it with an injected clock.

A ticket is answered once, with an outcome: `Served` (the output, the facts of the batch it rode,
and the `Lease` that keeps the instance that ran it in use until its caller ends it) or `Refused`
(the error). Whoever queued the ticket gave it the function its outcome goes to (`Ticket.reply`).

A mirrored copy (`Ticket.shadow`) waits in a lane below every priority level: it is batched only
from that lane (never beside a real item, and only when its scheduler finds no real item waiting),
and a real request that finds the queue full takes the place of the oldest queued copy, which is
answered `NoSpareCapacity` at once.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from router.config import BatchPolicy
from router.errors import NoSpareCapacity, PayloadTooLarge, QueueFull
from router.tracing.api import SpanRef

__all__ = ["BatchFacts", "BatchResult", "DrainRate", "Lease", "ModelQueue", "Outcome", "Refused", "Served", "Ticket",
           "TicketState", "answer", "end_lease", "reject"]


class TicketState(enum.Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    WITHDRAWN = "withdrawn"  # expired or cancelled while queued; never runs


@dataclass(eq=False)
class Ticket:
    """One accepted request: its prepared input and where its outcome goes (`reply`, called once,
    by `answer`). Its `state` is its queue's to write."""

    request_id: str
    item: Any
    priority: int
    arrived_at: float
    deadline: float
    reply: Callable[[Outcome], None] | None = None  # None in pure tests of the queue
    input_bytes: int = 0
    state: TicketState = TicketState.QUEUED
    measure: bool = False  # admitted to measure the model (idle, untimed, half-open): never dropped as doomed
    # Tracing: a value, not a live span, so that it can cross to a process where the batch runs.
    trace: SpanRef | None = None  # the sampled request's span, which its batch span links to
    answered: bool = False  # or abandoned: nobody reads an outcome of it any more
    shadow: bool = False  # a mirrored copy: below every priority level, shed first, never a user's answer

    def abandon(self) -> None:
        """Nobody reads this ticket's outcome any more (its caller went away, or its deadline
        passed while its batch ran): it is not run if it has not begun, and an outcome that comes
        later only ends its lease."""
        self.answered = True


class Lease:
    """An answered ticket's use of the instance that ran it (`begin_use`), so that the instance
    stays loaded while its caller postprocesses the output. `end` is the one place the use ends."""

    __slots__ = ("instance",)

    def __init__(self, instance: Any) -> None:
        instance.begin_use()
        self.instance: Any = instance

    def end(self) -> None:
        """End the use (once: a second call does nothing)."""
        instance, self.instance = self.instance, None
        if instance is not None:
            instance.end_use()


class BatchFacts(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The batch a ticket rode: its size, when it was dispatched and ended, how long it ran, the
    device memory used after it minus before (where a probe reads it), and its span (tracing, as
    `SpanRef.to_bytes`). A value: the engine of a split host sends it to the front as it is, with
    `queue_wait_s`, the ticket's wait from queueing to dispatch, filled in (`dispatched_at` 0.0 for
    an answer whose hooks ran in the engine: `queue_wait_s` says its wait)."""

    size: int
    dispatched_at: float
    execution_s: float
    finished_at: float = 0.0
    memory_delta_bytes: int | None = None
    batch_trace: bytes | None = None
    queue_wait_s: float = 0.0

    @property
    def link(self) -> SpanRef | None:
        """The batch span, for a request's execute phase to link to."""
        return None if self.batch_trace is None else SpanRef.from_bytes(self.batch_trace)


@dataclass(frozen=True, slots=True)
class Served:
    """A ticket's batch answered it: its output, the batch's facts, and the lease on the instance
    that ran it (None where no instance did), which the reader ends when done with the output."""

    output: Any
    batch: BatchFacts
    lease: Lease | None = None


@dataclass(frozen=True, slots=True)
class Refused:
    """The error that answers a ticket, and the batch it rode if it ran in one."""

    error: BaseException
    batch: BatchFacts | None = None


Outcome = Served | Refused


def answer(ticket: Ticket, outcome: Outcome) -> bool:
    """Answer a ticket with `outcome`, unless it has its answer already (every ticket is answered
    exactly once: the first outcome stands, and a later one's lease ends here). True if answered now."""
    if ticket.answered:
        end_lease(outcome)
        return False
    ticket.answered = True
    if ticket.reply is not None:
        ticket.reply(outcome)
    return True


def reject(ticket: Ticket, error: BaseException) -> bool:
    """Answer a ticket with an error, unless it has its answer already."""
    return answer(ticket, Refused(error))


def end_lease(outcome: Outcome) -> None:
    """The outcome of a ticket nobody reads: its instance's use, if it had one, ends."""
    if isinstance(outcome, Served) and outcome.lease is not None:
        outcome.lease.end()


@dataclass(frozen=True)
class BatchResult:
    """What one run of a batch gave (an instance returns it): an output or an error for each
    ticket that ran, and its timing. Its scheduler resolves the tickets, with the memory delta
    and the span."""

    outputs: Sequence[tuple[Ticket, Any]] = ()
    errors: Sequence[tuple[Ticket, BaseException]] = ()
    size: int = 0
    execution_s: float = 0.0
    finished_at: float = 0.0
    instance: Any = None  # the instance that ran it: it is in use until each answered caller ends its use

    def resolve(self, dispatched_at: float, memory_delta_bytes: int | None = None,
                batch_trace: SpanRef | None = None) -> None:
        """Answer every ticket of the batch, each exactly once; one served holds the instance in
        use (its `Lease`) for its caller's postprocessing."""
        trace = None if batch_trace is None else batch_trace.to_bytes()
        facts = BatchFacts(self.size, dispatched_at, self.execution_s, self.finished_at, memory_delta_bytes, trace)
        for ticket, output in self.outputs:
            if not ticket.answered:
                answer(ticket, Served(output, facts, Lease(self.instance) if self.instance is not None else None))
        for ticket, error in self.errors:
            answer(ticket, Refused(error, facts))

    @property
    def error(self) -> str | None:
        """What the batch failed with (its first failed ticket's error), for its span."""
        if not self.errors:
            return None
        error = self.errors[0][1]
        return str(getattr(error, "detail", None) or error)


@dataclass
class DrainRate:
    """Items taken per second over a sliding window, for Retry-After estimates."""

    window_s: float = 10.0
    _events: deque[tuple[float, int]] = field(default_factory=deque)
    _total: int = 0

    def record(self, now: float, count: int) -> None:
        self._events.append((now, count))
        self._total += count
        self._trim(now)

    def per_second(self, now: float) -> float | None:
        self._trim(now)
        if not self._events:
            return None
        span = max(now - self._events[0][0], 0.25)
        return self._total / span

    def _trim(self, now: float) -> None:
        while self._events and now - self._events[0][0] > self.window_s:
            _, count = self._events.popleft()
            self._total -= count


class ModelQueue:
    """Bounded, priority-ordered (higher first), FIFO within a priority level; mirrored copies wait
    in a lane of their own below every level.

    Capacity counts queued tickets plus slots reserved by requests still being preprocessed,
    so a burst cannot pile up unbounded work in front of the queue. A real request's room leaves
    mirrored copies out: when it needs their room, the oldest queued copy gives it up (`_shed_for_room`).
    Withdrawn tickets are removed lazily and compacted when they pile up.
    """

    def __init__(self, name: str, *, max_size: int, priority_levels: int = 1) -> None:
        self.name = name
        self.max_size = max_size
        self.priority_levels = priority_levels
        self._levels: list[deque[Ticket]] = [deque() for _ in range(priority_levels)]
        self._shadow: deque[Ticket] = deque()  # mirrored copies, oldest first
        self._live = 0
        self._shadow_live = 0
        self._pending = 0
        self._shadow_pending = 0
        self._dead = 0
        self.drain = DrainRate()
        self.on_room: Callable[[], None] | None = None  # called whenever occupancy falls: room was freed

    @property
    def depth(self) -> int:
        """Tickets waiting to be batched, mirrored copies included."""
        return self._live

    @property
    def real_depth(self) -> int:
        """Real (not mirrored) tickets waiting to be batched."""
        return self._live - self._shadow_live

    @property
    def shadow_depth(self) -> int:
        """Mirrored copies waiting to be batched."""
        return self._shadow_live

    @property
    def occupancy(self) -> int:
        """Queued tickets plus reserved slots; compared with max_size."""
        return self._live + self._pending + self._shadow_pending

    @property
    def real_occupancy(self) -> int:
        """Real tickets queued plus slots reserved for real ones: what a real request's room counts."""
        return self._live - self._shadow_live + self._pending

    @property
    def shadow_occupancy(self) -> int:
        """Mirrored copies queued or being prepared."""
        return self._shadow_live + self._shadow_pending

    def check_room(self, now: float, items: int = 1, *, shadow: bool = False) -> None:
        """Raise QueueFull if `items` real requests cannot all be taken now (NoSpareCapacity for
        mirrored copies, which count everything); PayloadTooLarge if they never can."""
        if items > self.max_size:
            raise PayloadTooLarge(f"model {self.name!r} queues at most {self.max_size} requests; "
                                  f"{items} items in one request can never fit")
        if shadow:
            if self.occupancy + items > self.max_size:
                raise NoSpareCapacity(f"model {self.name!r}: no room in its queue for a mirrored copy")
            return
        occupancy = self.real_occupancy
        if occupancy + items > self.max_size:
            room = f"room for {self.max_size - occupancy} of {items} items" if items > 1 else f"{self.max_size} requests"
            raise QueueFull(
                f"model {self.name!r} queue is full ({room}); retry later",
                retry_after_s=self.retry_after_s(now),
            )

    def reserve_slot(self, now: float, *, shadow: bool = False) -> None:
        """Claim capacity for a request about to be preprocessed. Raises QueueFull (NoSpareCapacity
        for a mirrored copy) at once; a real request may shed a queued copy to make its room."""
        self.check_room(now, shadow=shadow)
        if shadow:
            self._shadow_pending += 1
            return
        self._pending += 1
        self._shed_for_room()

    def release_slot(self, *, shadow: bool = False) -> None:
        if shadow:
            self._shadow_pending = max(0, self._shadow_pending - 1)
        else:
            self._pending = max(0, self._pending - 1)
        self._freed()

    def put(self, ticket: Ticket, *, reserved: bool = False) -> None:
        """Queue a ticket, converting a reserved slot if the caller holds one. A mirrored copy that
        real requests crowded out while it was prepared is refused (NoSpareCapacity), its reserved
        slot still the caller's to give back (`release_slot`)."""
        if ticket.shadow:
            self._put_shadow(ticket, reserved)
            return
        if reserved:
            self._pending = max(0, self._pending - 1)
        else:
            self.check_room(ticket.arrived_at)
        self._check_priority(ticket)
        ticket.state = TicketState.QUEUED
        self._levels[ticket.priority - 1].append(ticket)
        self._live += 1
        if not reserved:
            self._shed_for_room()

    def _put_shadow(self, ticket: Ticket, reserved: bool) -> None:
        self._check_priority(ticket)
        if not reserved:
            self.check_room(ticket.arrived_at, shadow=True)
        elif self.occupancy > self.max_size:
            raise NoSpareCapacity(f"model {self.name!r}: real requests took the queue's room while a mirrored "
                                  "copy was prepared")
        else:
            self._shadow_pending = max(0, self._shadow_pending - 1)
        ticket.state = TicketState.QUEUED
        self._shadow.append(ticket)
        self._live += 1
        self._shadow_live += 1

    def _check_priority(self, ticket: Ticket) -> None:
        if not 1 <= ticket.priority <= self.priority_levels:
            raise ValueError(f"priority must be in 1..{self.priority_levels}, got {ticket.priority}")

    def _shed_for_room(self) -> None:
        """Over the bound after a real request came in: queued mirrored copies give up their room,
        oldest first, each answered NoSpareCapacity (copies still being prepared are refused at `put`)."""
        while self.occupancy > self.max_size and self._shadow_live:
            ticket = self._shadow.popleft()
            if ticket.state is not TicketState.QUEUED:
                self._dead -= 1
                continue
            ticket.state = TicketState.WITHDRAWN
            self._live -= 1
            self._shadow_live -= 1
            reject(ticket, NoSpareCapacity(f"model {self.name!r}: a real request took the queue slot of this "
                                           "mirrored copy; it was not run"))

    def withdraw(self, ticket: Ticket) -> bool:
        """Remove a queued ticket (deadline passed, client gone). False if it was already dispatched."""
        if ticket.state is not TicketState.QUEUED:
            return False
        ticket.state = TicketState.WITHDRAWN
        self._live -= 1
        if ticket.shadow:
            self._shadow_live -= 1
        self._dead += 1
        if self._dead > max(64, self._live):
            self._compact()
        self._freed()
        return True

    def withdraw_all(self) -> list[Ticket]:
        """Withdraw every queued ticket (the model is going away), oldest first, to be answered."""
        tickets = sorted((t for lane in self._lanes() for t in lane if t.state is TicketState.QUEUED),
                         key=lambda t: t.arrived_at)
        for ticket in tickets:
            self.withdraw(ticket)
        return tickets

    def take_viable(self, n: int, now: float, horizon_s: float, *,
                    shadow: bool = False) -> tuple[list[Ticket], list[Ticket]]:
        """Dispatch up to n tickets: highest priority first, oldest first within a level; with
        `shadow`, mirrored copies only (never both in one batch). Tickets whose deadline falls
        before `now + horizon_s` (the batch would finish too late for them) are withdrawn instead
        and returned second, to be answered 504."""
        batch: list[Ticket] = []
        doomed: list[Ticket] = []
        for lane in ([self._shadow] if shadow else reversed(self._levels)):
            while lane and len(batch) < n:
                ticket = lane.popleft()
                if ticket.state is not TicketState.QUEUED:
                    self._dead -= 1
                    continue
                if horizon_s > 0 and ticket.deadline < now + horizon_s and not ticket.measure:
                    ticket.state = TicketState.WITHDRAWN
                    doomed.append(ticket)
                    continue
                ticket.state = TicketState.DISPATCHED
                batch.append(ticket)
            if len(batch) >= n:
                break
        taken = len(batch) + len(doomed)
        self._live -= taken
        if shadow:
            self._shadow_live -= taken
        if taken:
            self.drain.record(now, taken)
            self._freed()
        return batch, doomed

    def _freed(self) -> None:
        if self.on_room is not None:
            self.on_room()

    def _lanes(self) -> list[deque[Ticket]]:
        return [*self._levels, self._shadow]

    def oldest_arrival(self, *, shadow: bool = False) -> float | None:
        """Arrival time of the oldest live ticket (of the mirrored lane, with `shadow`): the start of
        the forming batch's delay."""
        oldest: float | None = None
        for level in ([self._shadow] if shadow else self._levels):
            self._drop_dead_head(level)
            if level and (oldest is None or level[0].arrived_at < oldest):
                oldest = level[0].arrived_at
        return oldest

    def due_at(self, policy: BatchPolicy, max_batch: int | None = None, *, shadow: bool = False) -> float | None:
        """When the forming batch of real tickets (of mirrored copies, with `shadow`) must go: at
        once if full, else max_delay after its first arrival."""
        count = self.shadow_depth if shadow else self.real_depth
        if count == 0:
            return None
        oldest = self.oldest_arrival(shadow=shadow)
        assert oldest is not None
        if count >= (max_batch or policy.max_size):
            return oldest
        return oldest + policy.max_delay_s

    def retry_after_s(self, now: float) -> float:
        """Seconds until the queue has likely drained enough to take one more real request."""
        rate = self.drain.per_second(now)
        if not rate:
            return 1.0
        return min(60.0, max(1.0, self.real_occupancy / rate))

    def _drop_dead_head(self, level: deque[Ticket]) -> None:
        while level and level[0].state is not TicketState.QUEUED:
            level.popleft()
            self._dead -= 1

    def _compact(self) -> None:
        for index, level in enumerate(self._levels):
            self._levels[index] = deque(t for t in level if t.state is TicketState.QUEUED)
        self._shadow = deque(t for t in self._shadow if t.state is TicketState.QUEUED)
        self._dead = 0
