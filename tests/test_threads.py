"""The thread plan: what the CPU pool, torch and OpenCV get, from the cores and the settings; and
the cyclic collector of a serving process."""

from __future__ import annotations

import gc

import cv2
import pytest
import torch

from router.serving.threads import (
    YOUNG_OBJECTS_PER_COLLECTION,
    ThreadCounts,
    apply_threads,
    available_cores,
    count_threads,
    settle_collector,
)


@pytest.mark.parametrize("cores, workers, torch_threads, expected", [
    (2, 0, 0, ThreadCounts(2, 2, 2)), (16, 0, 0, ThreadCounts(16, 16, 16)), (2, 1, 0, ThreadCounts(2, 1, 2)),
    (8, 3, 4, ThreadCounts(8, 3, 4)), (0, 0, 0, ThreadCounts(1, 1, 1)),
])
def test_settings_win_and_zero_means_every_core(cores: int, workers: int, torch_threads: int, expected: ThreadCounts) -> None:
    assert count_threads(cores, workers, torch_threads) == expected


def test_apply_sets_torch_and_the_cores_are_this_process_s() -> None:
    before = torch.get_num_threads()
    try:
        apply_threads(ThreadCounts(cores=2, cpu_workers=2, torch_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert 1 <= available_cores()


def test_opencv_decodes_single_threaded_inside_a_pool_thread() -> None:
    from router.sdk.images import _cv2

    assert _cv2() is cv2 and cv2.getNumThreads() == 1


def test_a_serving_process_collects_its_youngest_generation_less_often() -> None:
    """Above what the requests in flight hold alive; the older generations keep Python's ratios."""
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        settle_collector()
        assert gc.get_threshold() == (YOUNG_OBJECTS_PER_COLLECTION, 10, 10)
        assert YOUNG_OBJECTS_PER_COLLECTION > 700
    finally:
        gc.set_threshold(*before)
