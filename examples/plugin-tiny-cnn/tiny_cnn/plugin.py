"""A torch model plugin that runs where the fleet puts it: `cuda:N` when there is a GPU, or the CPU."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from router.sdk import (
    ACCEPTED_MEDIA_TYPES,
    DEFAULT_MAX_PIXELS,
    MemoryEstimate,
    ModelPlugin,
    Payload,
    PluginContext,
    activation_bytes,
    decode_image,
    device_index,
    example_jpeg,
    tensor_bytes,
)
from tiny_cnn.network import SIDE, TinyCnn


class TinyCnnOptions(BaseModel):
    """`options:` of a `plugin: tiny-cnn` model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weights: str = Field(description="checkpoint in the model store (`python -m tiny_cnn PATH` writes one)")
    top_k: int = Field(3, ge=1, description="classes returned per image, most likely first")
    max_pixels: int = Field(DEFAULT_MAX_PIXELS, ge=1, description="largest accepted image, in pixels (else 413)")


@dataclass(frozen=True)
class Prepared:
    """One image ready for the batch: (3, SIDE, SIDE) float32 in [0, 1], and the image's size."""

    pixels: np.ndarray
    width: int
    height: int


@dataclass(frozen=True)
class TopK:
    """One image's answer off the device: class ids and their probabilities, most likely first."""

    ids: np.ndarray
    scores: np.ndarray


class TinyCnnPlugin(ModelPlugin[TinyCnnOptions]):
    Options: ClassVar[type[BaseModel]] = TinyCnnOptions
    accepts: ClassVar[tuple[str, ...]] = ACCEPTED_MEDIA_TYPES
    torch_memory: ClassVar[bool] = True  # on cuda:N, warm-up may measure the per-item and fixed costs

    def __init__(self, options: TinyCnnOptions, context: PluginContext) -> None:
        super().__init__(options, context)
        self.weights_path = context.resolve_path(options.weights)
        self.device = torch.device("cpu")
        self.network: TinyCnn | None = None
        self.labels: tuple[str, ...] = ()  # from the checkpoint; a front process gets them by front_state()

    def load(self, device: str) -> None:
        """Read the checkpoint (weights_only: no code runs) and move the network to `device`."""
        self.device = torch.device(self._checked(device))
        try:
            checkpoint = torch.load(self.weights_path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise FileNotFoundError(f"model {self.context.model_name!r}: weights {str(self.weights_path)!r} not found; "
                                    "write them with `python -m tiny_cnn PATH`") from None
        self.labels = tuple(checkpoint["labels"])
        network = TinyCnn(len(self.labels))
        network.load_state_dict(checkpoint["state_dict"])
        self.network = network.eval().to(self.device)

    def _checked(self, device: str) -> str:
        """`device` if this machine has it; else an error naming the model, the device and what torch sees."""
        try:
            index = device_index(device)
        except ValueError as exc:
            raise ValueError(f"model {self.context.model_name!r}: {exc}") from None
        if index is not None and index >= torch.cuda.device_count():
            raise RuntimeError(f"model {self.context.model_name!r}: device {device!r} is not here: torch "
                               f"{torch.__version__} (CUDA build {torch.version.cuda}) sees "
                               f"{torch.cuda.device_count()} CUDA device(s); use device: cpu or one of those")
        return device

    def front_state(self) -> tuple[str, ...]:
        return self.labels  # what postprocess needs of the loaded checkpoint

    def adopt_front_state(self, state: tuple[str, ...]) -> None:
        self.labels = state

    def preprocess(self, payload: Payload) -> Prepared:
        """On a CPU pool thread: decode (400/413/415 from decode_image), resize, scale to [0, 1]."""
        rgb = decode_image(payload, max_pixels=self.options.max_pixels)
        height, width = rgb.shape[:2]
        small = np.asarray(Image.fromarray(rgb).resize((SIDE, SIDE), Image.Resampling.BILINEAR), dtype=np.float32)
        return Prepared(np.ascontiguousarray(small.transpose(2, 0, 1) / 255.0), width, height)

    def predict_batch(self, items: Sequence[Prepared]) -> list[TopK]:
        """One forward pass on the device; softmax and top-k there too, only the answers come back."""
        assert self.network is not None, "load() runs before any batch"
        batch = torch.from_numpy(np.stack([item.pixels for item in items])).to(self.device)
        with torch.inference_mode():
            scores, ids = self.network(batch).softmax(dim=1).topk(min(self.options.top_k, len(self.labels)), dim=1)
        scores_np, ids_np = scores.cpu().numpy(), ids.cpu().numpy()
        return [TopK(ids_np[row], scores_np[row]) for row in range(len(items))]

    def postprocess(self, output: TopK, item: Prepared) -> dict[str, Any]:
        top = [{"label": self.labels[int(i)], "class_id": int(i), "score": float(s)} for i, s in zip(output.ids, output.scores)]
        return {"top_k": top, "image": {"width": item.width, "height": item.height}}

    def describe_input(self, payload: Payload, item: Prepared) -> dict[str, Any]:
        return {"image_width": item.width, "image_height": item.height}

    def memory_estimate(self) -> MemoryEstimate:
        """Device bytes: the weights while loaded; per image, its upload and every layer's output."""
        assert self.network is not None
        weights = tensor_bytes([*self.network.parameters(), *self.network.buffers()])
        probe = torch.zeros((1, 3, SIDE, SIDE), device=self.device)
        per_item = tensor_bytes([probe]) + activation_bytes(self.network, probe)
        return MemoryEstimate(weights_bytes=weights, per_item_bytes=per_item, fixed_bytes=FIXED_BYTES)

    def example_payload(self) -> Payload:
        return example_jpeg(SIDE, SIDE)

    def unload(self) -> None:
        self.network = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the cached blocks back, so the device's measured use falls


#: Per batch, whatever its size: a margin for the kernels' scratch space (cuDNN workspaces, the CUDA
#: allocator's rounding to 2 MiB blocks). On cuda:N, warm-up measures both costs and replaces these.
FIXED_BYTES = 2 * 1024 * 1024
