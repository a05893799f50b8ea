"""YOLO pre- and post-processing, independent of what runs the network in between.

The eager `yolo` plugin and the engine plugins (`onnx`, `tensorrt`) share this code: a fixed
square letterbox on the CPU, the uint8 -> float conversion on the device, then ultralytics' NMS
and the scaling of boxes back to the original image.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from router.sdk import DEFAULT_MAX_PIXELS, Payload, decode_image

__all__ = ["DetectSettings", "Letterboxed", "YoloProcessing", "check_class_ids", "offline"]


@dataclass(frozen=True)
class Letterboxed:
    """One image ready for the network: uint8 RGB (3, imgsz, imgsz), and its original size."""

    pixels: torch.Tensor
    width: int
    height: int


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
    ) -> None:
        offline()
        from ultralytics.data.augment import LetterBox

        if imgsz % stride:
            raise ValueError(f"imgsz {imgsz} is not a multiple of this model's stride {stride}")
        self.imgsz = imgsz
        self.stride = stride
        self.names = list(names)
        self.settings = settings
        self.max_pixels = max_pixels
        self._letterbox = LetterBox((imgsz, imgsz), auto=False, stride=stride)

    def preprocess(self, payload: Payload) -> Letterboxed:
        """Decode, letterbox to the fixed square input (ultralytics' LetterBox), HWC -> CHW."""
        rgb = decode_image(payload, max_pixels=self.max_pixels)
        boxed = cast(np.ndarray, self._letterbox(image=rgb))  # image-only calls return the array
        pixels = torch.from_numpy(boxed.transpose(2, 0, 1).copy())
        return Letterboxed(pixels=pixels, width=rgb.shape[1], height=rgb.shape[0])

    @staticmethod
    def network_input(items: Sequence[Letterboxed], device: torch.device, *, half: bool = False) -> torch.Tensor:
        """The batch as the network takes it: (n, 3, imgsz, imgsz) in [0, 1]."""
        batch = torch.stack([item.pixels for item in items]).to(device)
        # Same conversion as ultralytics' predictor: uint8 to the device, then scale there.
        return (batch.half() if half else batch.float()).div_(255)

    def decode(self, raw: Any) -> list[torch.Tensor]:
        """ultralytics' NMS on the raw head output (n, 4 + classes, anchors); per image an (k, 6)
        CPU tensor x1 y1 x2 y2 score class in network-input pixels."""
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
        return [d[:, :6].float().cpu() for d in detections]

    def postprocess(self, output: torch.Tensor, item: Letterboxed) -> dict[str, Any]:
        """Boxes back in the original image's pixels, with scores and labels."""
        from ultralytics.utils.ops import scale_boxes

        side = self.imgsz
        boxes = scale_boxes((side, side), output[:, :4].clone(), (item.height, item.width))
        detections = [
            {"box": box, "score": score, "class_id": int(cls), "label": self.label(int(cls))}
            for box, score, cls in zip(boxes.tolist(), output[:, 4].tolist(), output[:, 5].tolist(), strict=True)
        ]
        return {"detections": detections, "image": {"width": item.width, "height": item.height}}

    def label(self, class_id: int) -> str:
        return self.names[class_id] if 0 <= class_id < len(self.names) else str(class_id)


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
