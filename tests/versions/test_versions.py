"""Picking a version for a request, mirroring a copy of it, and what makes a route invalid."""

from __future__ import annotations

import math

import pytest

from router.errors import ModelNotFound
from router.serving.versions import VersionRoute, mirrors, pick, route_problems


def make_route(weights: dict[str, float], **extra: object) -> VersionRoute:
    return VersionRoute(name="resnet", versions=("1", "2", "3"), stable="1", weights=weights, **extra)  # type: ignore[arg-type]


def test_a_pinned_version_wins_over_the_split() -> None:
    route = make_route({"1": 100})
    assert pick(route, pinned="3", sticky_key="user-7", draw=0.0) == "3"
    assert pick(route, pinned="2", draw=0.5) == "2"  # pinned works even at weight 0


def test_an_unknown_pinned_version_is_a_404_naming_the_versions() -> None:
    with pytest.raises(ModelNotFound) as raised:
        pick(make_route({"1": 100}), pinned="9", draw=0.0)
    assert raised.value.status_code == 404
    assert "'resnet'" in raised.value.detail and "'9'" in raised.value.detail and "1, 2, 3" in raised.value.detail


def test_draws_fall_on_the_cumulative_weights_in_version_order() -> None:
    route = make_route({"1": 50, "2": 30, "3": 20})
    assert pick(route, draw=0.0) == "1"
    assert pick(route, draw=0.4999) == "1"
    assert pick(route, draw=0.5) == "2"
    assert pick(route, draw=0.7999) == "2"
    assert pick(route, draw=0.8) == "3"
    assert pick(route, draw=math.nextafter(1.0, 0.0)) == "3"


def test_weights_need_not_add_up_to_100() -> None:
    route = make_route({"1": 1, "3": 1})
    assert pick(route, draw=0.49) == "1"
    assert pick(route, draw=0.5) == "3"


def test_zero_weights_are_never_picked_and_all_zero_goes_to_the_stable() -> None:
    route = make_route({"1": 0, "2": 100, "3": 0})
    assert {pick(route, draw=i / 1000) for i in range(1000)} == {"2"}
    assert {pick(route, sticky_key=f"k{i}", draw=0.0) for i in range(1000)} == {"2"}
    assert pick(make_route({"1": 0, "2": 0}), draw=0.3) == "1"
    assert pick(make_route({}), draw=0.3) == "1"


def test_a_draw_outside_the_unit_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="got 1.0"):
        pick(make_route({"1": 100}), draw=1.0)
    with pytest.raises(ValueError, match="got -0.1"):
        pick(make_route({"1": 100}), draw=-0.1)


def test_a_sticky_key_always_gets_the_same_version_whatever_the_draw() -> None:
    route = make_route({"1": 50, "2": 30, "3": 20})
    for i in range(1000):
        key = f"user-{i}"
        first = pick(route, sticky_key=key, draw=0.0)
        assert pick(route, sticky_key=key, draw=0.99) == first
        assert pick(route, sticky_key=key, draw=0.5) == first


def test_sticky_keys_follow_the_weights_within_binomial_bounds() -> None:
    route = make_route({"1": 50, "2": 30, "3": 20})
    keys = 10_000
    counts = {version: 0 for version in route.versions}
    for i in range(keys):
        counts[pick(route, sticky_key=f"client-{i}", draw=0.0)] += 1
    for version, percent in route.weights.items():
        share = percent / 100
        slack = 4 * math.sqrt(keys * share * (1 - share))
        assert abs(counts[version] - keys * share) <= slack, (version, counts)


def test_mirrors_copies_the_mirrored_share_to_another_version() -> None:
    route = make_route({"1": 100}, mirror="2", mirror_percent=10.0)
    assert mirrors(route, "1", 0.0) == "2"
    assert mirrors(route, "1", 0.0999) == "2"
    assert mirrors(route, "1", 0.1) is None  # draw * 100 >= mirror_percent
    assert mirrors(route, "2", 0.0) is None  # already routed to the mirror
    assert mirrors(make_route({"1": 100}), "1", 0.0) is None  # no mirror
    assert mirrors(make_route({"1": 100}, mirror="2", mirror_percent=0.0), "1", 0.0) is None
    assert mirrors(make_route({"1": 100}, mirror="3", mirror_percent=100.0), "1", 0.9999) == "3"


def test_a_valid_route_has_no_problems() -> None:
    assert route_problems(make_route({"1": 90, "2": 10}, mirror="3", mirror_percent=5.0)) == []


def test_route_problems_name_each_bad_value() -> None:
    route = VersionRoute(name="resnet", versions=("1", "2"), stable="7", weights={"1": -5, "9": 10},
                         mirror="8", mirror_percent=150.0)
    problems = route_problems(route)
    assert len(problems) == 5, problems
    text = "\n".join(problems)
    for fragment in ("'9'", "-5", "stable version '7'", "mirror version '8'", "150.0"):
        assert fragment in text
    assert route_problems(make_route({"1": float("nan")}))
