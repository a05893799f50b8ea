"""A candidate version's rollout: the decision rule and its state machine, pure, with an injected clock.

The rule. The candidate's weight rises through the K steps of `RolloutConfig.steps`. Within a
step, the rule looks at the evidence L = 4 times: when the step's candidate answers reach 1/4,
1/2 and 3/4 of `min_samples` (early looks, which can only roll back), and at the step's end,
once it has lasted `step_min_s` and has `min_samples` candidate answers (the final look, which
rolls back, advances or, after the last step, promotes). At each look three one-sided tests
each get alpha / (3 K L), alpha being `false_alarm_rate` (Bonferroni; looks merged into one,
when the caller asks late, add their shares). Errors: Fisher's exact test, the candidate's
failures in this step against the stable version's in the same step (its contemporaries: load
drifts), or, when the step gave the stable fewer than `min_samples` answers (the last step, at
100%), its most recent 20,000: given F failures among N answers, the candidate's count is hypergeometric
under equal failure rates, and the rule rolls back when P(X >= f_c) <= the look's share.
Latency: the same exact test on answers slower than the pooled answers' 99th percentile (a
permutation test: under equal latency laws the labels of the slow answers are exchangeable).
Agreement, when comparisons with the stable version on the same inputs were observed: roll back
when Hoeffding's upper confidence bound on the step's mean agreement, mean + sqrt(ln(1/share) /
(2 m)), is below `min_agreement`. Stated false-alarm rate: a candidate with the stable's failure
rate and latency law and a mean agreement of at least `min_agreement` is rolled back with
probability at most `false_alarm_rate` over the whole rollout; an identical candidate agrees
1.0 everywhere, so its agreement bound never falls below `min_agreement` and only 2/3 of alpha
can be spent on it (defaults, alpha = 0.01: at most 0.67%; 1,000 simulated rollouts of an
identical candidate measure it). Detection: a candidate failing 20% of its requests against a
stable failing 1%, with the defaults, is rolled back at the first step's second look, within
min_samples / 2 = 100 candidate answers (5% of the traffic), in more than 99% of runs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from router.rollout_config import RolloutConfig

__all__ = ["LOOKS_PER_STEP", "REFERENCE_ANSWERS", "Decision", "Rollout", "SimulationResult", "hypergeom_tail",
           "simulate_rollouts"]

#: Looks at the evidence in each step: at 1/4, 1/2 and 3/4 of min_samples, and at the step's end.
LOOKS_PER_STEP = 4
#: Tests that share alpha at each look: errors, latency, agreement.
TESTS = 3
#: The stable version's most recent answers kept as the reference the candidate is compared with.
REFERENCE_ANSWERS = 20_000
#: Answers slower than this quantile of the pooled answers count as slow in the latency test.
SLOW_QUANTILE = 0.99

Status = Literal["running", "promoted", "rolled_back"]


@dataclass(frozen=True)
class Decision:
    """What a rollout decided: the split to apply now, the step it belongs to, why, and the figures."""

    action: Literal["step", "promote", "rollback"]
    weights: dict[str, float]
    step: int  # the step whose weights these are (the new one when advancing); the last look's otherwise
    reason: str
    figures: dict[str, Any] = field(default_factory=dict)


def hypergeom_tail(k: int, total: int, marked: int, drawn: int) -> float:
    """P(X >= k) for X the marked items among `drawn` of `total` items, `marked` of them marked.

    Exact above the mean; 1.0 at or below it, where P(X >= k) >= 1/2, so no test at alpha < 1/2 rejects.
    """
    high = min(marked, drawn)
    if k > high:
        return 0.0
    if total == 0 or k <= drawn * marked / total:
        return 1.0
    log_term = _log_comb(marked, k) + _log_comb(total - marked, drawn - k) - _log_comb(total, drawn)
    term = math.exp(log_term)
    tail = term
    for x in range(k, high):  # past the mode the terms only fall: stop once they no longer count
        term *= (marked - x) * (drawn - x) / ((x + 1) * (total - marked - drawn + x + 1))
        tail += term
        if term <= tail * 1e-17:
            break
    return min(tail, 1.0)


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def early_looks(min_samples: int) -> list[int]:
    """The candidate answers at which a step's early looks happen: 1/4, 1/2 and 3/4 of min_samples."""
    return [max(1, math.ceil(min_samples * i / LOOKS_PER_STEP)) for i in range(1, LOOKS_PER_STEP)]


class _Answers:
    """Answers of one version, in arrival order: whether each succeeded, and its latency.

    With `keep`, only the last `keep` count (a window); older ones are dropped as room is needed.
    """

    def __init__(self, keep: int | None = None) -> None:
        self._keep = keep
        self._ok = np.empty(1024, dtype=bool)
        self._latency = np.empty(1024, dtype=np.float64)
        self._n = 0

    def add(self, ok: bool, latency_s: float) -> None:
        self._room(1)
        self._ok[self._n], self._latency[self._n] = ok, latency_s
        self._n += 1

    def add_many(self, ok: np.ndarray, latency_s: np.ndarray) -> None:
        count = len(ok)
        self._room(count)
        self._ok[self._n : self._n + count] = ok
        self._latency[self._n : self._n + count] = latency_s
        self._n += count

    def _room(self, extra: int) -> None:
        if self._n + extra <= len(self._ok):
            return
        if self._keep is not None and self._n > self._keep:
            start = self._n - self._keep
            self._ok[: self._keep] = self._ok[start : self._n]
            self._latency[: self._keep] = self._latency[start : self._n]
            self._n = self._keep
        size = len(self._ok)
        while self._n + extra > size:
            size *= 2
        if size > len(self._ok):
            self._ok = np.concatenate([self._ok[: self._n], np.empty(size - self._n, dtype=bool)])
            self._latency = np.concatenate([self._latency[: self._n], np.empty(size - self._n)])

    def _window(self) -> slice:
        return slice(0 if self._keep is None else max(0, self._n - self._keep), self._n)

    def __len__(self) -> int:
        window = self._window()
        return window.stop - window.start

    def failures(self) -> int:
        return len(self) - int(np.count_nonzero(self._ok[self._window()]))

    def served_latencies(self) -> np.ndarray:
        """Latencies of the answers that succeeded: a failure's says nothing of the version's speed."""
        window = self._window()
        return self._latency[window][self._ok[window]]

    def clear(self) -> None:
        self._n = 0


class Rollout:
    """One name's rollout of a candidate version: observations in, decisions out (the caller applies them)."""

    def __init__(self, name: str, stable: str, config: RolloutConfig, clock: Callable[[], float]) -> None:
        if config.candidate == stable:
            raise ValueError(f"rollout of {name!r}: the candidate {config.candidate!r} is already the stable version")
        self.name, self.stable, self.config = name, stable, config
        self._clock = clock
        self._status: Status = "running"
        self._step = 0
        self._reference = _Answers(keep=REFERENCE_ANSWERS)
        self._step_reference = _Answers()  # the stable's answers in this step: the candidate's contemporaries
        self._candidate = _Answers()
        self._agreement_sum, self._agreements = 0.0, 0
        self._step_started = clock()
        self._early = early_looks(config.min_samples)
        self._early_done = 0
        self._alpha_look = config.false_alarm_rate / (len(config.steps) * LOOKS_PER_STEP * TESTS)
        self._last_look: dict[str, Any] = {}

    @property
    def status(self) -> Status:
        return self._status

    @property
    def step(self) -> int:
        return self._step

    @property
    def step_answers(self) -> int:
        """The candidate's answers in the current step."""
        return len(self._candidate)

    @property
    def step_elapsed_s(self) -> float:
        return self._clock() - self._step_started

    @property
    def weights(self) -> dict[str, float]:
        """The split the rollout wants now, in percent."""
        if self._status == "promoted":
            return {self.stable: 0.0, self.config.candidate: 100.0}
        if self._status == "rolled_back":
            return {self.stable: 100.0, self.config.candidate: 0.0}
        share = float(self.config.steps[self._step])
        return {self.stable: 100.0 - share, self.config.candidate: share}

    @property
    def state(self) -> dict[str, Any]:
        """Where the rollout stands, as plain values (for /models and /ui)."""
        return {
            "candidate": self.config.candidate,
            "stable": self.stable,
            "status": self._status,
            "step": self._step,
            "steps": list(self.config.steps),
            "weights": self.weights,
            "step_answers": self.step_answers,
            "step_failures": self._candidate.failures(),
            "step_elapsed_s": round(self.step_elapsed_s, 3),
            "reference_answers": len(self._reference),
            "reference_failures": self._reference.failures(),
            "agreements": self._agreements,
            "agreement_mean": self._agreement_sum / self._agreements if self._agreements else None,
            "last_look": dict(self._last_look),
        }

    def observe(self, version: str, ok: bool, latency_s: float) -> None:
        """One answered user request of the stable or the candidate version (others are ignored)."""
        for answers in self._answers_of(version):
            answers.add(ok, latency_s)

    def observe_many(self, version: str, ok: Sequence[bool] | np.ndarray, latency_s: Sequence[float] | np.ndarray) -> None:
        """Many answered requests of one version at once, in order."""
        for answers in self._answers_of(version):
            answers.add_many(np.asarray(ok, dtype=bool), np.asarray(latency_s, dtype=np.float64))

    def _answers_of(self, version: str) -> tuple[_Answers, ...]:
        if self._status != "running":
            return ()
        if version == self.config.candidate:
            return (self._candidate,)
        return (self._reference, self._step_reference) if version == self.stable else ()

    def _compared_with(self) -> _Answers:
        """The stable's answers the candidate's are compared with: those of the same step when it has
        as many as a step needs (load drifts: answers from another time would differ for that alone),
        else its most recent (a step that gives the stable few, as the last one at 100%)."""
        return self._step_reference if len(self._step_reference) >= self.config.min_samples else self._reference

    def observe_agreement(self, value: float) -> None:
        """One comparison of the candidate's answer with the stable's on the same input, 0.0 to 1.0."""
        if self._status == "running" and math.isfinite(value):
            self._agreement_sum += min(max(value, 0.0), 1.0)
            self._agreements += 1

    def decide(self) -> Decision | None:
        """What to do now: roll back, advance, promote, or None to hold. Cheap unless a look is due."""
        if self._status != "running":
            return None
        answers = len(self._candidate)
        early = sum(1 for at in self._early[self._early_done :] if at <= answers)
        final = answers >= self.config.min_samples and self.step_elapsed_s >= self.config.step_min_s
        if not early and not final:
            return None
        self._early_done += early
        looks = early
        if final:  # the final look, with the shares of early looks the step ended before
            looks += 1 + len(self._early) - self._early_done
            self._early_done = len(self._early)
        alpha = self._alpha_look * looks
        failed, figures = self._tests(alpha)
        self._last_look = figures
        if failed is not None:
            return self._end("rolled_back", failed, figures)
        if not final:
            return None
        if self._step + 1 == len(self.config.steps):
            return self._end("promoted", f"every step passed; version {self.config.candidate!r} is the stable one", figures)
        return self._advance(figures)

    def _tests(self, alpha: float) -> tuple[str | None, dict[str, Any]]:
        """The three tests at one look, each at `alpha`: the first that rejects, and every figure."""
        n_c, f_c = len(self._candidate), self._candidate.failures()
        reference = self._compared_with()
        n_s, f_s = len(reference), reference.failures()
        p_errors = hypergeom_tail(f_c, n_c + n_s, f_c + f_s, n_c)
        figures: dict[str, Any] = {
            "step": self._step, "alpha": alpha, "candidate_answers": n_c, "candidate_failures": f_c,
            "reference_answers": n_s, "reference_failures": f_s, "p_errors": p_errors,
        }
        figures.update(self._latency_test())
        if self._agreements:
            mean = self._agreement_sum / self._agreements
            bound = min(1.0, mean + math.sqrt(math.log(1 / alpha) / (2 * self._agreements)))
            figures.update(agreements=self._agreements, agreement_mean=mean, agreement_bound=bound)
        failed = None
        if p_errors <= alpha:
            failed, figures["test"] = (f"the candidate failed {f_c} of {n_c} answers against the stable's {f_s} of {n_s} "
                                       f"(p = {p_errors:.3g} <= {alpha:.3g})"), "errors"
        elif figures["p_latency"] <= alpha:
            failed, figures["test"] = (f"{figures['candidate_slow']} of the candidate's {figures['candidate_served']} "
                                       f"answers were slower than {figures['slow_s']:.4g} s against the stable's "
                                       f"{figures['reference_slow']} of {figures['reference_served']} "
                                       f"(p = {figures['p_latency']:.3g} <= {alpha:.3g})"), "latency"
        elif self._agreements and figures["agreement_bound"] < self.config.min_agreement:
            failed, figures["test"] = (f"the candidate's mean agreement with the stable is {figures['agreement_mean']:.3f} "
                                       f"over {self._agreements} comparisons, at most {figures['agreement_bound']:.3f} "
                                       f"< min_agreement {self.config.min_agreement}"), "agreement"
        return failed, figures

    def _latency_test(self) -> dict[str, Any]:
        """Answers slower than the pooled 99th percentile: the candidate's count against the stable's."""
        candidate, reference = self._candidate.served_latencies(), self._compared_with().served_latencies()
        if not len(candidate) or not len(reference):
            return {"p_latency": 1.0, "candidate_served": len(candidate), "reference_served": len(reference)}
        pooled = np.concatenate([candidate, reference])
        at = int(SLOW_QUANTILE * (len(pooled) - 1))
        slow_s = float(np.partition(pooled, at)[at])
        slow_c, slow = int(np.count_nonzero(candidate > slow_s)), int(np.count_nonzero(pooled > slow_s))
        return {"p_latency": hypergeom_tail(slow_c, len(pooled), slow, len(candidate)), "slow_s": slow_s,
                "candidate_served": len(candidate), "candidate_slow": slow_c,
                "reference_served": len(reference), "reference_slow": slow - slow_c}

    def _advance(self, figures: dict[str, Any]) -> Decision:
        passed = self._step
        self._step += 1
        self._candidate.clear()
        self._step_reference.clear()
        self._agreement_sum, self._agreements = 0.0, 0
        self._step_started = self._clock()
        self._early_done = 0
        reason = (f"step {passed} passed ({figures['candidate_answers']} candidate answers, "
                  f"{figures['candidate_failures']} failed); the candidate gets {self.config.steps[self._step]}%")
        return Decision("step", self.weights, self._step, reason, figures)

    def _end(self, status: Status, reason: str, figures: dict[str, Any]) -> Decision:
        self._status = status
        action: Literal["promote", "rollback"] = "promote" if status == "promoted" else "rollback"
        return Decision(action, self.weights, self._step, reason, figures)


@dataclass(frozen=True)
class SimulationResult:
    """What simulated rollouts ended in; for those rolled back, when and on what evidence."""

    runs: int
    promoted: int
    rolled_back: int
    undecided: int
    rollback_candidate_answers: tuple[int, ...]  # the candidate's answers over the whole rollout, per rolled-back run
    rollback_seconds: tuple[float, ...]  # virtual time from the start, per rolled-back run
    rollback_steps: tuple[int, ...]
    rollback_tests: dict[str, int]  # errors / latency / agreement -> rolled-back runs


class _VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class _Traffic:
    """The simulated requests: their rate, each version's failure rate and lognormal latency."""

    requests_per_s: float
    error_rate_stable: float
    error_rate_candidate: float
    latency_median_s: float
    latency_sigma: float
    candidate_latency_factor: float

    def answers(self, rng: np.random.Generator, count: int, candidate: bool) -> tuple[np.ndarray, np.ndarray]:
        rate = self.error_rate_candidate if candidate else self.error_rate_stable
        ok = rng.random(count) >= rate
        median = self.latency_median_s * (self.candidate_latency_factor if candidate else 1.0)
        return ok, median * np.exp(self.latency_sigma * rng.standard_normal(count))


def simulate_rollouts(
    config: RolloutConfig,
    *,
    runs: int,
    error_rate_stable: float,
    error_rate_candidate: float,
    requests_per_s: float,
    seed: int,
    latency_median_s: float = 0.05,
    latency_sigma: float = 0.5,
    candidate_latency_factor: float = 1.0,
) -> SimulationResult:
    """Drive `runs` rollouts with Poisson traffic split by their weights, on a virtual clock, seeded."""
    rng = np.random.default_rng(seed)
    traffic = _Traffic(requests_per_s, error_rate_stable, error_rate_candidate, latency_median_s, latency_sigma,
                       candidate_latency_factor)
    ended: Counter[str] = Counter()
    answers, seconds, steps, tests = [], [], [], Counter[str]()
    for _ in range(runs):
        decision, candidate_answers, elapsed = _simulate_one(config, traffic, rng)
        ended[decision.action if decision is not None else "undecided"] += 1
        if decision is not None and decision.action == "rollback":
            answers.append(candidate_answers)
            seconds.append(elapsed)
            steps.append(decision.step)
            tests[decision.figures.get("test", "")] += 1
    return SimulationResult(runs, ended["promote"], ended["rollback"], ended["undecided"], tuple(answers),
                            tuple(seconds), tuple(steps), dict(tests))


def _simulate_one(config: RolloutConfig, traffic: _Traffic, rng: np.random.Generator) -> tuple[Decision | None, int, float]:
    """One rollout to its end: its last decision, the candidate's answers and the virtual seconds it took."""
    clock = _VirtualClock()
    stable = "stable" if config.candidate != "stable" else "reference"
    rollout = Rollout("simulated", stable, config, clock)
    spacing = max(1, math.ceil(config.min_samples / LOOKS_PER_STEP))
    candidate_total = 0
    for _ in range(100_000):
        share = rollout.weights[config.candidate] / 100
        have = rollout.step_answers
        if have < config.min_samples:  # up to the next look: the stable's answers between are negative binomial
            n_c = min(spacing - have % spacing, config.min_samples - have)
            n_s = int(rng.negative_binomial(n_c, share)) if share < 1 else 0
            clock.now += float(rng.gamma(n_c + n_s, 1 / traffic.requests_per_s))
        else:  # the rest of the step's least time
            wait = max(config.step_min_s - rollout.step_elapsed_s, 0.0)
            arrivals = int(rng.poisson(traffic.requests_per_s * wait))
            n_c = int(rng.binomial(arrivals, share))
            n_s = arrivals - n_c
            clock.now += wait + 1e-9  # just past it, whatever the rounding of now - start
        rollout.observe_many(config.candidate, *traffic.answers(rng, n_c, candidate=True))
        rollout.observe_many(stable, *traffic.answers(rng, n_s, candidate=False))
        candidate_total += n_c
        decision = rollout.decide()
        if decision is not None and decision.action != "step":
            return decision, candidate_total, clock.now
    return None, candidate_total, clock.now
