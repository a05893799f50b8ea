"""How long a model takes to answer, and whether a new request can still be answered in time.

Pure state and functions, driven with explicit timestamps (no clock of their own, no I/O):

- `BatchTime` estimates one instance's batch execution time `t(n) = fixed + per_item * n`. The
  shape comes from warm-up; real batches teach it a load factor (how much slower than warm-up
  the device runs now) and that factor's spread. With no fresh batch, factor and spread decay
  back to their priors, so an estimate taken during a burst cannot outlive the burst.
- `Lag` is the same kind of decaying average for the time from a batch's end to the answer.
- `predict_answer` turns what is queued and running into the time a new request would be answered.
- `deadline_gate` decides whether a new request is queued or refused (503) because it would
  miss its deadline. It can never lock a model out: an idle model always admits, and while it
  refuses, a bounded share of requests (one per `HalfOpenGate.interval_s`) is admitted anyway to
  measure, as a circuit breaker's half-open state does.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

__all__ = [
    "BatchTime",
    "Decaying",
    "DecayingTotal",
    "Forecast",
    "GateDecision",
    "HalfOpenGate",
    "InstanceLoad",
    "Lag",
    "Prediction",
    "deadline_gate",
    "half_open",
    "predict_answer",
]

#: Half-life of every learnt correction when no fresh sample arrives.
HALF_LIFE_S = 5.0
#: Spreads above this many mean deviations are treated as noise when predicting with a margin.
MARGIN_DEVIATIONS = 2.0
#: One batch can raise the load factor by at most this ratio over the present factor: a batch that
#: ran 10^6 times longer than warm-up (a hang, a stall, a warm-up that measured nothing) must not
#: make the deadline gate refuse everything for minutes, while a real slowdown is still learnt
#: within a few batches (each may move the factor up by 1.75x).
OUTLIER_RATIO = 4.0
#: The least relative spread a margin pads with: even a steady model meets scheduling jitter.
MIN_SPREAD = 0.05
#: Above this many batches ahead, prediction uses the instances' combined rate instead of stepping.
MAX_STEPPED_BATCHES = 256


def _decay(value: float, prior: float, since: float | None, now: float, half_life_s: float) -> float:
    """`value` moved toward `prior` by the time elapsed since `since`."""
    if since is None or now <= since:
        return value
    keep = math.pow(0.5, (now - since) / half_life_s)
    return prior + (value - prior) * keep


@dataclass
class Decaying:
    """A smoothed value that relaxes toward `prior` when nothing is observed."""

    prior: float = 0.0
    value: float = 0.0
    updated_at: float | None = None
    weight: float = 0.2  # share of a new sample in the average
    half_life_s: float = HALF_LIFE_S

    def at(self, now: float) -> float:
        return _decay(self.value, self.prior, self.updated_at, now, self.half_life_s)

    def observe(self, sample: float, now: float) -> None:
        current = self.at(now)
        self.value = current + self.weight * (sample - current) if self.updated_at is not None else sample
        self.updated_at = now


@dataclass
class DecayingTotal:
    """A running total that halves every `half_life_s`: recent use, for fair shares that a long
    history cannot skew (a model busy for an hour does not starve a newcomer for an hour)."""

    half_life_s: float = 10.0
    value: float = 0.0
    updated_at: float | None = None

    def at(self, now: float) -> float:
        return _decay(self.value, 0.0, self.updated_at, now, self.half_life_s)

    def add(self, amount: float, now: float) -> None:
        self.value = self.at(now) + amount
        self.updated_at = now


class Lag(Decaying):
    """Time from a batch's end to its answers (postprocessing, event-loop lag), decaying toward 0."""


@dataclass
class BatchTime:
    """One instance's batch execution time: `factor * (fixed_s + per_item_s * n)`.

    `seed` fixes the shape from warm-up timings (factor 1 = warm-up speed). `observe` learns the
    factor from real batches. Without samples the factor relaxes to 1 and its relative spread to
    `prior_spread`, with half-life `half_life_s`. Unseeded, the first real batch sets the shape.
    """

    fixed_s: float = 0.0
    per_item_s: float = 0.0
    seeded: bool = False
    source: str = "none"  # "warm-up", "first batch" or "none"
    factor: float = 1.0
    spread: float = 0.1
    prior_spread: float = 0.1
    updated_at: float | None = None
    samples: int = 0
    last_sample_at: float | None = None  # when a real batch last finished
    half_life_s: float = HALF_LIFE_S

    def seed(self, timings: Sequence[tuple[int, float]], source: str = "warm-up") -> None:
        """Fit the shape through (batch size, seconds) timings: the line through the smallest and
        largest sizes (the cost of an item can't be negative), or a constant for one size. Of
        several timings of one size the fastest counts: it is the idle device's speed, which the
        factor 1 stands for; a slower one met other work on the host (a busy core, a start-up),
        and a prior slower than the device lets the gate refuse what it could answer in time."""
        fastest: dict[int, float] = {}
        for n, s in timings:
            if n >= 1 and s > 0 and math.isfinite(s):
                fastest[n] = min(s, fastest.get(n, s))
        if not fastest:
            return
        usable = sorted(fastest.items())
        (n1, s1), (n2, s2) = usable[0], usable[-1]
        per_item = (s2 - s1) / (n2 - n1) if n2 > n1 else 0.0
        per_item = max(0.0, per_item)
        self.fixed_s = max(0.0, s1 - per_item * n1)
        self.per_item_s = per_item
        if self.fixed_s == 0.0 and per_item == 0.0:
            self.fixed_s = s1
        self.seeded = True
        self.source = source
        self.factor, self.spread, self.updated_at = 1.0, self.prior_spread, None

    def base_s(self, n: int) -> float:
        return self.fixed_s + self.per_item_s * max(1, n)

    def factor_at(self, now: float) -> tuple[float, float]:
        """The load factor and its relative spread, decayed to `now`."""
        factor = _decay(self.factor, 1.0, self.updated_at, now, self.half_life_s)
        spread = _decay(self.spread, self.prior_spread, self.updated_at, now, self.half_life_s)
        return factor, spread

    def seconds(self, n: int, now: float, margin: float = 0.0) -> float:
        """Expected time of a batch of n; with `margin` deviations of padding."""
        if not self.seeded:
            return 0.0
        factor, spread = self.factor_at(now)
        return self.base_s(n) * max(0.0, factor) * (1.0 + margin * max(spread, MIN_SPREAD))

    def observe(self, n: int, seconds: float, now: float) -> None:
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        self.samples += 1
        self.last_sample_at = now
        if not self.seeded:
            self.seed([(n, seconds)], source="first batch")
            self.updated_at = now
            return
        base = self.base_s(n)
        if base <= 0:
            return
        factor, spread = self.factor_at(now)
        ratio = min(seconds / base, OUTLIER_RATIO * max(factor, 1.0))
        self.spread = 0.75 * spread + 0.25 * abs(ratio - factor) / max(factor, 1e-9)
        self.factor = 0.75 * factor + 0.25 * ratio
        self.updated_at = now


@dataclass(frozen=True)
class InstanceLoad:
    """What prediction needs of one serving instance."""

    times: BatchTime
    busy_until: float | None = None  # expected end of its running batch; None when idle
    max_batch: int = 0  # its batch cap; 0: the model's


class Prediction(msgspec.Struct, frozen=True):
    """When a request queued now would be answered, and from what."""

    answer_in_s: float
    queued_ahead: int
    batches_ahead: int
    batch_s: float  # expected time of one full batch (with the margin)
    running_left_s: float  # until the first instance is free
    instances: int
    loading_s: float = 0.0  # until the model is loaded, when it is not yet

    def explain(self) -> str:
        running = f", after {self.running_left_s * 1000:.0f} ms left of the running batch" if self.running_left_s else ""
        loading = f", after about {self.loading_s * 1000:.0f} ms to load the model" if self.loading_s else ""
        return (
            f"an answer is predicted in about {self.answer_in_s * 1000:.0f} ms: {self.queued_ahead} request(s) "
            f"queued ahead make {self.batches_ahead} batch(es) of about {self.batch_s * 1000:.0f} ms on "
            f"{self.instances} instance(s){running}{loading}"
        )


class Forecast(msgspec.Struct, frozen=True, array_like=True):
    """When a request at queue position q would be answered, as a function of q and of the time:
    each instance's next free time, batch cap and batch time (with the margin), fixed at `at`.
    Computing it costs the estimates' decays; evaluating it (`predict`) is a little arithmetic, so
    the engine computes one per model while nothing changes, and the fronts evaluate the one it
    publishes, at their own position and time."""

    at: float
    free_at: tuple[float, ...]  # when each instance can start its next batch
    caps: tuple[int, ...]
    full_s: tuple[float, ...]  # a full batch on each
    fixed_s: tuple[float, ...]  # a batch of n: fixed_s + per_item_s * n
    per_item_s: tuple[float, ...]
    lag_s: float = 0.0
    max_delay_s: float = 0.0
    loading_s: float = 0.0  # the instances start after the model's load, expected to end at + loading_s

    @classmethod
    def of(cls, now: float, instances: Sequence[InstanceLoad], *, max_batch: int, max_delay_s: float,
           lag_s: float = 0.0, margin: float = MARGIN_DEVIATIONS, loading_s: float = 0.0) -> Forecast | None:
        """None when no instance has been timed yet (nothing to predict from)."""
        timed = [i for i in instances if i.times.seeded]
        if not timed:
            return None
        caps = tuple(max(1, i.max_batch or max_batch) for i in timed)
        scale = [_scale(i.times, now, margin) for i in timed]
        start = now + loading_s
        return cls(
            at=now,
            free_at=tuple(max(start, i.busy_until if i.busy_until is not None else start) for i in timed),
            caps=caps,
            full_s=tuple(i.times.base_s(cap) * k for i, cap, k in zip(timed, caps, scale, strict=True)),
            fixed_s=tuple(i.times.fixed_s * k for i, k in zip(timed, scale, strict=True)),
            per_item_s=tuple(i.times.per_item_s * k for i, k in zip(timed, scale, strict=True)),
            lag_s=max(0.0, lag_s), max_delay_s=max_delay_s, loading_s=loading_s,
        )

    def predict(self, now: float, queued_ahead: int) -> Prediction:
        """The answer of a request queued now behind `queued_ahead` others: the full batches ahead of
        it, each run on whichever instance frees first, then its own batch."""
        free = [max(now, at) for at in self.free_at]
        running_left = min(free) - now
        if len(free) == 1:  # one instance: the full batches ahead run back to back
            k = 0
            batches, remaining = divmod(queued_ahead, self.caps[0])
            at = free[0] + batches * self.full_s[0]
        else:
            at, k, batches, remaining = _step([(f, k) for k, f in enumerate(free)], self.caps, self.full_s,
                                              queued_ahead)
        own_size = remaining + 1
        # A request that waits for an instance (batches ahead, or one running) is batched when the
        # instance frees, with whatever arrived meanwhile: under load its batch is full by then, and
        # timing it at its size now let requests in that were then answered 504 at dispatch.
        if at > now + self.max_delay_s:
            own_size = self.caps[k]
        if own_size < self.caps[k]:
            at = max(at, now + self.max_delay_s)  # a batch that is not full waits for its delay
        answer_at = at + self.fixed_s[k] + self.per_item_s[k] * max(1, own_size) + self.lag_s
        loading = max(0.0, self.at + self.loading_s - now) if self.loading_s else 0.0
        return Prediction(answer_in_s=answer_at - now, queued_ahead=queued_ahead, batches_ahead=batches,
                          batch_s=min(self.full_s), running_left_s=max(0.0, running_left - loading),
                          instances=len(free), loading_s=loading)


def _scale(times: BatchTime, now: float, margin: float) -> float:
    """What `BatchTime.seconds` multiplies the base time by: the load factor and the margin, at `now`."""
    factor, spread = times.factor_at(now)
    return max(0.0, factor) * (1.0 + margin * max(spread, MIN_SPREAD))


def predict_answer(
    now: float,
    instances: Sequence[InstanceLoad],
    *,
    queued_ahead: int,
    max_batch: int,
    max_delay_s: float,
    lag_s: float = 0.0,
    margin: float = MARGIN_DEVIATIONS,
) -> Prediction | None:
    """Seconds until a request queued now would be answered (`Forecast.predict`). None when no
    instance serves or none has been timed yet (nothing to predict from)."""
    forecast = Forecast.of(now, instances, max_batch=max_batch, max_delay_s=max_delay_s, lag_s=lag_s, margin=margin)
    return None if forecast is None else forecast.predict(now, queued_ahead)


def _step(free: list[tuple[float, int]], caps: Sequence[int], full: Sequence[float],
          queued_ahead: int) -> tuple[float, int, int, int]:
    """Several instances: the full batches ahead, each on whichever instance frees first. Returns
    when and on which instance the request's own batch starts, the batches ahead and what is left
    of the queue for that batch."""
    heapq.heapify(free)
    remaining, batches = queued_ahead, 0
    while True:
        at, k = heapq.heappop(free)
        if remaining < caps[k]:
            return at, k, batches, remaining
        if batches >= MAX_STEPPED_BATCHES:  # far behind: the instances' combined rate is close enough
            rate = sum(cap / max(seconds, 1e-9) for cap, seconds in zip(caps, full, strict=True))
            return at + remaining / rate, k, batches + remaining // caps[k], remaining % caps[k]
        heapq.heappush(free, (at + full[k], k))
        remaining -= caps[k]
        batches += 1


@dataclass
class HalfOpenGate:
    """While the deadline gate refuses and nothing is being measured (no batch has finished for
    `interval_s`), let one request through every `interval_s` to measure. Under a real overload
    batches keep finishing, so the estimate is fresh and no request is let through against it."""

    interval_s: float = 0.5
    last_at: float | None = None
    half_opens: int = 0  # requests let through to measure

    def open(self, now: float, last_sample_at: float | None = None) -> bool:
        return half_open(self.last_at, self.interval_s, now, last_sample_at)

    def take(self, now: float) -> None:
        self.last_at = now
        self.half_opens += 1


def half_open(last_at: float | None, interval_s: float, now: float, last_sample_at: float | None) -> bool:
    """The gate lets one request through now: no batch finished within `interval_s` (the estimate
    is not being refreshed) and none was let through within it."""
    fresh = last_sample_at is not None and now - last_sample_at < interval_s
    return not fresh and (last_at is None or now - last_at >= interval_s)


class GateDecision(msgspec.Struct, frozen=True):
    admit: bool
    half_open: bool = False  # admitted against the prediction, to measure
    measure: bool = False  # admitted without a prediction's backing (idle, untimed, half-open): never dropped
    reason: str = ""  # as doomed at dispatch, so that its real answer time is seen
    retry_after_s: float = 1.0


def deadline_gate(prediction: Prediction | None, budget_s: float, *, idle: bool, half_open: bool,
                  strict: bool = False) -> GateDecision:
    """Admit unless the prediction says the answer would come after the deadline.

    An idle model (nothing queued, an instance free) always admits: its real answer time is
    then measured. A model with no timing yet admits. A refusing model whose gate is half-open
    (`HalfOpenGate.open`: its estimate is not being refreshed) admits the request anyway, to
    measure, so the estimate follows reality down as well as up; the caller then takes the gate's
    turn (`HalfOpenGate.take`), unless it is only looking (an early check before the body is read).
    With `strict` (a pipeline's later step, whose request has spent part of its time already) a
    prediction that misses refuses even an idle model, and nothing is let through to measure.
    """
    if strict and prediction is not None and prediction.answer_in_s > budget_s:
        return GateDecision(False, reason=f"{prediction.explain()}, more than the {budget_s * 1000:.0f} ms left",
                            retry_after_s=max(1.0, prediction.answer_in_s - budget_s))
    if idle:
        return GateDecision(True, measure=True, reason="idle")
    if prediction is None:
        return GateDecision(True, measure=True, reason="no timing yet")
    if prediction.answer_in_s <= budget_s:
        return GateDecision(True, reason="in time")
    if half_open:
        return GateDecision(True, half_open=True, measure=True, reason="half-open")
    retry = max(1.0, prediction.answer_in_s - budget_s)
    return GateDecision(
        False,
        reason=f"{prediction.explain()}, more than this request's {budget_s * 1000:.0f} ms deadline",
        retry_after_s=retry,
    )
