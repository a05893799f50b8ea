"""Memory figures: the linear fit of profiled peaks, the batch limit with its margin, declared overrides."""

from __future__ import annotations

import pytest

from router.config import MemoryConfig
from router.sdk.plugin import MemoryEstimate
from router.serving.profiling import SAFETY_MARGIN, apply_declared, fit_linear, max_batch_within, profile_sizes


def test_fit_linear_recovers_fixed_and_per_item_from_exact_points() -> None:
    points = [(n, 5_000 + 1_200 * n) for n in (1, 2, 4, 8)]

    assert fit_linear(points) == (5_000, 1_200)


def test_fit_linear_clamps_negative_fixed_cost_to_zero() -> None:
    assert fit_linear([(1, 50), (2, 150), (4, 350)]) == (0, 100)


def test_fit_linear_clamps_negative_slope_to_zero() -> None:
    assert fit_linear([(1, 900), (2, 700), (4, 500)]) == (700, 0)


def test_fit_linear_with_one_point_is_all_per_item() -> None:
    assert fit_linear([(4, 1_000)]) == (0, 250)


def test_fit_linear_with_one_batch_size_repeated_has_no_slope() -> None:
    assert fit_linear([(2, 100), (2, 300)]) == (200, 0)


def test_fit_linear_needs_points() -> None:
    with pytest.raises(ValueError, match="no points"):
        fit_linear([])


def test_max_batch_within_keeps_a_safety_margin() -> None:
    estimate = MemoryEstimate(weights_bytes=1_000, per_item_bytes=100)

    # room 1000: 10 items would fit exactly, but 9 * 100 * 1.2 > 1000
    assert SAFETY_MARGIN == 0.2
    assert max_batch_within(estimate, budget=2_000, limit=64) == 8
    assert max_batch_within(estimate, budget=2_000, limit=64, margin=0.0) == 10


def test_max_batch_within_counts_the_fixed_cost() -> None:
    estimate = MemoryEstimate(weights_bytes=1_000, per_item_bytes=100, fixed_bytes=400)

    assert max_batch_within(estimate, budget=2_000, limit=64) == 4


def test_max_batch_within_respects_the_limit() -> None:
    estimate = MemoryEstimate(weights_bytes=1_000, per_item_bytes=100)

    assert max_batch_within(estimate, budget=2_000, limit=5) == 5


def test_max_batch_within_without_budget_is_the_limit() -> None:
    assert max_batch_within(MemoryEstimate(10**12, 10**12), budget=None, limit=7) == 7


def test_max_batch_within_is_zero_when_one_item_does_not_fit() -> None:
    estimate = MemoryEstimate(weights_bytes=1_000, per_item_bytes=100)

    assert max_batch_within(estimate, budget=1_100, limit=8) == 0


@pytest.mark.parametrize(
    ("max_size", "sizes"),
    [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 9])],
)
def test_profile_sizes_double_up_to_and_including_max(max_size: int, sizes: list[int]) -> None:
    assert profile_sizes(max_size) == sizes


def test_apply_declared_without_declarations_keeps_the_estimate() -> None:
    estimate = MemoryEstimate(1_000, 10, 5, source="estimate")

    assert apply_declared(estimate, MemoryConfig(budget="1GiB")) == estimate


def test_apply_declared_overrides_only_declared_fields() -> None:
    estimate = MemoryEstimate(weights_bytes=1_000, per_item_bytes=10, fixed_bytes=5)

    declared = apply_declared(estimate, MemoryConfig(per_item="1KiB"))

    assert declared == MemoryEstimate(weights_bytes=1_000, per_item_bytes=1024, fixed_bytes=5, source="declared")


def test_apply_declared_can_override_every_field() -> None:
    estimate = MemoryEstimate(weights_bytes=1_000, per_item_bytes=10, fixed_bytes=5)

    declared = apply_declared(estimate, MemoryConfig(weights="2MB", per_item=0, fixed="1kB"))

    assert declared == MemoryEstimate(2_000_000, 0, 1_000, source="declared")
