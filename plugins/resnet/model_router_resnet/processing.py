"""ImageNet classification pre- and post-processing, independent of what runs the network.

The eager `resnet` plugin and the engine plugins (`onnx`, `tensorrt`) share this code:
the resize, centre crop and normalisation of torchvision's ImageNet ResNet weights, on the CPU, then softmax and top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from router.sdk import DEFAULT_MAX_PIXELS, Payload, decode_image

__all__ = ["CROP", "MEAN", "RESIZE", "STD", "ClassifyProcessing", "TopK"]

# torchvision's ResNet*_Weights.IMAGENET1K_V1.transforms(): the tests hold us to it.
RESIZE = 256
CROP = 224
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class TopK:
    """One image's answer before formatting: probabilities and class ids, most likely first."""

    scores: torch.Tensor
    class_ids: torch.Tensor


@dataclass(frozen=True)
class ClassifyProcessing:
    """Resize the short side, centre-crop, normalise in; softmax, top-k and labels out."""

    top_k: int = 5
    labels: tuple[str, ...] = ()
    resize: int = RESIZE
    crop: int = CROP
    mean: tuple[float, float, float] = MEAN
    std: tuple[float, float, float] = STD
    max_pixels: int = DEFAULT_MAX_PIXELS

    @cached_property
    def _mean(self) -> torch.Tensor:
        return torch.tensor(self.mean).view(3, 1, 1)

    @cached_property
    def _std(self) -> torch.Tensor:
        return torch.tensor(self.std).view(3, 1, 1)

    def preprocess(self, payload: Payload) -> torch.Tensor:
        """Decode, resize the short side, centre-crop, scale to [0, 1], normalise: (3, crop, crop) float."""
        rgb = decode_image(payload, max_pixels=self.max_pixels)
        image: torch.Tensor = torch.from_numpy(rgb).permute(2, 0, 1)
        image = TF.resize(image, [self.resize], interpolation=InterpolationMode.BILINEAR, antialias=True)
        image = TF.center_crop(image, [self.crop])
        image = TF.convert_image_dtype(image, torch.float)
        return (image - self._mean) / self._std

    @staticmethod
    def network_input(items: Sequence[torch.Tensor], device: torch.device, *, half: bool = False) -> torch.Tensor:
        batch = torch.stack(list(items)).to(device)
        return batch.half() if half else batch

    def decode(self, logits: torch.Tensor) -> list[TopK]:
        """Softmax in fp32 and top-k where the logits are; results on the CPU, one per image."""
        scores, class_ids = logits.float().softmax(dim=1).topk(self.top_k, dim=1)
        scores, class_ids = scores.cpu(), class_ids.cpu()
        return [TopK(scores=s, class_ids=c) for s, c in zip(scores, class_ids, strict=True)]

    def postprocess(self, output: TopK, item: Any = None) -> dict[str, Any]:
        return {
            "top_k": [
                {"class_id": class_id, "label": self.labels[class_id], "score": score}
                for class_id, score in zip(output.class_ids.tolist(), output.scores.tolist(), strict=True)
            ]
        }
