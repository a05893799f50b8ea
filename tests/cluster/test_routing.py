"""rank_replicas: where a request goes, from plain replica views."""

from __future__ import annotations

from collections.abc import Iterable

from router.cluster.reports import RouteView
from router.cluster.routing import rank_replicas

MB = 1_000_000


def view(replica: str, resident: Iterable[str] = (), loading: Iterable[str] = (), free_mb: int = 0,
         draining: bool = False) -> RouteView:
    return RouteView(replica, frozenset(resident), frozenset(loading), free_mb * MB, draining)


def test_resident_replicas_come_first_as_one_rank_for_ray_to_pick_the_shortest_queue() -> None:
    views = [view("a", free_mb=90), view("b", {"m"}, free_mb=10), view("c", {"m"}, free_mb=5)]
    assert rank_replicas("m", views) == [["b", "c"], ["a"]]


def test_a_model_nobody_holds_goes_to_the_most_free_memory() -> None:
    views = [view("a", free_mb=10), view("b", free_mb=90), view("c", free_mb=50)]
    assert rank_replicas("m", views) == [["b"], ["c"], ["a"]]


def test_requests_follow_a_load_under_way_reported_or_claimed() -> None:
    views = [view("a", free_mb=90), view("b", loading={"m"}, free_mb=10)]
    assert rank_replicas("m", views)[0] == ["b"]
    assert rank_replicas("m", [view("a", free_mb=90), view("b", free_mb=10)], claim="b")[0] == ["b"]


def test_a_burst_of_first_requests_for_several_models_spreads_over_replicas() -> None:
    views = [view("a", free_mb=90), view("b", free_mb=90)]
    first = rank_replicas("m1", views)[0][0]
    second = rank_replicas("m2", views, claimed={first: 1})[0][0]
    assert {first, second} == {"a", "b"}


def test_ties_go_to_the_lower_id_so_routers_agree() -> None:
    assert rank_replicas("m", [view("b", free_mb=50), view("a", free_mb=50)])[0] == ["a"]


def test_refusers_and_draining_replicas_come_last_never_dropped() -> None:
    views = [view("a", {"m"}), view("b", free_mb=5), view("c", {"m"}, draining=True)]
    assert rank_replicas("m", views, avoid={"a"}) == [["b"], ["a", "c"]]
    assert rank_replicas("m", [view("a", {"m"})], avoid={"a"}) == [["a"]]
