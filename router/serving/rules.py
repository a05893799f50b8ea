"""The request rules: whether a request is taken, at what priority and by when, from a model's figures.

One pure function, `admit`, decides for every front: the single-process runtime and the engine
process (figures read live from the deployment at that moment), the front processes before any
round trip (the same figures, as the engine last published them on the board), and the Ray
cluster's front (figures from its view of the replicas). The rules, in order:

1. the model is accepting (not shutting down, serving or able to load in time): 503 otherwise;
2. X-Priority within the model's levels: 400 otherwise;
3. X-Timeout-Ms positive (the budget is the model's queue timeout, or shorter if asked): 400;
4. room in the queue for every item: 503 with Retry-After, or 413 for more items than it ever holds;
5. the deadline gate: 503 with Retry-After when the work ahead would push the answer past the
   deadline (`router.scheduling.service_time.deadline_gate`). A request that must finish (a
   pipeline's later step, which has spent part of its time already) gets 504 instead, and even
   an idle model refuses it when the prediction misses.

A caller that waits for room (a pipeline's later step) asks `has_room` and, while it waits,
`check_gate`, and calls `admit` once there is room.

A mirrored copy (`Terms.shadow`) costs real requests nothing: it is taken only into spare capacity,
that is when no real item waits (queued or being prepared) in any queue of the model's devices
(`ModelFigures.real_waiting`, which only the commit knows), its queue has room and the deadline
gate lets it through without the half-open turn; otherwise 503 `NoSpareCapacity` (outcome `shed`).
In the queue it is behind every real item, and a real item that finds the queue full takes the
place of a queued copy, so copies never count against a real request's room.

The rules run in two named steps, each at most once per request (`EVALUATIONS` counts them):
`screen`, where the request arrives, before its body is read or anything is taken (on the
figures the front can read: live, the board's, or the cluster's view); and `admit`, the commit,
where the request takes its queue slot (one process, the engine, a cluster's replica). The
screen's outcome is a `Screened` value carried with the request to its commit; the commit's is
an `Admission`, carried with the request to its answer: its model, priority level, deadline,
queue position and predicted wait.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import msgspec

from router.errors import (
    DeadlineExceeded,
    InputError,
    NoSpareCapacity,
    PayloadTooLarge,
    QueueFull,
    RouterError,
    error_named,
)
from router.scheduling.service_time import Forecast, GateDecision, Prediction, deadline_gate, half_open

__all__ = ["EVALUATIONS", "Admission", "Evaluations", "ModelFigures", "Refusal", "Screened", "Terms", "admit", "budget_s",
           "check_gate", "check_spare", "has_room", "priority_level", "screen"]

#: Figures older than this are not trusted to refuse on predictions (the engine decides instead).
PREDICTION_FRESH_S = 0.25


class Terms(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A request as its headers put it, parsed once: what it asks for, and when it arrived (the
    host's monotonic clock, the same in every process). A front of a split host sends it to the
    engine as it is (`router.host.messages.Submit`)."""

    model: str
    received_at: float
    priority: int | None = None
    timeout_ms: float | None = None
    items: int = 1
    must_finish: bool = False  # a pipeline's later step: a predicted miss is 504, even for an idle model
    wait_for_room: bool = False  # ... which waits for room in a full queue instead of a 503
    shadow: bool = False  # a mirrored copy: only into spare capacity, never a user's answer (last: old arrays decode)


class Refusal(msgspec.Struct, frozen=True, array_like=True):
    """Why a model takes no request now: the RouterError class name, its words and retry hint."""

    kind: str  # ShuttingDown, ModelUnavailable, ModelDoesNotFit
    detail: str
    retry_after_s: float | None = None

    def error(self) -> RouterError:
        return error_named(self.kind, self.detail, retry_after_s=self.retry_after_s)


class ModelFigures(msgspec.Struct, frozen=True, array_like=True):
    """What the rules need to know of one model at one moment (the engine's board carries it too)."""

    name: str
    priority_levels: int
    default_priority: int
    timeout_ms: int
    capacity: int  # the queue's bound
    occupancy: int  # queued, plus slots reserved by requests being prepared
    retry_after_s: float  # the queue's drain estimate, for a refusal when full
    refusal: Refusal | None = None  # not accepting now
    forecast: Forecast | None = None  # the deadline gate's: an answer's time from a queue position
    idle: bool = False  # nothing queued and an instance free: admit to measure
    half_open_at: float | None = None  # the half-open gate's last turn
    half_open_interval_s: float = 0.5
    last_sample_at: float | None = None  # when a real batch last finished
    at: float = 0.0  # when the figures held
    shadow: int = 0  # mirrored items among `occupancy` (queued or being prepared): behind every real one
    real_waiting: int | None = None  # real items queued or prepared on the model's devices; None: not known here


class Admission(msgspec.Struct, frozen=True):
    """The decision to take a request, made once: it travels with the request to its answer."""

    model: str
    level: int  # priority level, 1..levels (higher first)
    arrived_at: float
    deadline: float
    queue_position: int  # requests ahead of it when admitted
    predicted_wait_s: float | None = None  # the deadline gate's prediction of its answer
    measure: bool = False  # admitted without a prediction's backing: never dropped as doomed at dispatch
    half_open: bool = False  # admitted against the prediction, to measure: the gate's turn is taken
    shadow: bool = False  # a mirrored copy: queued behind every real item, shed first


class Screened(msgspec.Struct, frozen=True):
    """A request the rules screened and let through, taking nothing: its terms, its deadline and
    the figures the screen read (None where there were none to read: the commit decides alone).
    It travels with the request to its commit; nothing screens the request again."""

    terms: Terms
    deadline: float
    figures: ModelFigures | None = None


class Evaluations:
    """How many times this process ran the request rules, by step (`screen`, `commit`): the
    metrics' `model_router_rule_evaluations_total`. `sink`, when set, hears each one as it happens."""

    __slots__ = ("counts", "sink")

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.sink: Callable[[str], None] | None = None

    def count(self, step: str) -> None:
        self.counts[step] += 1
        if self.sink is not None:
            self.sink(step)


EVALUATIONS = Evaluations()


def priority_level(figures: ModelFigures, priority: int | None) -> int:
    levels = figures.priority_levels
    if priority is None:
        return figures.default_priority
    if not 1 <= priority <= levels:
        raise InputError(f"X-Priority must be an integer from 1 to {levels}, got {priority}")
    return priority


def budget_s(figures: ModelFigures, timeout_ms: float | None) -> float:
    """The request's time budget in seconds: the model's queue timeout, or shorter if asked."""
    limit = figures.timeout_ms
    if timeout_ms is None:
        return limit / 1000.0
    if not timeout_ms > 0:
        raise InputError(f"X-Timeout-Ms must be a positive number of milliseconds, got {timeout_ms}")
    return min(timeout_ms, limit) / 1000.0


def has_room(figures: ModelFigures, items: int = 1, pending: int = 0) -> bool:
    """Room for `items` real requests: mirrored copies give theirs up to a real one."""
    return figures.occupancy - figures.shadow + pending + items <= figures.capacity


def check_room(figures: ModelFigures, items: int, pending: int = 0) -> None:
    """QueueFull if `items` more requests cannot all be taken now; PayloadTooLarge if they never can.
    `pending`: requests this caller is preparing that the figures do not count yet. Mirrored copies
    do not count: a real request takes the place of a queued one."""
    name, capacity = figures.name, figures.capacity
    if items > capacity:
        raise PayloadTooLarge(f"model {name!r} queues at most {capacity} requests; "
                              f"{items} items in one request can never fit")
    occupancy = figures.occupancy - figures.shadow + pending
    if occupancy + items > capacity:
        room = f"room for {max(0, capacity - occupancy)} of {items} items" if items > 1 else f"{capacity} requests"
        raise QueueFull(f"model {name!r} queue is full ({room}); retry later", retry_after_s=figures.retry_after_s)


def check_spare(figures: ModelFigures, items: int, pending: int = 0) -> None:
    """NoSpareCapacity unless a mirrored copy of `items` items fits in spare capacity now: no real
    item waits on the model's devices (where the figures know it) and the queue has room."""
    name = figures.name
    if figures.real_waiting:
        raise NoSpareCapacity(f"model {name!r}: {figures.real_waiting} real request(s) wait on its device; "
                              "a mirrored copy runs only in spare capacity")
    if figures.occupancy + pending + items > figures.capacity:
        raise NoSpareCapacity(f"model {name!r}: no room in its queue for a mirrored copy")


def check_gate(terms: Terms, figures: ModelFigures, now: float, *, pending: int = 0) -> GateDecision:
    """The deadline gate alone, for a request at the back of the queue: the decision, or the
    refusal raised (503, or 504 for a request that must finish)."""
    return _gate(terms, figures, now, pending)[0]


def _ahead(terms: Terms, figures: ModelFigures, pending: int) -> int:
    """Items queued ahead of the request: a real one goes before every mirrored copy."""
    return figures.occupancy + pending - (0 if terms.shadow else figures.shadow)


def _gate(terms: Terms, figures: ModelFigures, now: float, pending: int) -> tuple[GateDecision, Prediction | None]:
    deadline = min(terms.received_at, now) + budget_s(figures, terms.timeout_ms)
    position = _ahead(terms, figures, pending)
    forecast = figures.forecast
    prediction = None if forecast is None else forecast.predict(now, position)
    turn = half_open(figures.half_open_at, figures.half_open_interval_s, now, figures.last_sample_at)
    decision = deadline_gate(prediction, deadline - now, idle=figures.idle and pending == 0, half_open=turn,
                             strict=terms.must_finish)
    if decision.admit:
        return decision, prediction
    if terms.must_finish:
        raise DeadlineExceeded(f"model {figures.name!r} cannot answer before the deadline: {decision.reason}; "
                               "the input was not run")
    raise QueueFull(f"model {figures.name!r} is overloaded: {decision.reason}; retry later",
                    retry_after_s=decision.retry_after_s)


def screen(terms: Terms, figures: ModelFigures, now: float, *, pending: int = 0, gate: bool = True) -> Screened:
    """The screen: the rules where the request arrives, taking nothing; the request's `Screened`,
    or the RouterError that answers it. `pending`: requests this front prepares that the figures
    do not count yet. `gate`: apply the deadline gate (else the commit's alone)."""
    EVALUATIONS.count("screen")
    return Screened(terms, _decide(terms, figures, now, pending, gate).deadline, figures)


def admit(terms: Terms, figures: ModelFigures, now: float, *, pending: int = 0, gate: bool = True) -> Admission:
    """The commit's decision: take the request or raise the RouterError that answers it. `gate`:
    apply the deadline gate (a caller may leave it to a later decision). Pure: a half-open turn it
    grants is the caller's to take (`Admission.half_open`)."""
    EVALUATIONS.count("commit")
    return _decide(terms, figures, now, pending, gate)


def _decide(terms: Terms, figures: ModelFigures, now: float, pending: int, gate: bool) -> Admission:
    if figures.refusal is not None:
        raise figures.refusal.error()
    level = priority_level(figures, terms.priority)
    arrived = min(terms.received_at, now)
    deadline = arrived + budget_s(figures, terms.timeout_ms)
    if terms.shadow:
        return _decide_shadow(terms, figures, now, pending, gate, Admission(terms.model, level, arrived, deadline,
                                                                            _ahead(terms, figures, pending), shadow=True))
    check_room(figures, terms.items, pending)
    position = _ahead(terms, figures, pending)
    forecast = figures.forecast
    if not gate or (forecast is not None and now - figures.at > PREDICTION_FRESH_S):
        return Admission(terms.model, level, arrived, deadline, position)
    decision, prediction = _gate(terms, figures, now, pending)
    wait = prediction.answer_in_s if prediction is not None else None
    return Admission(terms.model, level, arrived, deadline, position, wait, decision.measure, decision.half_open)


def _decide_shadow(terms: Terms, figures: ModelFigures, now: float, pending: int, gate: bool,
                   admission: Admission) -> Admission:
    """A mirrored copy: spare capacity or NoSpareCapacity. It never takes the half-open turn (a real
    request's) and is never kept from being dropped as doomed at dispatch."""
    check_spare(figures, terms.items, pending)
    forecast = figures.forecast
    if not gate or (forecast is not None and now - figures.at > PREDICTION_FRESH_S):
        return admission
    try:
        decision, prediction = _gate(terms, figures, now, pending)
    except (QueueFull, DeadlineExceeded) as exc:
        raise NoSpareCapacity(f"model {figures.name!r}: a mirrored copy would not be answered in time "
                              f"({exc.detail})") from None
    if decision.half_open:
        raise NoSpareCapacity(f"model {figures.name!r}: the deadline gate's half-open turn is for real requests")
    wait = prediction.answer_in_s if prediction is not None else None
    return msgspec.structs.replace(admission, predicted_wait_s=wait)
