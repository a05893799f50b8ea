"""The residency rule, driven with plain values: which models load and which are evicted."""

from __future__ import annotations

import random
from dataclasses import replace

from router.scheduling.residency import Occupant, plan_residency

MB = 1_000_000


def resident(key: str, *, weights: int = 100 * MB, last_used: float = 0.0, **kw: object) -> Occupant:
    return Occupant(key, key, "resident", weights, 10 * MB, last_used=last_used, **kw)  # type: ignore[arg-type]


def waiting(key: str, *, weights: int = 100 * MB, work: int = 1, **kw: object) -> Occupant:
    return Occupant(key, key, "absent", weights, 10 * MB, wanted=True, work=work, **kw)  # type: ignore[arg-type]


def plan(occupants: list[Occupant], *, budget: int = 250 * MB, committed: int | None = None, max_loads: int = 1,
         now: float = 100.0):  # type: ignore[no-untyped-def]
    if committed is None:
        committed = sum(o.weights_bytes for o in occupants if o.state in ("resident", "leaving"))
    return plan_residency(occupants, budget_bytes=budget, committed_bytes=committed, max_loads=max_loads, now=now)


def test_a_waiting_model_that_fits_is_loaded() -> None:
    result = plan([resident("a"), waiting("b")])
    assert result.loads == ("b",) and result.evictions == ()


def test_the_least_recently_used_idle_resident_makes_room_and_the_load_waits_for_its_memory() -> None:
    result = plan([resident("a", last_used=50.0), resident("b", last_used=10.0), waiting("c")])
    assert [(key, kind) for key, kind, _ in result.evictions] == [("b", "lru")]
    assert result.loads == ()  # memory comes back when the unload ends; the next plan loads c
    assert result.waiting == (("c", "waiting for evictions to return their memory"),)
    after = plan([resident("a", last_used=50.0), waiting("c")])
    assert after.loads == ("c",)


def test_pinned_and_busy_residents_are_not_evicted_while_deadlines_allow() -> None:
    occupants = [resident("always", on_demand=False, pinned=True), resident("busy", busy=True, work=3),
                 waiting("c", slack_s=5.0, load_s=0.5)]
    result = plan(occupants)
    assert result.evictions == () and result.loads == ()
    assert result.waiting == (("c", "no room: the residents are busy or pinned"),)


def test_a_waiting_request_near_its_deadline_evicts_the_resident_with_the_least_work() -> None:
    occupants = [resident("many", work=8, busy=True), resident("few", work=1, busy=True),
                 waiting("c", slack_s=0.6, load_s=0.5)]
    result = plan(occupants)
    assert [(key, kind) for key, kind, _ in result.evictions] == [("few", "deadline")]


def test_an_idle_on_demand_model_is_unloaded_after_idle_unload_s() -> None:
    idle = resident("a", last_used=40.0, idle_unload_s=60.0)
    assert plan([idle], now=99.0).evictions == ()
    assert [(k, kind) for k, kind, _ in plan([idle], now=100.0).evictions] == [("a", "idle")]
    assert plan([replace(idle, work=1)], now=200.0).evictions == ()  # in use: stays


def test_loads_are_single_flight_and_capped_per_device() -> None:
    loading = Occupant("a", "a", "loading", 50 * MB, 10 * MB, wanted=True, work=32)
    result = plan([loading, waiting("b", weights=50 * MB)], budget=1000 * MB, max_loads=1)
    assert result.loads == ()  # a is loading already (never planned twice); b waits for the slot
    assert result.waiting == (("b", "1 load(s) already running"),)
    two = plan([loading, waiting("b", weights=50 * MB)], budget=1000 * MB, max_loads=2)
    assert two.loads == ("b",)


def test_loads_in_progress_count_against_the_budget() -> None:
    loading = Occupant("a", "a", "loading", 200 * MB, 10 * MB)
    result = plan([loading, waiting("b")], budget=250 * MB, max_loads=4)
    assert result.loads == ()


def test_the_most_urgent_waiting_model_loads_first() -> None:
    result = plan([waiting("relaxed", slack_s=9.0, work=5), waiting("urgent", slack_s=1.0, work=1)],
                  budget=150 * MB)
    assert result.loads == ("urgent",)


def test_a_model_that_can_never_fit_is_reported() -> None:
    huge = waiting("huge", weights=300 * MB)
    assert plan([huge]).never_fits[0][0] == "huge"
    assert "over the device budget" in plan([huge]).never_fits[0][1]
    beside = plan([resident("always", weights=200 * MB, on_demand=False, pinned=True), waiting("b")])
    assert beside.never_fits[0][0] == "b" and "always-resident models hold" in beside.never_fits[0][1]


def test_a_model_leaving_with_work_is_reloaded_when_it_is_absent_again() -> None:
    leaving = Occupant("a", "a", "leaving", 100 * MB, 10 * MB, wanted=True, work=2)
    assert plan([leaving]).loads == ()  # still unloading: its memory is not back
    assert plan([replace(leaving, state="absent")], committed=0).loads == ("a",)


def test_residents_that_are_never_unloaded_when_idle_get_an_empty_plan_whatever_else_holds() -> None:
    """The device scheduler skips planning when every instance serves and none is unloaded when
    idle (`Deployment.steady`): that is sound only if such occupants always get an empty plan."""
    rng = random.Random(7)
    for _ in range(2000):
        occupants = []
        for i in range(rng.randint(1, 5)):
            on_demand = rng.random() < 0.5
            occupants.append(resident(
                f"m{i}", weights=rng.randint(1, 400) * MB, last_used=rng.uniform(0, 100), on_demand=on_demand,
                pinned=rng.random() < 0.3, busy=rng.random() < 0.3, work=rng.randint(0, 3),
                wanted=rng.random() < 0.3, slack_s=rng.choice([None, rng.uniform(-1, 5)]),
                idle_unload_s=None if on_demand else rng.choice([None, 5.0]),
            ))
        committed = rng.randint(0, 800) * MB  # the probe may see more held than the ledger booked
        result = plan(occupants, committed=committed, max_loads=rng.randint(0, 2))
        assert (result.loads, result.evictions, result.waiting, result.never_fits) == ((), (), (), ()), occupants
