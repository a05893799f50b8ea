"""YOLO pre- and post-processing, independent of what runs the network in between.

The eager `yolo` plugin and the engine plugins (`onnx`, `tensorrt`) share this code: a fixed
square letterbox on the CPU, the uint8 -> float conversion on the device, then ultralytics' NMS
and the scaling of boxes back to the original image.

`preprocess` and `postprocess` (what a split host's fronts run) use numpy and OpenCV only: the
letterboxed image is a numpy array, the engine's output one too, and torch is imported where the
network's input is made and its output decoded.

The letterbox is ultralytics' `LetterBox` (same sizes, rounding, `INTER_LINEAR` resize and grey
114 border), done without its copies: libjpeg-turbo decodes to BGR, the resize writes the image's three
planes straight into the CHW canvas, reversing the channel order on the way. `decode: fast` lets
libjpeg decode at 1/2, 1/4 or 1/8 scale while the long side stays at least `imgsz`, with its fast
inverse DCT and upsampling;
`device_decode` leaves JPEGs encoded for a batched decode and letterbox on a CUDA device.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from router.sdk import DEFAULT_MAX_ASPECT_RATIO, DEFAULT_MAX_PIXELS, Payload, open_image
from router.sdk.device_images import EncodedJpeg, decode_on_device, encoded_jpeg

if TYPE_CHECKING:
    import torch

__all__ = ["DetectSettings", "Letterboxed", "Placement", "YoloProcessing", "check_class_ids", "offline", "scale_boxes"]

PAD_VALUE = 114  # ultralytics' letterbox grey


@dataclass(frozen=True)
class Letterboxed:
    """One image ready for the network: uint8 RGB (3, imgsz, imgsz), and its original size.
    With device decode, a JPEG comes as `encoded` instead, and `pixels` is None."""

    pixels: np.ndarray | None
    width: int
    height: int
    encoded: EncodedJpeg | None = None


@dataclass(frozen=True)
class Placement:
    """Where an image of width x height goes in the square: ultralytics' LetterBox(auto=False) arithmetic."""

    width: int  # of the resized image
    height: int
    top: int
    left: int

    @classmethod
    def fit(cls, width: int, height: int, side: int) -> Placement:
        ratio = min(side / height, side / width)
        new_width, new_height = max(round(width * ratio), 1), max(round(height * ratio), 1)
        pad_w, pad_h = (side - new_width) / 2, (side - new_height) / 2
        return cls(new_width, new_height, round(pad_h - 0.1), round(pad_w - 0.1))


@dataclass(frozen=True)
class DetectSettings:
    """What NMS keeps: score and IoU thresholds, the cap per image, an optional class filter."""

    conf: float = 0.25
    iou: float = 0.7
    max_det: int = 300
    classes: tuple[int, ...] | None = None
    end2end: bool = False  # the network already ran NMS (YOLO26/v10 one-to-one heads)


class YoloProcessing:
    """Letterbox in; NMS and boxes in the original image's pixels out."""

    def __init__(
        self,
        imgsz: int,
        stride: int,
        names: Sequence[str],
        settings: DetectSettings,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        *,
        max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
        decode_mode: Literal["exact", "fast"] = "exact",
        device_decode: bool = False,
    ) -> None:
        offline()
        if imgsz % stride:
            raise ValueError(f"imgsz {imgsz} is not a multiple of this model's stride {stride}")
        self.imgsz = imgsz
        self.stride = stride
        self.names = list(names)
        self.settings = settings
        self.max_pixels = max_pixels
        self.max_aspect_ratio = max_aspect_ratio
        self.decode_mode = decode_mode
        self.device_decode = device_decode

    def preprocess(self, payload: Payload) -> Letterboxed:
        """Decode, letterbox to the fixed square input (ultralytics' LetterBox), HWC BGR -> CHW RGB.
        With `device_decode`, a JPEG is only checked here and kept encoded."""
        image = open_image(payload, max_pixels=self.max_pixels, max_aspect_ratio=self.max_aspect_ratio)
        header = image.header
        if self.device_decode and (encoded := encoded_jpeg(image, payload.body)) is not None:
            return Letterboxed(pixels=None, width=header.width, height=header.height, encoded=encoded)
        fit = (1, self.imgsz) if self.decode_mode == "fast" else None
        bgr = image.decode(channels="BGR", fit=fit)
        height, width = bgr.shape[:2] if fit is None else (header.height, header.width)  # full-size placement
        pixels = self._letterbox(bgr, Placement.fit(width, height, self.imgsz))
        return Letterboxed(pixels=pixels, width=width, height=height)

    def _letterbox(self, bgr: np.ndarray, box: Placement) -> np.ndarray:
        """uint8 (3, imgsz, imgsz) RGB: the resized image's planes written into the grey canvas."""
        import cv2

        resized = bgr
        if bgr.shape[:2] != (box.height, box.width):
            resized = cv2.resize(bgr, (box.width, box.height), interpolation=cv2.INTER_LINEAR)
        side = self.imgsz
        canvas = np.full((3, side, side), PAD_VALUE, dtype=np.uint8)
        rows, cols = slice(box.top, box.top + box.height), slice(box.left, box.left + box.width)
        for channel, plane in enumerate(cv2.split(resized)):
            canvas[2 - channel, rows, cols] = plane  # BGR planes in, RGB planes out
        return canvas

    def network_input(self, items: Sequence[Letterboxed], device: torch.device, *, half: bool = False) -> torch.Tensor:
        """The batch as the network takes it: (n, 3, imgsz, imgsz) in [0, 1]. JPEGs left encoded
        are decoded and letterboxed on `device` first."""
        import torch

        encoded = [item.encoded for item in items if item.pixels is None and item.encoded is not None]
        done = iter(self._letterbox_on_device(image) for image in decode_on_device(encoded, device))
        batch = torch.stack([next(done) if item.pixels is None else torch.from_numpy(item.pixels).to(device)
                             for item in items])
        # Same conversion as ultralytics' predictor: uint8 to the device, then scale there.
        return (batch.half() if half else batch.float()).div_(255)

    def _letterbox_on_device(self, image: torch.Tensor) -> torch.Tensor:
        """uint8 RGB (3, H, W) on any device -> the letterboxed uint8 (3, imgsz, imgsz) there."""
        import torch

        height, width = image.shape[-2:]
        box = Placement.fit(width, height, self.imgsz)
        if (height, width) != (box.height, box.width):
            resized = torch.nn.functional.interpolate(
                image.unsqueeze(0).float(), size=(box.height, box.width), mode="bilinear", align_corners=False
            )
            image = resized[0].round_().clamp_(0, 255).to(torch.uint8)
        side = self.imgsz
        canvas = torch.full((3, side, side), PAD_VALUE, dtype=torch.uint8, device=image.device)
        canvas[:, box.top : box.top + box.height, box.left : box.left + box.width] = image
        return canvas

    def decode_bytes(self) -> int:
        """Device memory one input's on-device decode and letterbox can take (0 without device decode)."""
        from router.sdk.device_images import DEVICE_DECODE_MAX_PIXELS

        return 3 * DEVICE_DECODE_MAX_PIXELS * 5 if self.device_decode else 0  # uint8 decode + its float copy

    def decode(self, raw: Any) -> list[np.ndarray]:
        """ultralytics' NMS on the raw head output (n, 4 + classes, anchors); per image an (k, 6)
        float32 array x1 y1 x2 y2 score class in network-input pixels."""
        from ultralytics.utils.nms import non_max_suppression

        settings = self.settings
        detections = non_max_suppression(
            raw,
            settings.conf,
            settings.iou,
            list(settings.classes) if settings.classes is not None else None,
            max_det=settings.max_det,
            end2end=settings.end2end,
            # ultralytics stops NMS after 2 s + 50 ms per image and leaves the remaining images
            # with no boxes; the router's execution timeout bounds a batch instead.
            max_time_img=math.inf,
        )
        return [d[:, :6].float().cpu().numpy() for d in detections]

    def postprocess(self, output: np.ndarray, item: Letterboxed) -> dict[str, Any]:
        """Boxes back in the original image's pixels, with scores and labels."""
        side = self.imgsz
        boxes = scale_boxes((side, side), np.array(output[:, :4], dtype=np.float32), (item.height, item.width))
        detections = [
            {"box": box, "score": score, "class_id": int(cls), "label": self.label(int(cls))}
            for box, score, cls in zip(boxes.tolist(), output[:, 4].tolist(), output[:, 5].tolist(), strict=True)
        ]
        return {"detections": detections, "image": {"width": item.width, "height": item.height}}

    def label(self, class_id: int) -> str:
        return self.names[class_id] if 0 <= class_id < len(self.names) else str(class_id)


def scale_boxes(letterboxed: tuple[int, int], boxes: np.ndarray, original: tuple[int, int]) -> np.ndarray:
    """xyxy boxes (float32, changed in place) from the letterboxed square back to the original
    (height, width), clipped to it: ultralytics' `ops.scale_boxes` for xyxy boxes, step for step in
    float32 (tests/plugins/test_yolo.py holds it to the same bits), without importing torch."""
    gain = min(letterboxed[0] / original[0], letterboxed[1] / original[1])
    new_h, new_w = (max(round(x * gain), 1) for x in original)  # LetterBox rounds each side
    gain_y, gain_x = new_h / original[0], new_w / original[1]
    pad_x, pad_y = round((letterboxed[1] - new_w) / 2 - 0.1), round((letterboxed[0] - new_h) / 2 - 0.1)
    boxes[..., [0, 2]] -= pad_x
    boxes[..., [1, 3]] -= pad_y
    boxes[..., [0, 2]] /= gain_x
    boxes[..., [1, 3]] /= gain_y
    height, width = original
    boxes[..., [0, 2]] = boxes[..., [0, 2]].clip(0, width)
    boxes[..., [1, 3]] = boxes[..., [1, 3]].clip(0, height)
    return boxes


def offline() -> None:
    """ultralytics probes DNS when imported, downloads missing assets and pip-installs missing
    packages; a server must do none of that at run time, so default both switches off before the
    first import (explicit YOLO_OFFLINE / YOLO_AUTOINSTALL values still win)."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    os.environ.setdefault("YOLO_AUTOINSTALL", "false")


def check_class_ids(value: list[int] | None) -> list[int] | None:
    """The `classes` option: None, or a non-empty list of class ids >= 0."""
    if value is not None and (not value or min(value) < 0):
        raise ValueError(f"classes must be a non-empty list of class ids >= 0, got {value}")
    return value
