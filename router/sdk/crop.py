"""The built-in transforms: `crop` (one item per detected box, cut from the decoded image) and
`whole` (the image passed on as it is).

Crops are views into the image the router decoded once: nothing is encoded or decoded again.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from router.errors import InputError, brief
from router.sdk.images import decode_image
from router.sdk.plugin import DETECTIONS, PIXELS_MEDIA_TYPE, NoOptions, Payload
from router.sdk.transforms import StepItem, Transform, Transformed

__all__ = ["CropOptions", "CropPlan", "CropTransform", "WholeTransform", "plan_crops"]


class CropOptions(BaseModel):
    """`options:` of a `transform: crop` step."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    padding: float = Field(0.0, ge=0, le=1, description="each box grown on every side by this share of its width/height")
    min_size: int = Field(1, ge=1, le=65_536, description="crops narrower or lower than this many pixels are skipped")
    min_score: float = Field(0.0, ge=0, le=1, description="detections scoring below this are skipped")
    max_items: int = Field(32, ge=1, le=4096, description="at most this many crops, the top-scoring; the rest are dropped")


@dataclass(frozen=True)
class CropPlan:
    """Which detections become crops, where, and how many were left out and why."""

    kept: list[tuple[int, tuple[int, int, int, int]]]  # (index in the detections, (left, top, right, bottom))
    below_min_score: int = 0
    below_min_size: int = 0
    over_max_items: int = 0

    def counts(self) -> dict[str, int]:
        return {"kept": len(self.kept), "below_min_score": self.below_min_score,
                "below_min_size": self.below_min_size, "over_max_items": self.over_max_items}


def plan_crops(width: int, height: int, detections: Sequence[Any], options: CropOptions) -> CropPlan:
    """The crops of an image of width x height: each box padded, clipped to the image and rounded
    outwards to whole pixels; those scoring under `min_score` or smaller than `min_size` skipped;
    the `max_items` top-scoring kept (ties: the earlier detection), highest score first."""
    candidates: list[tuple[float, int, tuple[int, int, int, int]]] = []
    low = small = 0
    for index, detection in enumerate(detections):
        box, score = _box_and_score(detection, index)
        if score < options.min_score:
            low += 1
            continue
        rect = _rect(box, options.padding, width, height)
        if rect[2] - rect[0] < options.min_size or rect[3] - rect[1] < options.min_size:
            small += 1
            continue
        candidates.append((score, index, rect))
    candidates.sort(key=lambda c: (-c[0], c[1]))
    kept = [(index, rect) for _, index, rect in candidates[:options.max_items]]
    return CropPlan(kept, low, small, max(0, len(candidates) - options.max_items))


def _box_and_score(detection: Any, index: int) -> tuple[tuple[float, float, float, float], float]:
    """A detection's box and score, checked: the answer of a detector is not trusted blindly."""
    box = detection.get("box") if isinstance(detection, Mapping) else None
    score = detection.get("score") if isinstance(detection, Mapping) else None
    numbers = [*box, score] if isinstance(box, (list, tuple)) and len(box) == 4 else None
    if numbers is None or not all(isinstance(n, (int, float)) and not isinstance(n, bool) and math.isfinite(n)
                                  for n in numbers):
        raise InputError(f"detections[{index}] is not like {{\"box\": [x1, y1, x2, y2], \"score\": s}} with finite "
                         f"numbers, got {brief(detection)}")
    x1, y1, x2, y2 = (float(n) for n in box)  # type: ignore[union-attr]
    return (x1, y1, x2, y2), float(score)  # type: ignore[arg-type]


def _rect(box: tuple[float, float, float, float], padding: float, width: int, height: int) -> tuple[int, int, int, int]:
    x1, y1, x2, y2 = box
    pad_x, pad_y = (x2 - x1) * padding, (y2 - y1) * padding
    left, top = max(0, math.floor(x1 - pad_x)), max(0, math.floor(y1 - pad_y))
    right, bottom = min(width, math.ceil(x2 + pad_x)), min(height, math.ceil(y2 + pad_y))
    return left, top, max(left, right), max(top, bottom)


class CropTransform(Transform[CropOptions]):
    """`crop`: one item per detected box, cut out of the decoded image; the answer keeps the
    detections that were cropped (highest score first, each with its `crop_box`) and counts the
    others under `crop`."""

    Options: ClassVar[type[BaseModel]] = CropOptions
    needs: ClassVar[str | None] = DETECTIONS

    def apply(self, payload: Payload, answer: Any) -> Transformed:
        detections = answer.get("detections") if isinstance(answer, Mapping) else None
        if not isinstance(detections, list):
            raise InputError(f"crop needs an answer like {{\"detections\": [...]}}, got {brief(answer)}")
        pixels = decode_image(payload) if payload.pixels is None else payload.pixels
        height, width = pixels.shape[:2]
        plan = plan_crops(width, height, detections, self.options)
        kept = [{**detections[index], "crop_box": list(rect)} for index, rect in plan.kept]
        return Transformed({**answer, "detections": kept, "crop": plan.counts()}, _crops(pixels, kept))


def _crops(pixels: np.ndarray, kept: list[dict[str, Any]]) -> Iterator[StepItem]:
    for detection in kept:
        left, top, right, bottom = detection["crop_box"]
        yield StepItem(Payload(b"", PIXELS_MEDIA_TYPE, pixels=pixels[top:bottom, left:right]), detection)


class WholeTransform(Transform[NoOptions]):
    """`whole`: the step's input, the whole image, passed on as one item; the next answer is
    attached to this step's answer (an object; any other answer is wrapped as `{"result": ...}`)."""

    def apply(self, payload: Payload, answer: Any) -> Transformed:
        carried = dict(answer) if isinstance(answer, Mapping) else {"result": answer}
        return Transformed(carried, [StepItem(payload, carried)])
