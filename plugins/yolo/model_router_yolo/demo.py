"""The demo checkpoint this plugin serves: YOLOv8n from its architecture YAML, untrained, seeded and
calibrated, saved as a real ultralytics checkpoint. Declared under `model_router.demo_files`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model_router_yolo.processing import offline
from router.sdk import DemoFile, calibrate_batchnorm

__all__ = ["YOLOV8N"]

_SEED = 0


def build_yolov8n(path: Path) -> None:
    """YOLOv8n with seeded random weights whose scores depend on the image, COCO label names."""
    offline()  # no connectivity probe, no downloads, no pip installs
    import torch
    from ultralytics import YOLO  # type: ignore[attr-defined]  # lazily re-exported
    from ultralytics.utils import YAML
    from ultralytics.utils.checks import check_yaml

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        yolo = YOLO("yolov8n.yaml", verbose=False)
    network: Any = yolo.model
    calibrate_batchnorm(network, _SEED, side=256)
    _tune_class_logits(network)
    coco: Any = YAML.load(check_yaml("coco.yaml"))  # type: ignore[no-untyped-call]  # ships with ultralytics
    network.names = dict(coco["names"])
    yolo.save(path)


def _tune_class_logits(detector: Any) -> None:
    """Narrow and lift the Detect head's class logits: untrained scores then spread over (0, 1)
    without saturating at 1.0, and some boxes pass the default conf of 0.25."""
    import torch

    with torch.no_grad():
        for branch in detector.model[-1].cv3:  # one class branch per detection level
            branch[-1].weight.mul_(0.25)
            branch[-1].bias.fill_(-3.0)


YOLOV8N = DemoFile("yolov8n.pt", "YOLOv8n detector (untrained, COCO labels)", build_yolov8n)
