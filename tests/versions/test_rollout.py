"""The rollout decision rule and its state machine, on an injected clock, and its simulated error rates."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from router.rollout_config import RolloutConfig
from router.serving.rollout import Rollout, hypergeom_tail, simulate_rollouts


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_rollout(**settings: object) -> tuple[Rollout, Clock]:
    config = RolloutConfig(candidate="2", **{"steps": [10, 50, 100], "step_min_s": 30, "min_samples": 8, **settings})  # type: ignore[arg-type]
    clock = Clock()
    return Rollout("resnet", "1", config, clock), clock


def answers(rollout: Rollout, version: str, count: int, *, failures: int = 0, latency_s: float = 0.05) -> None:
    for i in range(count):
        rollout.observe(version, i >= failures, latency_s * (1 + (i % 7) / 100))


def test_the_config_names_bad_values() -> None:
    with pytest.raises(ValidationError, match="steps must increase"):
        RolloutConfig(candidate="2", steps=[50, 25])
    with pytest.raises(ValidationError, match="got 0.0"):
        RolloutConfig(candidate="2", steps=[0, 50])
    with pytest.raises(ValidationError, match="got 0.7"):
        RolloutConfig(candidate="2", false_alarm_rate=0.7)
    with pytest.raises(ValidationError, match="extra"):
        RolloutConfig(candidate="2", max_error_ratio=2)  # type: ignore[call-arg]
    assert RolloutConfig(candidate="2").steps == [5, 25, 50, 100]


def test_hypergeom_tail_is_exact_above_the_mean() -> None:
    total, marked, drawn = 40, 7, 12
    for k in range(9):
        exact = sum(math.comb(marked, x) * math.comb(total - marked, drawn - x)
                    for x in range(k, min(marked, drawn) + 1)) / math.comb(total, drawn)
        got = hypergeom_tail(k, total, marked, drawn)
        assert got == pytest.approx(exact, rel=1e-9) if k > drawn * marked / total else got == 1.0 >= exact


def test_a_candidate_cannot_be_the_stable_version() -> None:
    with pytest.raises(ValueError, match="already the stable"):
        Rollout("resnet", "2", RolloutConfig(candidate="2"), Clock())


def test_a_step_advances_only_after_its_least_time_and_its_samples() -> None:
    rollout, clock = make_rollout()
    assert rollout.weights == {"1": 90.0, "2": 10.0}
    answers(rollout, "1", 200)
    answers(rollout, "2", 7)
    clock.now += 60
    assert rollout.decide() is None  # time enough, 7 of 8 samples
    answers(rollout, "2", 1)
    decision = rollout.decide()
    assert decision is not None and decision.action == "step" and decision.step == 1
    assert decision.weights == {"1": 50.0, "2": 50.0}
    assert rollout.step_answers == 0  # the step's sample starts anew
    answers(rollout, "2", 50)
    clock.now += 29.9
    assert rollout.decide() is None  # samples enough, 29.9 of 30 s
    clock.now += 0.1
    decision = rollout.decide()
    assert decision is not None and (decision.action, decision.step) == ("step", 2)
    assert decision.weights == {"1": 0.0, "2": 100.0}


def test_the_candidate_is_promoted_after_the_last_step() -> None:
    rollout, clock = make_rollout()
    answers(rollout, "1", 300)
    actions = []
    for _ in range(3):
        answers(rollout, "2", 8)
        clock.now += 30
        decision = rollout.decide()
        assert decision is not None
        actions.append(decision.action)
    assert actions == ["step", "step", "promote"]
    assert rollout.status == "promoted" and rollout.weights == {"1": 0.0, "2": 100.0}
    assert rollout.decide() is None
    state = rollout.state
    assert state["status"] == "promoted" and state["step"] == 2
    json.dumps(state)  # plain values, for /models and /ui


def test_a_failing_candidate_is_rolled_back_early_with_reason_and_figures() -> None:
    rollout, _ = make_rollout(min_samples=40)
    answers(rollout, "1", 1000, failures=10)
    answers(rollout, "2", 10, failures=6)  # the first early look: 10 of 40 samples, long before the step's time
    decision = rollout.decide()
    assert decision is not None and decision.action == "rollback" and decision.step == 0
    assert decision.weights == {"1": 100.0, "2": 0.0}
    assert "failed 6 of 10" in decision.reason and "10 of 1000" in decision.reason
    assert decision.figures["test"] == "errors" and decision.figures["p_errors"] <= decision.figures["alpha"]
    assert rollout.status == "rolled_back" and rollout.decide() is None
    answers(rollout, "2", 5)
    assert rollout.state["step_answers"] == 10  # observations after the end are ignored


def test_a_slow_candidate_is_rolled_back_on_latency() -> None:
    rollout, clock = make_rollout()
    answers(rollout, "1", 1000)
    answers(rollout, "2", 8, latency_s=0.5)
    clock.now += 30
    decision = rollout.decide()
    assert decision is not None and decision.action == "rollback" and decision.figures["test"] == "latency"
    assert decision.figures["candidate_slow"] == 8


def test_a_disagreeing_candidate_is_rolled_back_and_an_agreeing_one_is_not() -> None:
    rollout, clock = make_rollout()
    answers(rollout, "1", 1000)
    answers(rollout, "2", 8)
    for _ in range(100):
        rollout.observe_agreement(0.3)
    clock.now += 30
    decision = rollout.decide()
    assert decision is not None and decision.action == "rollback" and decision.figures["test"] == "agreement"
    assert decision.figures["agreement_mean"] == pytest.approx(0.3)

    rollout, clock = make_rollout()
    answers(rollout, "1", 1000)
    answers(rollout, "2", 8)
    for _ in range(5):
        rollout.observe_agreement(1.0)
    clock.now += 30
    decision = rollout.decide()
    assert decision is not None and decision.action == "step"


def test_other_versions_do_not_count() -> None:
    rollout, _ = make_rollout()
    answers(rollout, "3", 100, failures=100)
    assert rollout.state["step_answers"] == 0 and rollout.state["reference_answers"] == 0


ALPHA = 0.01


def test_false_alarms_of_an_identical_candidate_stay_within_the_stated_rate() -> None:
    """(a) and (c): 1,000 rollouts of a candidate identical to the stable; every one ends, promoted unless a false alarm."""
    runs = 1000
    result = simulate_rollouts(RolloutConfig(candidate="2", false_alarm_rate=ALPHA), runs=runs, error_rate_stable=0.01,
                               error_rate_candidate=0.01, requests_per_s=50, seed=7)
    assert result.undecided == 0
    assert result.promoted + result.rolled_back == runs
    assert result.rolled_back <= runs * ALPHA + 3 * math.sqrt(runs * ALPHA * (1 - ALPHA))


def test_a_candidate_failing_20_percent_is_rolled_back_within_the_first_step() -> None:
    """(b): against a stable failing 1%, rolled back in >= 99% of runs within min_samples / 2 = 100 candidate answers."""
    result = simulate_rollouts(RolloutConfig(candidate="2"), runs=200, error_rate_stable=0.01, error_rate_candidate=0.2,
                               requests_per_s=50, seed=11)
    assert result.rolled_back >= 198
    assert all(step == 0 for step in result.rollback_steps)
    assert sorted(result.rollback_candidate_answers)[197] <= 100
    assert result.rollback_tests.get("errors", 0) >= 198


def test_a_slower_candidate_is_rolled_back_in_simulation() -> None:
    result = simulate_rollouts(RolloutConfig(candidate="2"), runs=50, error_rate_stable=0.01, error_rate_candidate=0.01,
                               requests_per_s=50, seed=3, candidate_latency_factor=3.0)
    assert result.rolled_back == 50 and result.rollback_tests == {"latency": 50}
