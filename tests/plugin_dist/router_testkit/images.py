"""Image plugins a pipeline test scripts, and a transform from a plugin distribution.

- `boxes`: a detector that answers the boxes its options list (or a grid of `count` boxes,
  a detector gone wild), after `fixed_ms`.
- `pixels`: a classifier that answers each image's size and mean colour, after `fixed_ms +
  per_item_ms * n`, fails to preprocess an image `fail_width` wide, and records each batch
  (`{"model", "sizes", "start", "end"}`, warm-up left out) in `record`.
- `halves`: a transform that cuts the image into its left and right halves.

Both plugins decode through the SDK, so inside a pipeline they take the router's crops as they are.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from router.sdk import (
    ACCEPTED_MEDIA_TYPES,
    DETECTIONS,
    PIXELS_MEDIA_TYPE,
    MemoryEstimate,
    ModelPlugin,
    NoOptions,
    Payload,
    StepItem,
    Transform,
    Transformed,
    decode_image,
    example_jpeg,
)

WARMUP_FILE = "example.jpg"  # example_jpeg()'s filename: what warm-up and timing batches are made of


class BoxesOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    boxes: list[list[float]] = Field(default_factory=list, description="[x1, y1, x2, y2, score] each")
    count: int = Field(0, ge=0, description="instead: a grid of this many 2x2 boxes, scores falling")
    fixed_ms: float = Field(0.0, ge=0)


@dataclass(frozen=True)
class Seen:
    width: int
    height: int
    mean: tuple[float, float, float]
    warm: bool


def _seen(payload: Payload) -> Seen:
    rgb = decode_image(payload)
    mean = rgb.reshape(-1, 3).mean(axis=0)
    return Seen(rgb.shape[1], rgb.shape[0], (float(mean[0]), float(mean[1]), float(mean[2])),
                payload.filename == WARMUP_FILE)


class BoxesPlugin(ModelPlugin[BoxesOptions]):
    Options: ClassVar[type[BaseModel]] = BoxesOptions
    accepts: ClassVar[tuple[str, ...]] = ACCEPTED_MEDIA_TYPES
    answers: ClassVar[str | None] = DETECTIONS

    def load(self, device: str) -> None:
        pass

    def preprocess(self, payload: Payload) -> Seen:
        return _seen(payload)

    def predict_batch(self, items: Sequence[Seen]) -> list[list[list[float]]]:
        time.sleep(self.options.fixed_ms / 1000)
        return [self._boxes() for _ in items]

    def _boxes(self) -> list[list[float]]:
        if not self.options.count:
            return [list(box) for box in self.options.boxes]
        return [[2.0 * (i % 100), 2.0 * (i // 100), 2.0 * (i % 100) + 2, 2.0 * (i // 100) + 2, 1.0 - i / (2 * self.options.count)]
                for i in range(self.options.count)]

    def postprocess(self, output: list[list[float]], item: Seen) -> dict[str, Any]:
        detections = [{"box": box[:4], "score": box[4], "class_id": 0, "label": "thing"} for box in output]
        return {"detections": detections, "image": {"width": item.width, "height": item.height}}

    def memory_estimate(self) -> MemoryEstimate:
        return MemoryEstimate(1_000_000, 1_000)

    def example_payload(self) -> Payload:
        return example_jpeg()


class PixelsOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    fixed_ms: float = Field(0.0, ge=0)
    per_item_ms: float = Field(0.0, ge=0)
    fail_width: int | None = Field(None, description="preprocess fails for an image this many pixels wide")
    record: str | None = None


class PixelsPlugin(ModelPlugin[PixelsOptions]):
    Options: ClassVar[type[BaseModel]] = PixelsOptions
    accepts: ClassVar[tuple[str, ...]] = ACCEPTED_MEDIA_TYPES
    answers: ClassVar[str | None] = "colours"

    def load(self, device: str) -> None:
        self._lock = threading.Lock()

    def preprocess(self, payload: Payload) -> Seen:
        seen = _seen(payload)
        if self.options.fail_width is not None and seen.width == self.options.fail_width:
            raise RuntimeError(f"scripted failure for an image {self.options.fail_width} pixels wide")
        return seen

    def predict_batch(self, items: Sequence[Seen]) -> list[Seen]:
        start = time.monotonic()
        time.sleep((self.options.fixed_ms + self.options.per_item_ms * len(items)) / 1000)
        if self.options.record is not None and not all(item.warm for item in items):
            line = json.dumps({"model": self.context.model_name, "sizes": [[i.width, i.height] for i in items],
                               "start": start, "end": time.monotonic()})
            with self._lock, open(self.options.record, "a", encoding="utf-8") as handle:
                handle.write(line + "\n")
        return list(items)

    def postprocess(self, output: Seen, item: Seen) -> dict[str, Any]:
        return {"width": output.width, "height": output.height, "mean": [round(c, 3) for c in output.mean]}

    def memory_estimate(self) -> MemoryEstimate:
        return MemoryEstimate(1_000_000, 1_000)

    def example_payload(self) -> Payload:
        return example_jpeg()


class HalvesTransform(Transform[NoOptions]):
    """The image's left and right halves, each answered under `halves`."""

    def apply(self, payload: Payload, answer: Any) -> Transformed:
        pixels: np.ndarray = payload.pixels if payload.pixels is not None else decode_image(payload)
        middle = pixels.shape[1] // 2
        halves = [{"side": "left"}, {"side": "right"}]
        items = [StepItem(Payload(b"", PIXELS_MEDIA_TYPE, pixels=pixels[:, :middle]), halves[0]),
                 StepItem(Payload(b"", PIXELS_MEDIA_TYPE, pixels=pixels[:, middle:]), halves[1])]
        return Transformed({**answer, "halves": halves} if isinstance(answer, dict) else {"halves": halves}, items)
