"""ImageNet classification pre- and post-processing, independent of what runs the network.

The eager `resnet` plugin and the engine plugins (`onnx`, `tensorrt`) share this code: the resize,
centre crop and normalisation of torchvision's ImageNet ResNet weights, then softmax and top-k.

The host pipeline: libjpeg-turbo decodes JPEGs (BGR, no conversion), torch's uint8 antialiased bilinear
kernel resizes the short side (the algorithm of the float reference, in fixed point: at most one
level in 255 apart, tests/plugins/test_parity.py), and the channels are swapped during the
normalisation of the 224 x 224 crop, the only float work. `decode: fast` lets libjpeg decode at
1/2, 1/4 or 1/8 scale while the image stays at least the resize target, with its fast inverse DCT
and upsampling; `device_decode` leaves
JPEGs encoded for a batched decode, resize and normalisation on a CUDA device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import torch

from router.sdk import (
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_PIXELS,
    ImageHeader,
    Payload,
    PayloadTooLarge,
    open_image,
)
from router.sdk.device_images import EncodedJpeg, decode_on_device, encoded_jpeg

__all__ = ["CROP", "MAX_RESIZED_BYTES", "MEAN", "RESIZE", "STD", "ClassifyItem", "ClassifyProcessing", "TopK", "resized_size"]

# torchvision's ResNet*_Weights.IMAGENET1K_V1.transforms(): the tests hold us to it.
RESIZE = 256
CROP = 224
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
#: The resized image (before the crop) of one input may take at most this much (uint8 RGB); with
#: the default aspect-ratio limit (20:1) a 256 px short side stays under 4 MB.
MAX_RESIZED_BYTES = 64 * 2**20

ClassifyItem = torch.Tensor | EncodedJpeg


@dataclass(frozen=True)
class TopK:
    """One image's answer before formatting: probabilities and class ids, most likely first."""

    scores: torch.Tensor
    class_ids: torch.Tensor


def resized_size(height: int, width: int, resize: int) -> tuple[int, int]:
    """(height, width) after torchvision's Resize(resize): the short side to `resize`, the long
    side scaled and truncated, as torchvision computes it."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = resize, int(resize * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


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
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO
    decode_mode: Literal["exact", "fast"] = "exact"
    device_decode: bool = False  # JPEGs stay encoded until network_input decodes them on the device

    @cached_property
    def _mean(self) -> torch.Tensor:
        return torch.tensor(self.mean).view(3, 1, 1)

    @cached_property
    def _std(self) -> torch.Tensor:
        return torch.tensor(self.std).view(3, 1, 1)

    def preprocess(self, payload: Payload) -> ClassifyItem:
        """Decode, resize the short side, centre-crop, scale to [0, 1], normalise: (3, crop, crop) float.
        With `device_decode`, a JPEG is only checked here and returned encoded."""
        image = open_image(payload, max_pixels=self.max_pixels, max_aspect_ratio=self.max_aspect_ratio)
        self.check_cost(image.header)
        if self.device_decode and (encoded := encoded_jpeg(image, payload.body)) is not None:
            return encoded
        fit = (self.resize, self.resize) if self.decode_mode == "fast" else None
        bgr = image.decode(channels="BGR", fit=fit)
        return self.normalise(self.resize_crop(torch.from_numpy(bgr).permute(2, 0, 1)), bgr=True)

    def check_cost(self, header: ImageHeader) -> None:
        """Refuse (413), from the header, an image whose resized copy would exceed MAX_RESIZED_BYTES."""
        height, width = resized_size(header.height, header.width, self.resize)
        if 3 * height * width > MAX_RESIZED_BYTES:
            raise PayloadTooLarge(
                f"image is {header.width}x{header.height}; resized to {width}x{height} it would take "
                f"{3 * height * width} bytes, over the limit of {MAX_RESIZED_BYTES}"
            )

    def resize_crop(self, image: torch.Tensor) -> torch.Tensor:
        """uint8 (3, H, W), any strides, on any device -> uint8 (3, crop, crop): torchvision's Resize
        (bilinear, antialiased) then CenterCrop. On the CPU the uint8 kernel runs directly (channels
        last); elsewhere it runs in float and rounds, as the reference does."""
        height, width = image.shape[-2:]
        new_height, new_width = resized_size(height, width, self.resize)
        if (new_height, new_width) != (height, width):
            batch = image.unsqueeze(0)
            if image.device.type != "cpu":
                batch = batch.float()
            batch = torch.nn.functional.interpolate(
                batch, size=(new_height, new_width), mode="bilinear", antialias=True, align_corners=False
            )
            image = batch[0] if batch.dtype == torch.uint8 else batch[0].round_().clamp_(0, 255).to(torch.uint8)
        top = round((new_height - self.crop) / 2.0)  # torchvision's center_crop rounding
        left = round((new_width - self.crop) / 2.0)
        return image[:, top : top + self.crop, left : left + self.crop]

    def normalise(self, image: torch.Tensor, *, bgr: bool = False) -> torch.Tensor:
        """uint8 (3, crop, crop) -> contiguous float, scaled to [0, 1] and normalised (RGB out)."""
        out = torch.empty(image.shape, dtype=torch.float32, device=image.device)
        out.copy_(image.flip(0) if bgr else image)
        mean, std = self._mean.to(image.device), self._std.to(image.device)
        return out.div_(255).sub_(mean).div_(std)

    def network_input(
        self, items: Sequence[ClassifyItem], device: torch.device, *, half: bool = False
    ) -> torch.Tensor:
        """The batch on `device`; JPEGs left encoded are decoded, resized and normalised there."""
        encoded = [item for item in items if isinstance(item, EncodedJpeg)]
        done = iter(self.normalise(self.resize_crop(image)) for image in decode_on_device(encoded, device))
        tensors = [next(done) if isinstance(item, EncodedJpeg) else item.to(device) for item in items]
        batch = torch.stack(tensors)
        return batch.half() if half else batch

    def decode_bytes(self) -> int:
        """Device memory one input's on-device decode and resize can take (0 without device decode)."""
        from router.sdk.device_images import DEVICE_DECODE_MAX_PIXELS

        return 3 * DEVICE_DECODE_MAX_PIXELS * 5 if self.device_decode else 0  # uint8 decode + its float copy

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
