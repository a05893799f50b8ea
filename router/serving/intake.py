"""The request path's bookkeeping: admit a request, queue its prepared item, withdraw it, let go.

`Runtime.submit` (one process) composes these verbs around the plugin's hooks; the engine
process (`router.host.engine`) calls them for items that front processes prepared. Between
`admit` and `release` a request holds its model (residency does not evict a model in use) and,
until `enqueue` or `release`, a slot of its queue (a burst cannot pile unbounded work in front
of the queue). What `admit` returns, an `Accepted`, is the caller's handle for the rest.

A mirrored copy (`Terms.shadow`) is decided here, where the queues are, on live figures that say
how many real items wait on its model's devices (`ModelFigures.real_waiting`): it is taken only
into spare capacity, never for a model that is not serving (it never waits for, or causes, a load).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from router.errors import ModelChanged, NoSpareCapacity, ShuttingDown
from router.scheduling.queue import Outcome, Ticket, reject
from router.scheduling.scheduler import DeviceScheduler
from router.serving.deployment import Deployment
from router.serving.fleet_state import FleetState
from router.serving.rules import Admission, ModelFigures, Refusal, Screened, Terms, admit, screen
from router.tracing.api import SpanRef

__all__ = ["SHUTTING_DOWN", "Accepted", "Intake", "Turn"]

log = logging.getLogger("router.serving.intake")
SHUTTING_DOWN = Refusal("ShuttingDown", "server is shutting down; retry on another replica", 5.0)


class DeviceFreeAt(Mapping[str, float]):
    """When each device can next start a batch, asked of its scheduler when looked up."""

    __slots__ = ("_now", "_schedulers")

    def __init__(self, schedulers: Mapping[str, DeviceScheduler], now: float) -> None:
        self._schedulers, self._now = schedulers, now

    def __getitem__(self, device: str) -> float:
        return self._schedulers[device].free_at(self._now)

    def __iter__(self) -> Iterator[str]:
        return iter(self._schedulers)

    def __len__(self) -> int:
        return len(self._schedulers)


@dataclass(frozen=True, eq=False)
class Accepted:
    """An admitted request: the deployment it was admitted to and the decision."""

    deployment: Deployment
    admission: Admission


class Intake:
    """Admission, queueing and release of requests, over the fleet's deployments."""

    def __init__(self, fleet: FleetState, clock: Callable[[], float] = time.monotonic) -> None:
        self._fleet = fleet
        self._clock = clock
        self.tickets: set[Ticket] = set()  # queued or running: a drain answers what is left
        self.closing = False  # draining or closed: every new request is refused

    def free_at(self, now: float) -> Mapping[str, float]:
        """When each device can next start a batch (now, unless all its batch slots are taken), read
        only for the devices asked about."""
        return DeviceFreeAt(self._fleet.schedulers, now)

    def figures(self, deployment: Deployment, now: float, *, gate: bool = True, spare: bool = False) -> ModelFigures:
        """The model's live figures, the server's own refusal (shutting down) first. `spare`: with
        the real items waiting on its devices, for a mirrored copy's decision."""
        refusal = SHUTTING_DOWN if self.closing else None
        free = self.free_at(now) if gate else None
        figures = deployment.figures(now, refusal=refusal, predict=gate, device_free_at=free)
        shadow = deployment.queue.shadow_occupancy
        if shadow or spare:
            figures = msgspec.structs.replace(figures, shadow=shadow,
                                              real_waiting=self.real_waiting(deployment) if spare else None)
        return figures

    def real_waiting(self, deployment: Deployment) -> int:
        """Real items queued or being prepared on the model's devices, its own queue's included.
        A model not serving has no spare capacity: a mirrored copy never waits for a load."""
        if not deployment.serving:
            raise NoSpareCapacity(f"model {deployment.name!r} is not serving; a mirrored copy never waits for a load")
        queues = {id(deployment.queue): deployment.queue}
        schedulers = self._fleet.schedulers
        for device in {instance.device for instance in deployment.instances}:
            scheduler = schedulers.get(device)
            if scheduler is not None:
                queues.update((id(queue), queue) for queue in scheduler.queues())
        return sum(queue.real_occupancy for queue in queues.values())

    def screen(self, deployment: Deployment, terms: Terms, *, gate: bool = True) -> Screened:
        """The screen over the model's live figures, taking nothing (a look before the body is read)."""
        now = self._clock()
        return screen(terms, self.figures(deployment, now, gate=gate, spare=terms.shadow), now, gate=gate)

    def decide(self, deployment: Deployment, terms: Terms) -> Admission:
        """The commit's decision over the model's live figures, for `commit` to act on."""
        now = self._clock()
        return admit(terms, self.figures(deployment, now, spare=terms.shadow), now)

    def commit(self, deployment: Deployment, admission: Admission) -> Accepted:
        """Act on a decision of `decide`: take the gate's half-open turn, reserve a queue slot, hold the model."""
        now = self._clock()
        if admission.half_open:
            deployment.gate.take(now)
        deployment.queue.reserve_slot(now, shadow=admission.shadow)
        deployment.residency.hold(now)  # in use: not evicted until answered
        return Accepted(deployment, admission)

    def admit(self, terms: Terms, *, generation: int | None = None) -> Accepted:
        """Decide, reserve and hold in one step, for an item prepared for the model's `generation`
        (ModelChanged when another version serves now). Raises the RouterError that answers."""
        return Turn(self).admit(terms, generation=generation)

    def deployment(self, model: str, generation: int | None) -> Deployment:
        deployment = self._fleet.get(model)
        if generation is not None and generation != deployment.generation:
            raise ModelChanged(f"model {deployment.name!r} changed while the request was prepared; retry",
                               retry_after_s=1.0)
        return deployment

    def enqueue(self, accepted: Accepted, item: Any, reply: Callable[[Outcome], None], request_id: str,
                input_bytes: int = 0, trace: SpanRef | None = None) -> Ticket:
        """Queue an admitted request's item (its reserved slot becomes the ticket, whose outcome goes
        to `reply`) and wake the scheduler. Shutting down (ShuttingDown), or a mirrored copy whose
        room real requests took meanwhile (NoSpareCapacity): the slot is still the caller's to give
        back (`unreserve`)."""
        deployment, admission = accepted.deployment, accepted.admission
        if self.closing:
            raise ShuttingDown(SHUTTING_DOWN.detail, retry_after_s=SHUTTING_DOWN.retry_after_s)
        ticket = Ticket(request_id, item, admission.level, self._clock(), admission.deadline, reply, input_bytes,
                        measure=admission.measure, trace=trace, shadow=admission.shadow)
        deployment.queue.put(ticket, reserved=True)  # a mirrored copy crowded out: NoSpareCapacity, slot still held
        self.tickets.add(ticket)
        self._fleet.notify(deployment)
        return ticket

    def unreserve(self, accepted: Accepted) -> None:
        """An admitted request that never reached the queue gives its slot back."""
        accepted.deployment.queue.release_slot(shadow=accepted.admission.shadow)

    def withdraw(self, accepted: Accepted, ticket: Ticket) -> bool:
        """Take a ticket out of its queue before it runs (deadline, client gone); False once dispatched."""
        return accepted.deployment.queue.withdraw(ticket)

    def release(self, accepted: Accepted, ticket: Ticket | None = None) -> None:
        """The request is answered: forget its ticket and let go of its model."""
        if ticket is not None:
            self.tickets.discard(ticket)
        residency = accepted.deployment.residency
        residency.release(self._clock())
        if residency.holders == 0:
            self._fleet.notify(accepted.deployment)  # no longer in use: residency may act on it

    def answer_all(self, error: BaseException) -> int:
        """Withdraw and answer with `error` every ticket still queued or running (the end of a drain)."""
        left = list(self.tickets)
        for ticket in left:
            for deployment in self._fleet:
                deployment.queue.withdraw(ticket)
            reject(ticket, error)
        return len(left)


class Turn:
    """The admissions of one event-loop turn (the requests of one read from a front): each model's
    figures are read once, and each request admitted counts as queued ahead of the next (a real one
    ahead of a real one; a mirrored copy behind all). A half-open admission takes the gate's turn,
    so the next request reads the figures again. A mirrored copy reads the real work waiting on its
    model's devices live, with this turn's admissions in it."""

    def __init__(self, intake: Intake) -> None:
        self._intake = intake
        self._now = intake._clock()
        self._figures: dict[str, tuple[Deployment, ModelFigures, int, int]] = {}  # ..., real, shadow admitted

    def admit(self, terms: Terms, *, generation: int | None = None) -> Accepted:
        deployment = self._intake.deployment(terms.model, generation)
        known = self._figures.get(deployment.name)
        if known is None or known[0] is not deployment:
            known = (deployment, self._intake.figures(deployment, self._now), 0, 0)
        _, figures, real, shadow = known
        if terms.shadow:
            spare = msgspec.structs.replace(figures, real_waiting=self._intake.real_waiting(deployment))
            admission = admit(terms, spare, self._now, pending=real + shadow)
        else:
            admission = admit(terms, figures, self._now, pending=real)
        accepted = self._intake.commit(deployment, admission)
        if admission.half_open:
            self._figures.pop(deployment.name, None)
        else:
            self._figures[deployment.name] = (deployment, figures, real + (not terms.shadow), shadow + terms.shadow)
        return accepted
