"""The pre- and post-processing of an exported model, chosen by its metadata's task.

Nothing is re-implemented here: `detect` is the yolo plugin's `YoloProcessing`, `classify` the
resnet plugin's `ClassifyProcessing`. Both engine plugins (`onnx`, `tensorrt`) build theirs here.
Each is imported only when an export of its task is served, so a classify engine needs neither the
yolo plugin nor ultralytics (extras `vision-model-router-engines[detect]` and `[classify]`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

from model_router_engines.metadata import ExportMetadata, Normalisation
from router.sdk import DEFAULT_MAX_PIXELS, Payload, PluginContext

__all__ = ["ProcessingHooks", "ServingOverrides", "TaskProcessing", "build_processing", "staged_input_bytes"]

#: Where each task's processing comes from, for the message when it is not installed.
_PROCESSING = {"detect": ("yolo", "vision-model-router-yolo"), "classify": ("resnet", "vision-model-router-resnet")}


class ProcessingHooks:
    """The hooks both engine plugins serve from their task's processing (a mixin, before
    `ModelPlugin` in the bases): `preprocess` and `postprocess` in the engine, or in a split host's
    front, which adopts the processing built at load (`front_state`) without loading the engine.
    The plugin sets `_processing` at load and clears it at unload."""

    context: PluginContext
    _processing: TaskProcessing | None

    def preprocess(self, payload: Payload) -> Any:
        return self._prepared().preprocess(payload)

    def postprocess(self, output: Any, item: Any) -> dict[str, Any]:
        return self._prepared().postprocess(output, item)

    def front_state(self) -> TaskProcessing:
        """The task's pre- and post-processing, built from the export's metadata at load: the front
        processes of a split host adopt it."""
        return self._prepared()

    def adopt_front_state(self, state: TaskProcessing) -> None:
        self._processing = state

    def _prepared(self) -> TaskProcessing:
        """The processing of the loaded model, or the one a front adopted."""
        if self._processing is None:
            raise RuntimeError(f"model {self.context.model_name!r} is not loaded")
        return self._processing


class ServingOverrides(BaseModel):
    """Serving-time settings shared by the engine plugins; None keeps the value the export recorded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    conf: float | None = Field(None, ge=0.0, le=1.0, description="detect: minimum score")
    iou: float | None = Field(None, ge=0.0, le=1.0, description="detect: NMS IoU threshold")
    max_det: int | None = Field(None, ge=1, description="detect: most detections kept per image")
    classes: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = Field(
        None, description="detect: keep only these class ids (a non-empty list of ids >= 0)"
    )
    top_k: int | None = Field(None, ge=1, description="classify: classes returned per image")
    labels: list[str] | None = Field(None, description="class names, one per class id")
    max_pixels: int = Field(DEFAULT_MAX_PIXELS, ge=1, description="largest accepted input image, in pixels")


class TaskProcessing(Protocol):
    """What an engine plugin needs around the network: one shape for both tasks."""

    def preprocess(self, payload: Payload) -> Any: ...

    def network_input(self, items: Sequence[Any], device: torch.device, *, half: bool = False) -> torch.Tensor: ...

    def decode(self, raw: torch.Tensor) -> list[Any]: ...

    def postprocess(self, output: Any, item: Any) -> dict[str, Any]: ...


def build_processing(metadata: ExportMetadata, overrides: ServingOverrides, model: str) -> TaskProcessing:
    """The processing for `metadata.task`, with the overrides applied. Raises ValueError naming the model."""
    labels = list(overrides.labels) if overrides.labels is not None else list(metadata.labels)
    if len(labels) != len(metadata.labels):
        raise ValueError(f"model {model!r}: labels has {len(labels)} names but the export has {len(metadata.labels)} classes")
    if metadata.task == "detect":
        return _detect(metadata, overrides, labels, model)
    return _classify(metadata, overrides, labels, model)


def staged_input_bytes(metadata: ExportMetadata) -> int:
    """Device memory one item's network input takes while its batch is staged: detect uploads uint8
    pixels and converts them to float there; classify uploads float pixels and the engine copies them."""
    pixels = math.prod(metadata.input.shape)
    return pixels * (1 + 4) if metadata.task == "detect" else pixels * 8


def _detect(metadata: ExportMetadata, overrides: ServingOverrides, labels: list[str], model: str) -> TaskProcessing:
    try:
        from model_router_yolo.processing import DetectSettings, YoloProcessing
    except ImportError as exc:
        raise _missing_processing(model, "detect", exc) from None

    _refuse(model, "detect", top_k=overrides.top_k)
    if metadata.normalisation != Normalisation():
        raise ValueError(f"model {model!r}: a detect export must take pixels / 255, got {metadata.normalisation}")
    defaults, resize = metadata.detect, metadata.resize
    assert defaults is not None and resize.kind == "letterbox"  # ExportMetadata validates both
    classes = overrides.classes if overrides.classes is not None else defaults.classes
    if classes and max(classes) >= len(labels):
        raise ValueError(f"model {model!r}: classes {classes} has ids beyond the export's {len(labels)} classes")
    settings = DetectSettings(
        conf=_pick(overrides.conf, defaults.conf),
        iou=_pick(overrides.iou, defaults.iou),
        max_det=_pick(overrides.max_det, defaults.max_det),
        classes=tuple(classes) if classes is not None else None,
        end2end=defaults.end2end,
    )
    return YoloProcessing(resize.imgsz, resize.stride, labels, settings, overrides.max_pixels)


def _classify(metadata: ExportMetadata, overrides: ServingOverrides, labels: list[str], model: str) -> TaskProcessing:
    try:
        from model_router_resnet.processing import ClassifyProcessing
    except ImportError as exc:
        raise _missing_processing(model, "classify", exc) from None

    _refuse(model, "classify", conf=overrides.conf, iou=overrides.iou, max_det=overrides.max_det, classes=overrides.classes)
    if abs(metadata.normalisation.scale - 1 / 255) > 1e-12:
        raise ValueError(f"model {model!r}: a classify export must scale pixels by 1/255, got {metadata.normalisation.scale}")
    defaults, resize = metadata.classify, metadata.resize
    assert defaults is not None and resize.kind == "resize_crop"  # ExportMetadata validates both
    top_k = _pick(overrides.top_k, defaults.top_k)
    if top_k > len(labels):
        raise ValueError(f"model {model!r}: top_k {top_k} is more than the export's {len(labels)} classes")
    return ClassifyProcessing(
        top_k=top_k,
        labels=tuple(labels),
        resize=resize.resize,
        crop=resize.crop,
        mean=metadata.normalisation.mean,
        std=metadata.normalisation.std,
        max_pixels=overrides.max_pixels,
    )


def _pick(override: Any, default: Any) -> Any:
    return default if override is None else override


def _refuse(model: str, task: str, **given: Any) -> None:
    """Options that belong to the other task are a configuration mistake, not something to ignore."""
    wrong = sorted(name for name, value in given.items() if value is not None)
    if wrong:
        raise ValueError(f"model {model!r}: option(s) {', '.join(wrong)} do not apply to a {task!r} export")


def _missing_processing(model: str, task: str, exc: ImportError) -> RuntimeError:
    plugin, distribution = _PROCESSING[task]
    return RuntimeError(
        f"model {model!r}: a {task!r} export is served with the {plugin} plugin's processing, which is not "
        f"installed (pip install -e 'plugins/engines[{task}]', which brings {distribution}): {exc}"
    )
