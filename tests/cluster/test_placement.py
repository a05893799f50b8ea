"""plan_copies: how many copies of each model, and where, from plain reports."""

from __future__ import annotations

from router.cluster.placement import CopyPolicy, plan_copies
from router.cluster.reports import Command, ModelLoad, ReplicaReport

MB = 1_000_000


def load(resident: bool = True, *, held: bool = False, loading: bool = False, in_flight: int = 0,
         last_used: float | None = 1.0) -> ModelLoad:
    return ModelLoad(resident=resident, loading=loading, held=held, held_down=False, in_flight=in_flight,
                     queue_depth=0, weights_bytes=None, last_used_s_ago=last_used)


def report(replica: str, free_mb: int, **loads: ModelLoad) -> ReplicaReport:
    return ReplicaReport(replica, "gpu", "node", 1, "cuda:0", 100 * MB, free_mb * MB, False, loads)


def policy(minimum: int = 0, maximum: int = 2, target: float = 4, idle_s: float = 30) -> CopyPolicy:
    return CopyPolicy(minimum, maximum, target, idle_s)


def test_min_copies_are_placed_by_best_fit_biggest_model_first() -> None:
    reports = [report("a", 50), report("b", 30), report("c", 80)]
    plan = plan_copies(reports, {"big": policy(1), "small": policy(1)}, {"big": 45 * MB, "small": 25 * MB})
    # big (45) fits best on a (50 free: 5 left); small (25) then fits best on b (30: 5 left).
    assert plan.commands == (("a", Command("load", "big")), ("b", Command("load", "small")))


def test_min_copies_go_to_the_most_free_replica_when_none_has_room() -> None:
    plan = plan_copies([report("a", 10), report("b", 20)], {"m": policy(1)}, {"m": 60 * MB})
    assert plan.commands == (("b", Command("load", "m")),)


def test_missing_min_copies_are_added_in_one_round_on_distinct_replicas() -> None:
    plan = plan_copies([report("a", 90), report("b", 90), report("c", 90)], {"m": policy(2, 3)}, {"m": 10 * MB})
    assert sorted(r for r, _ in plan.commands) == ["a", "b"]


def test_a_copy_that_is_there_is_held_rather_than_loaded_again() -> None:
    plan = plan_copies([report("a", 50, m=load()), report("b", 90)], {"m": policy(1)}, {"m": 10 * MB})
    assert plan.commands == (("a", Command("load", "m")),)


def test_a_busy_model_gains_a_copy_only_in_free_memory() -> None:
    busy = {"m": policy(0, 2, target=4)}
    plan = plan_copies([report("a", 0, m=load(in_flight=20)), report("b", 50)], busy, {"m": 40 * MB})
    assert plan.commands == (("b", Command("load", "m")),)
    assert plan_copies([report("a", 0, m=load(in_flight=20)), report("b", 30)], busy, {"m": 40 * MB}).commands == ()


def test_no_more_copies_than_max_and_none_while_one_loads() -> None:
    hot = load(in_flight=50)
    assert plan_copies([report("a", 0, m=hot), report("b", 0, m=hot), report("c", 90)], {"m": policy(0, 2)},
                       {"m": MB}).commands == ()
    loading = load(resident=False, loading=True)
    assert plan_copies([report("a", 0, m=hot), report("b", 90, m=loading), report("c", 90)], {"m": policy(0, 3)},
                       {"m": MB}).commands == ()


def test_an_idle_model_shrinks_to_min_one_copy_a_round() -> None:
    idle = load(held=True, last_used=100.0)
    plan = plan_copies([report("a", 0, m=idle), report("b", 0, m=idle)], {"m": policy(1, 2, idle_s=30)}, {"m": MB})
    assert plan.commands == (("a", Command("release", "m", unload=True)),)
    assert plan_copies([report("a", 0, m=idle)], {"m": policy(1, 2, idle_s=30)}, {"m": MB}).commands == ()
    assert plan_copies([report("a", 0, m=load(last_used=100.0))], {"m": policy(0, 2, idle_s=30)},
                       {"m": MB}).commands == (("a", Command("release", "m", unload=True)),)


def test_a_used_copy_of_a_model_in_use_stays() -> None:
    used = load(in_flight=1, last_used=0.1)
    assert plan_copies([report("a", 0, m=used), report("b", 0, m=load(last_used=0.5))], {"m": policy(0, 2)},
                       {"m": MB}).commands == ()


def test_settling_models_are_left_alone() -> None:
    assert plan_copies([report("a", 90)], {"m": policy(1)}, {"m": MB}, settling={"m"}).commands == ()


def test_an_operators_unload_reaches_every_replica_holding_it() -> None:
    down = CopyPolicy(1, 2, 4, 30, held_down=True)
    plan = plan_copies([report("a", 0, m=load()), report("b", 0, m=load(resident=False))], {"m": down}, {"m": MB})
    assert plan.commands == (("a", Command("unload", "m")), ("b", Command("unload", "m")))
