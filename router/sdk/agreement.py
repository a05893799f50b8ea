"""How far two answers to the same input agree, from 1.0 (the same) to 0.0 (nothing in common).

A version rolled out beside the stable one, or sent mirrored copies of its requests, is compared
with it on the same inputs; the mean agreement is one of the figures a rollout decides on.
Classifier answers (`top_k`) agree when their top-1 classes are the same; detector answers
(`detections`) by the F1 score of their boxes matched by class and IoU; any other JSON answers
when they are equal. A plugin whose answers need another measure overrides
`ModelPlugin.agreement`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["box_f1", "default_agreement", "iou", "top1_agreement"]


def _listed(answer: Any, key: str) -> list[Any] | None:
    """`answer[key]` when the answer is a mapping holding a list there, else None."""
    if isinstance(answer, Mapping):
        value = answer.get(key)
        if isinstance(value, Sequence) and not isinstance(value, str | bytes):
            return list(value)
    return None


def top1_agreement(a: Any, b: Any) -> float | None:
    """1.0 when two classifier answers (`{"top_k": [...]}`) have the same top-1 class_id, else 0.0.

    None when either answer has no `top_k` list: there is nothing to compare. Two empty lists agree.
    """
    top_a, top_b = _listed(a, "top_k"), _listed(b, "top_k")
    if top_a is None or top_b is None:
        return None
    if not top_a or not top_b:
        return 1.0 if not top_a and not top_b else 0.0
    return 1.0 if top_a[0].get("class_id") == top_b[0].get("class_id") else 0.0


def iou(box_a: Sequence[float], box_b: Sequence[float]) -> float:
    """Intersection over union of two `[x1, y1, x2, y2]` boxes; 0.0 when the union is empty."""
    ax1, ay1, ax2, ay2 = (float(v) for v in box_a)
    bx1, by1, bx2, by2 = (float(v) for v in box_b)
    width = min(ax2, bx2) - max(ax1, bx1)
    height = min(ay2, by2) - max(ay1, by1)
    inter = width * height if width > 0 and height > 0 else 0.0
    union = max(ax2 - ax1, 0.0) * max(ay2 - ay1, 0.0) + max(bx2 - bx1, 0.0) * max(by2 - by1, 0.0) - inter
    return inter / union if union > 0 else 0.0


def box_f1(a: Any, b: Any, iou_threshold: float = 0.5) -> float | None:
    """The F1 score of two detector answers' boxes: 2 * matched / (boxes of a + boxes of b).

    Boxes of `a`, highest score first, each take the unmatched box of `b` with the same class_id
    and the highest IoU, when that IoU is at least `iou_threshold` (greedy, as detection benchmarks
    match). Two answers without boxes agree (1.0); None when either has no `detections` list.
    """
    boxes_a, boxes_b = _listed(a, "detections"), _listed(b, "detections")
    if boxes_a is None or boxes_b is None:
        return None
    if not boxes_a and not boxes_b:
        return 1.0
    unmatched = list(boxes_b)
    matched = 0
    for detection in sorted(boxes_a, key=lambda d: -float(d.get("score", 0.0))):
        best, best_iou = None, iou_threshold
        for index, other in enumerate(unmatched):
            if other.get("class_id") != detection.get("class_id"):
                continue
            overlap = iou(detection["box"], other["box"])
            if overlap >= best_iou:
                best, best_iou = index, overlap
        if best is not None:
            del unmatched[best]
            matched += 1
    return 2 * matched / (len(boxes_a) + len(boxes_b))


def default_agreement(a: Any, b: Any) -> float | None:
    """Top-1 agreement for classifier answers, box F1 for detector answers, equality for any other JSON."""
    if _listed(a, "top_k") is not None and _listed(b, "top_k") is not None:
        return top1_agreement(a, b)
    if _listed(a, "detections") is not None and _listed(b, "detections") is not None:
        return box_f1(a, b)
    return 1.0 if a == b else 0.0
