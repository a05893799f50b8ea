"""JPEG decoding on the model's device, in batches (nvJPEG on CUDA through torchvision.io).

A plugin that offers it keeps each JPEG encoded in `preprocess` (after `open_image` has checked
its header: format, pixel limit, aspect ratio) as an `EncodedJpeg`, and decodes the batch on the
device in `predict_batch`. Everything else (PNG, WebP, BMP, CMYK JPEGs, JPEGs over
`DEVICE_DECODE_MAX_PIXELS`, instances on the CPU) is decoded on the host as usual. The same code
runs with device="cpu", which is how it is tested without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from router.sdk.images import ImageHeader, OpenedImage

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEVICE_DECODE_MAX_PIXELS",
    "EncodedJpeg",
    "decode_on_device",
    "device_decode_available",
    "encoded_jpeg",
    "orient_chw",
    "use_device_decode",
]

log = logging.getLogger("router.sdk.device_images")

#: Larger JPEGs decode on the host: the device's per-input memory stays bounded (12 MP, a phone photo).
DEVICE_DECODE_MAX_PIXELS: Final = 12_200_000


@dataclass(frozen=True)
class EncodedJpeg:
    """A JPEG whose header passed every check, left encoded for a batched decode on the device."""

    data: torch.Tensor  # uint8, 1-D: the file's bytes
    header: ImageHeader

    @property
    def decoded_bytes(self) -> int:
        return self.header.decoded_bytes


def device_decode_available(device: str) -> bool:
    """Whether JPEGs can be decoded on `device`: a CUDA device that torch can see."""
    import torch

    return device.startswith("cuda") and torch.cuda.is_available()


def use_device_decode(requested: bool, device: str, model: str) -> bool:
    """Whether an instance on `device` decodes JPEGs there: asked for, on CUDA, and CUDA present.
    Asked for where it cannot be, the instance decodes on the host and says so once."""
    if not requested:
        return False
    if device_decode_available(device):
        return True
    reason = "CUDA is not available" if device.startswith("cuda") else f"its device is {device!r}"
    log.warning("model %s: gpu_decode is set but %s; decoding on the host", model, reason)
    return False


def encoded_jpeg(image: OpenedImage, body: bytes) -> EncodedJpeg | None:
    """The image kept encoded for the device, or None where the host must decode it: not a plain
    JPEG, too large, or no end-of-image marker after the first scan (truncated: the host decode
    then answers 400 for it, instead of its failure failing a whole batch on the device)."""
    header = image.header
    if header.format != "JPEG" or header.mode not in ("RGB", "L") or header.pixels > DEVICE_DECODE_MAX_PIXELS:
        return None
    scan = body.find(b"\xff\xda")
    if scan < 0 or body.rfind(b"\xff\xd9") < scan:
        return None
    import torch

    return EncodedJpeg(torch.frombuffer(bytearray(body), dtype=torch.uint8), header)


def decode_on_device(items: Sequence[EncodedJpeg], device: torch.device) -> list[torch.Tensor]:
    """Decode the JPEGs on `device`, in one call on CUDA: RGB uint8 (3, H, W) each, EXIF orientation
    applied. Should the batched call fail, each JPEG is decoded alone, on the host if the device
    refuses it; only a JPEG that no decoder reads raises (RuntimeError)."""
    from torchvision.io import ImageReadMode, decode_jpeg  # type: ignore[import-untyped]

    if not items:
        return []
    decoded: list[torch.Tensor]
    if device.type == "cuda":
        try:
            decoded = decode_jpeg([item.data for item in items], mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            decoded = [_decode_one(item, device) for item in items]
    else:
        decoded = [decode_jpeg(item.data, mode=ImageReadMode.RGB).to(device) for item in items]
    return [orient_chw(image, item.header.orientation) for image, item in zip(decoded, items, strict=True)]


def _decode_one(item: EncodedJpeg, device: torch.device) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_jpeg

    image: torch.Tensor
    try:
        image = decode_jpeg(item.data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        image = decode_jpeg(item.data, mode=ImageReadMode.RGB).to(device)
    return image


def orient_chw(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """Apply an EXIF orientation to a (..., H, W) tensor as Pillow's exif_transpose does."""
    if orientation == 2:
        return image.flip(-1)
    if orientation == 3:
        return image.flip(-1, -2)
    if orientation == 4:
        return image.flip(-2)
    if orientation == 5:
        return image.transpose(-1, -2)
    if orientation == 6:
        return image.rot90(-1, dims=(-2, -1))
    if orientation == 7:
        return image.transpose(-1, -2).flip(-1, -2)
    if orientation == 8:
        return image.rot90(1, dims=(-2, -1))
    return image
