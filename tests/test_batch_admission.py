"""Batch admission (the pure rule): admit_batches and its helpers, driven with plain values."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.scheduling.batch_admission import AdmittedBatch, Candidate, DeviceState, admit_batches, fits, largest_fitting

AMPLE = 1_000_000


def cand(
    model: str,
    *,
    share: float = 0.0,
    instance: str | None = None,
    queued: int = 8,
    max_batch: int = 8,
    per_item: int = 100,
    fixed: int = 0,
    model_budget: int | None = None,
    model_bytes: int = 0,
) -> Candidate:
    return Candidate(
        model=model,
        instance=instance or f"{model}/0",
        queued=queued,
        max_batch=max_batch,
        per_item_bytes=per_item,
        fixed_bytes=fixed,
        model_budget=model_budget,
        model_bytes=model_bytes,
        share=share,
    )


def device(budget: int = 1000, used: int | None = 0, reserved: int = 0, *, paused: bool = False) -> DeviceState:
    return DeviceState(budget_bytes=budget, used_bytes=used, reserved_bytes=reserved, paused=paused)


def test_admits_full_batch_within_budget() -> None:
    plan = admit_batches([cand("a", queued=5, max_batch=8, per_item=100, fixed=20)], device(budget=1000))

    assert plan.admits == [AdmittedBatch("a", "a/0", 5, 520)]
    assert plan.blocked is None
    assert not plan.paused


def test_batch_shrinks_to_largest_size_that_fits() -> None:
    # free = 1000 - 500 used - 100 reserved = 400; 50 + 3 * 100 fits, 50 + 4 * 100 does not
    plan = admit_batches([cand("a", per_item=100, fixed=50)], device(budget=1000, used=500, reserved=100))

    assert plan.admits == [AdmittedBatch("a", "a/0", 3, 350)]


def test_largest_fitting_counts_fixed_cost_and_caps_at_want() -> None:
    c = cand("a", per_item=100, fixed=50)

    assert largest_fitting(c, want=8, room=349) == 2
    assert largest_fitting(c, want=8, room=350) == 3
    assert largest_fitting(c, want=2, room=10_000) == 2
    assert largest_fitting(c, want=8, room=149) == 0
    assert largest_fitting(c, want=8, room=-500) == 0


def test_largest_fitting_with_no_per_item_cost_is_all_or_nothing() -> None:
    c = cand("a", per_item=0, fixed=300)

    assert largest_fitting(c, want=6, room=300) == 6
    assert largest_fitting(c, want=6, room=299) == 0


def test_fits_checks_model_budget_and_device_budget() -> None:
    dev = device(budget=1000, used=999)  # live usage is irrelevant: "could ever fit"

    assert fits(cand("a", per_item=100, model_budget=700, model_bytes=600), 1, dev)
    assert not fits(cand("a", per_item=101, model_budget=700, model_bytes=600), 1, dev)
    assert fits(cand("a", per_item=1000), 1, dev)
    assert not fits(cand("a", per_item=1001), 1, dev)


@pytest.mark.parametrize(
    "head_budget",
    [
        pytest.param(AMPLE, id="head-has-model-budget"),
        pytest.param(None, id="head-has-no-model-budget"),
    ],
)
def test_head_that_cannot_fit_one_item_blocks_everyone_behind_it(head_budget: int | None) -> None:
    candidates = [
        cand("late", share=2.0, per_item=10),
        cand("big", share=1.0, per_item=450, model_budget=head_budget),
        cand("early", share=0.0, queued=1, per_item=100),
    ]

    plan = admit_batches(candidates, device(budget=1000, used=500))  # free 500, then 400 after "early"

    assert plan.admits == [AdmittedBatch("early", "early/0", 1, 100)]
    assert plan.blocked == "big"
    assert "big" in plan.reason


def test_candidate_held_back_only_by_its_own_budget_does_not_block_others() -> None:
    capped = cand("capped", share=0.0, per_item=100, model_budget=1000, model_bytes=950)
    other = cand("other", share=1.0, queued=2, per_item=100)

    plan = admit_batches([capped, other], device(budget=1000, used=0))

    assert plan.blocked is None
    assert plan.admits == [AdmittedBatch("other", "other/0", 2, 200)]


def test_model_budget_is_shared_by_two_instances_of_one_model() -> None:
    # model room = 1000 - 600 weights = 400: both instances together get at most 4 items
    a0 = cand("a", instance="a/0", queued=20, max_batch=3, model_budget=1000, model_bytes=600)
    a1 = cand("a", instance="a/1", queued=20, max_batch=3, model_budget=1000, model_bytes=600)

    plan = admit_batches([a1, a0], device(budget=AMPLE))

    assert plan.admits == [AdmittedBatch("a", "a/0", 3, 300), AdmittedBatch("a", "a/1", 1, 100)]


def test_two_instances_never_admit_more_than_queued_in_total() -> None:
    a0 = cand("a", instance="a/0", queued=5, max_batch=4)
    a1 = cand("a", instance="a/1", queued=5, max_batch=4)

    plan = admit_batches([a0, a1], device(budget=AMPLE))

    assert [(a.instance, a.size) for a in plan.admits] == [("a/0", 4), ("a/1", 1)]


def test_lower_share_goes_first() -> None:
    served_more = cand("aaa", share=5.0, queued=1, per_item=600)
    served_less = cand("zzz", share=1.0, queued=1, per_item=600)

    plan = admit_batches([served_more, served_less], device(budget=1000))

    assert [a.model for a in plan.admits] == ["zzz"]


def test_equal_share_order_is_deterministic() -> None:
    candidates = [cand(name, share=1.0, queued=1, per_item=400) for name in ("b", "c", "a")]

    plans = {tuple(admit_batches(list(p), device(budget=1000)).admits) for p in itertools.permutations(candidates)}

    assert plans == {(AdmittedBatch("a", "a/0", 1, 400), AdmittedBatch("b", "b/0", 1, 400))}


@pytest.mark.parametrize(
    ("used", "was_paused", "paused"),
    [
        (899, False, False),
        (900, False, True),  # reaches the high watermark
        (850, False, False),
        (850, True, True),  # between the marks: stays paused
        (801, True, True),
        (800, True, False),  # back down to the low watermark: resumes
    ],
)
def test_watermark_hysteresis(used: int, was_paused: bool, paused: bool) -> None:
    dev = DeviceState(budget_bytes=1000, used_bytes=used, reserved_bytes=0, high_watermark=0.9,
                      low_watermark=0.8, paused=was_paused)

    plan = admit_batches([cand("a", queued=1, per_item=10)], dev)

    assert plan.paused is paused
    assert len(plan.admits) == (0 if paused else 1)
    assert ("watermark" in plan.reason) is paused


def test_missing_reading_pauses_admission_with_a_reason() -> None:
    plan = admit_batches([cand("a", queued=1, per_item=1)], device(used=None))

    assert plan.paused
    assert plan.admits == []
    assert "probe" in plan.reason


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Candidate], DeviceState]:
    candidates = []
    for m in range(draw(st.integers(1, 3))):
        name = f"m{m}"
        per_item, fixed = draw(st.integers(0, 400)), draw(st.integers(0, 400))
        model_budget = draw(st.none() | st.integers(0, 4000))
        model_bytes, queued = draw(st.integers(0, 2000)), draw(st.integers(0, 20))
        max_batch, share = draw(st.integers(1, 8)), draw(st.floats(0, 10))
        for i in range(draw(st.integers(1, 2))):
            candidates.append(Candidate(name, f"{name}/{i}", queued, max_batch, per_item, fixed,
                                        model_budget, model_bytes, share))
    dev = DeviceState(
        budget_bytes=draw(st.integers(1, 5000)),
        used_bytes=draw(st.none() | st.integers(0, 6000)),
        reserved_bytes=draw(st.integers(0, 3000)),
        paused=draw(st.booleans()),
    )
    return draw(st.permutations(candidates)), dev


@given(scenarios())
def test_plans_never_exceed_device_or_model_budgets(scenario: tuple[list[Candidate], DeviceState]) -> None:
    candidates, dev = scenario
    plan = admit_batches(candidates, dev)
    by_instance = {c.instance: c for c in candidates}

    if dev.used_bytes is None or plan.paused:
        assert plan.admits == []
        return
    if plan.admits:  # the state may start over budget; a plan must never add to that
        assert dev.used_bytes + dev.reserved_bytes + sum(a.reserve_bytes for a in plan.admits) <= dev.budget_bytes
    for model in {c.model for c in candidates}:
        mine = [a for a in plan.admits if a.model == model]
        first = next(c for c in candidates if c.model == model)
        assert sum(a.size for a in mine) <= first.queued
        if first.model_budget is not None and mine:
            assert first.model_bytes + sum(a.reserve_bytes for a in mine) <= first.model_budget
    for a in plan.admits:
        c = by_instance[a.instance]
        assert 1 <= a.size <= min(c.max_batch, c.queued)
        assert a.reserve_bytes == c.batch_bytes(a.size)


# --- how many batches run at once on a device ----------------------------------------------------


def limited(running: int, limit: int | None) -> DeviceState:
    return DeviceState(budget_bytes=AMPLE, used_bytes=0, reserved_bytes=0, running_batches=running,
                       max_concurrent_batches=limit)


def test_a_device_at_its_batch_limit_admits_nothing_and_is_neither_paused_nor_blocked() -> None:
    plan = admit_batches([cand("a"), cand("b")], limited(running=1, limit=1))

    assert plan.admits == [] and not plan.paused and plan.blocked is None
    assert "limit is 1" in plan.reason


def test_the_batch_limit_admits_in_fair_order_up_to_the_free_slots() -> None:
    candidates = [cand("a", share=3.0), cand("b", share=1.0), cand("c", share=2.0)]

    plan = admit_batches(candidates, limited(running=1, limit=3))

    assert [a.model for a in plan.admits] == ["b", "c"]


def test_no_limit_admits_every_candidate_that_fits() -> None:
    candidates = [cand("a"), cand("b"), cand("c")]

    assert len(admit_batches(candidates, limited(running=5, limit=None)).admits) == 3


@given(running=st.integers(0, 6), limit=st.integers(1, 6), count=st.integers(0, 6))
def test_admitted_plus_running_never_exceeds_the_limit(running: int, limit: int, count: int) -> None:
    candidates = [cand(f"m{i}", share=float(i)) for i in range(count)]

    plan = admit_batches(candidates, limited(running=running, limit=limit))

    assert len(plan.admits) == max(0, min(count, limit - running))


@pytest.mark.parametrize("device_name, setting, expected", [
    ("cpu", None, 1), ("cuda:0", None, None), ("cpu", 3, 3), ("cuda:1", 2, 2),
])
def test_the_limit_in_force_defaults_to_one_on_the_cpu_and_none_on_gpus(
    device_name: str, setting: int | None, expected: int | None
) -> None:
    from router.config import DeviceConfig

    assert DeviceConfig(max_concurrent_batches=setting).concurrent_batch_limit(device_name) == expected
