"""model-router plugin `yolo`: object detection with ultralytics YOLO checkpoints."""

from model_router_yolo.plugin import Letterboxed, YoloOptions, YoloPlugin

__all__ = ["Letterboxed", "YoloOptions", "YoloPlugin"]
