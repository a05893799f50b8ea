"""A model plugin that answers the mean colour of an image: the whole contract, nothing else."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from router.sdk import (
    ACCEPTED_MEDIA_TYPES,
    DEFAULT_MAX_PIXELS,
    MemoryEstimate,
    ModelPlugin,
    Payload,
    PluginContext,
    decode_image,
    example_jpeg,
)

SIDE = 32  # every image is sampled on a SIDE x SIDE grid, so any mix of sizes stacks into one batch


class MeanColourOptions(BaseModel):
    """`options:` of a `plugin: mean-colour` model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    decimals: int = Field(1, ge=0, le=6, description="decimals of each channel in the answer")
    max_pixels: int = Field(DEFAULT_MAX_PIXELS, ge=1, description="largest accepted image, in pixels (else 413)")


@dataclass(frozen=True)
class Sampled:
    """One image ready for the batch: a (SIDE, SIDE, 3) uint8 grid, and the image's size."""

    grid: np.ndarray
    width: int
    height: int


class MeanColourPlugin(ModelPlugin[MeanColourOptions]):
    Options: ClassVar[type[BaseModel]] = MeanColourOptions
    accepts: ClassVar[tuple[str, ...]] = ACCEPTED_MEDIA_TYPES  # JPEG, PNG, WebP, BMP

    def __init__(self, options: MeanColourOptions, context: PluginContext) -> None:
        super().__init__(options, context)  # sets self.options and self.context
        self.weights: np.ndarray | None = None

    def load(self, device: str) -> None:
        """On the instance's own thread, once. A real plugin reads its checkpoint here, with
        self.context.resolve_path(self.options.<file option>), and moves it to `device`."""
        if device != "cpu":
            raise ValueError(f"model {self.context.model_name!r}: mean-colour runs on the CPU only, got {device!r}")
        self.weights = np.full((1, SIDE * SIDE, 1), 1.0 / (SIDE * SIDE))  # the "network": an average

    def preprocess(self, payload: Payload) -> Sampled:
        """On a CPU pool thread, concurrently with other requests. decode_image answers 400 for a
        corrupt image, 413 above max_pixels (read from the header), 415 for another format."""
        rgb = decode_image(payload, max_pixels=self.options.max_pixels)
        height, width = rgb.shape[:2]
        rows = np.linspace(0, height - 1, SIDE).round().astype(int)
        cols = np.linspace(0, width - 1, SIDE).round().astype(int)
        return Sampled(rgb[rows][:, cols], width, height)

    def predict_batch(self, items: Sequence[Sampled]) -> list[np.ndarray]:
        """One batch at a time (on the instance's thread, or the loop when cheap): one output per item, in order."""
        assert self.weights is not None, "load() runs before any batch"
        batch = np.stack([item.grid for item in items]).reshape(len(items), SIDE * SIDE, 3).astype(np.float64)
        means = (batch * self.weights).sum(axis=1)  # (n, 3)
        return list(means)

    def postprocess(self, output: np.ndarray, item: Sampled) -> dict[str, Any]:
        """On a CPU pool thread: plain JSON types only."""
        rgb = [round(float(value), self.options.decimals) for value in output]
        hex_code = "#" + "".join(f"{round(float(value)):02x}" for value in output)
        return {"rgb": rgb, "hex": hex_code, "image": {"width": item.width, "height": item.height}}

    def describe_input(self, payload: Payload, item: Sampled) -> dict[str, Any]:
        """On the event loop, for the request's log line: keep it cheap."""
        return {"image_width": item.width, "image_height": item.height}

    def memory_estimate(self) -> MemoryEstimate:
        """After load, on the instance's thread: bytes held while loaded, and per input in a batch."""
        assert self.weights is not None
        per_item = SIDE * SIDE * 3 * (1 + 8)  # the uint8 grid and its float64 copy
        return MemoryEstimate(weights_bytes=self.weights.nbytes, per_item_bytes=per_item)

    def example_payload(self) -> Payload:
        """A valid input for warm-up (and, on CUDA, memory profiling): within this model's own max_pixels."""
        return example_jpeg(SIDE, SIDE)
