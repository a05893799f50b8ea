"""How far two answers agree: classifier top-1, detector box F1, plain JSON, and the plugin hook."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from router.sdk import MemoryEstimate, ModelPlugin, NoOptions, Payload, PluginContext
from router.sdk.agreement import box_f1, default_agreement, iou, top1_agreement


def classes(*class_ids: int) -> dict[str, Any]:
    return {"top_k": [{"class_id": c, "label": f"c{c}", "score": 1.0 / (i + 1)} for i, c in enumerate(class_ids)]}


def boxes(*detections: tuple[list[float], float, int]) -> dict[str, Any]:
    return {"detections": [{"box": box, "score": score, "class_id": cls} for box, score, cls in detections]}


def test_top1_agreement() -> None:
    assert top1_agreement(classes(3, 1), classes(3, 2)) == 1.0
    assert top1_agreement(classes(3, 1), classes(1, 3)) == 0.0
    assert top1_agreement({"top_k": []}, {"top_k": []}) == 1.0
    assert top1_agreement({"top_k": []}, classes(1)) == 0.0
    assert top1_agreement(classes(1), {"label": "x"}) is None
    assert top1_agreement("cat", classes(1)) is None


def test_iou() -> None:
    assert iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert iou([0, 0, 10, 10], [10, 0, 20, 10]) == 0.0  # touching edges
    assert iou([0, 0, 2, 1], [0, 0, 1, 1]) == 0.5
    assert iou([0, 0, 0, 0], [0, 0, 0, 0]) == 0.0


def test_identical_and_disjoint_detections() -> None:
    answer = boxes(([0, 0, 10, 10], 0.9, 0), ([20, 20, 40, 40], 0.8, 1))
    assert box_f1(answer, answer) == 1.0
    assert box_f1(answer, boxes(([100, 100, 110, 110], 0.9, 0))) == 0.0


def test_partial_overlap_f1_by_hand() -> None:
    a = boxes(([0, 0, 10, 10], 0.9, 0), ([20, 20, 30, 30], 0.8, 0), ([50, 50, 60, 60], 0.7, 0))
    b = boxes(([0, 0, 10, 10], 0.5, 0),  # IoU 1 with a's first
              ([20, 20, 30, 35], 0.5, 0),  # IoU 100 / 150 = 0.67 with a's second
              ([50, 50, 60, 60], 0.5, 1))  # a's third's place, another class: no match
    assert box_f1(a, b) == pytest.approx(2 * 2 / (3 + 3))


def test_the_iou_threshold_is_inclusive() -> None:
    a, b = boxes(([0, 0, 2, 1], 0.9, 0)), boxes(([0, 0, 1, 1], 0.9, 0))  # IoU exactly 0.5
    assert box_f1(a, b, iou_threshold=0.5) == 1.0
    assert box_f1(a, b, iou_threshold=0.51) == 0.0


def test_a_box_matches_once_highest_score_first() -> None:
    a = boxes(([0, 0, 10, 10], 0.5, 0), ([0, 0, 10, 11], 0.9, 0))
    b = boxes(([0, 0, 10, 11], 0.7, 0))
    assert box_f1(a, b) == pytest.approx(2 * 1 / 3)


def test_empty_and_missing_detections() -> None:
    assert box_f1({"detections": []}, {"detections": []}) == 1.0
    assert box_f1({"detections": []}, boxes(([0, 0, 1, 1], 0.9, 0))) == 0.0
    assert box_f1({"detections": []}, {"top_k": []}) is None
    assert box_f1(None, {"detections": []}) is None


def test_default_agreement_by_shape() -> None:
    assert default_agreement(classes(1, 2), classes(1, 3)) == 1.0
    assert default_agreement(boxes(([0, 0, 1, 1], 0.9, 0)), {"detections": []}) == 0.0
    assert default_agreement({"text": "a", "n": [1, 2]}, {"text": "a", "n": [1, 2]}) == 1.0
    assert default_agreement({"text": "a"}, {"text": "b"}) == 0.0
    assert default_agreement(classes(1), {"detections": []}) == 0.0  # different shapes: nothing in common
    assert default_agreement(3, 3) == 1.0


class Echo(ModelPlugin[NoOptions]):
    def load(self, device: str) -> None:
        return None

    def preprocess(self, payload: Payload) -> Any:
        return payload.body

    def predict_batch(self, items: Sequence[Any]) -> Sequence[Any]:
        return list(items)

    def memory_estimate(self) -> MemoryEstimate:
        return MemoryEstimate(weights_bytes=0, per_item_bytes=0)


class Lenient(Echo):
    def agreement(self, answer: Any, other: Any) -> float | None:
        return 1.0


def test_the_plugin_hook_defaults_to_default_agreement_and_can_be_overridden(tmp_path: Path) -> None:
    context = PluginContext(model_name="echo", store_dir=tmp_path)
    plugin = Echo(NoOptions(), context)
    assert plugin.agreement(classes(1), classes(1)) == 1.0
    assert plugin.agreement(classes(1), classes(2)) == 0.0
    assert plugin.agreement({"detections": []}, {"detections": []}) == 1.0
    assert Lenient(NoOptions(), context).agreement(classes(1), classes(2)) == 1.0
