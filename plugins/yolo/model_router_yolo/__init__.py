"""model-router plugin `yolo`: object detection with ultralytics YOLO checkpoints."""

from model_router_yolo.plugin import YoloOptions, YoloPlugin
from model_router_yolo.processing import DetectSettings, Letterboxed, YoloProcessing

__all__ = ["DetectSettings", "Letterboxed", "YoloOptions", "YoloPlugin", "YoloProcessing"]
