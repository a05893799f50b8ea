"""What an exported model carries for the plugin that serves it: task, input, normalisation,
labels, post-processing defaults and the batch profile. Stored as JSON under one key of the ONNX
model's metadata_props, and beside a TensorRT engine as `<engine>.json`.

Pydantic and the SDK's JSON loader: importing this module needs neither torch, onnx nor onnxruntime.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from router.sdk import InputError, loads_bounded

__all__ = [
    "METADATA_KEY",
    "BatchProfile",
    "ClassifyDefaults",
    "DetectDefaults",
    "ExportMetadata",
    "Letterbox",
    "MetadataError",
    "Normalisation",
    "ResizeCrop",
    "TensorSpec",
    "parse_metadata",
    "read_sidecar",
    "sidecar_path",
    "write_sidecar",
]

#: The metadata_props key of an ONNX model exported by `model-router export`.
METADATA_KEY = "model_router"


class MetadataError(ValueError):
    """Export metadata that is missing or does not validate; the message names the file."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchProfile(_Strict):
    """Batch sizes an engine is built for: TensorRT's optimisation profile (min, opt, max)."""

    min: int = Field(1, ge=1)
    opt: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> BatchProfile:
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"batch profile must have min <= opt <= max, got {self.min}, {self.opt}, {self.max}")
        return self


class TensorSpec(_Strict):
    """A named network input or output; `shape` leaves out the leading batch axis."""

    name: str = Field(min_length=1)
    shape: list[int]


class Normalisation(_Strict):
    """input = (pixel * scale - mean) / std, per RGB channel."""

    scale: float = 1 / 255
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)


class Letterbox(_Strict):
    """Detection: letterbox every image to an `imgsz` square (ultralytics' LetterBox)."""

    kind: Literal["letterbox"] = "letterbox"
    imgsz: int = Field(ge=32)
    stride: int = Field(32, ge=1)


class ResizeCrop(_Strict):
    """Classification: resize the short side to `resize`, centre-crop `crop`."""

    kind: Literal["resize_crop"] = "resize_crop"
    resize: int = Field(ge=1)
    crop: int = Field(ge=1)


class DetectDefaults(_Strict):
    conf: float = Field(0.25, ge=0.0, le=1.0)
    iou: float = Field(0.7, ge=0.0, le=1.0)
    max_det: int = Field(300, ge=1)
    classes: list[int] | None = None
    end2end: bool = False


class ClassifyDefaults(_Strict):
    top_k: int = Field(5, ge=1)


class ExportMetadata(_Strict):
    """Everything the `onnx` and `tensorrt` plugins need besides the network itself."""

    format_version: Literal[1] = 1
    task: Literal["detect", "classify"]
    source: dict[str, str] = Field(default_factory=dict, description="plugin, model, file, exporter, versions")
    input: TensorSpec
    output: TensorSpec
    resize: Annotated[Letterbox | ResizeCrop, Field(discriminator="kind")]
    normalisation: Normalisation = Normalisation()
    labels: list[str]
    detect: DetectDefaults | None = None
    classify: ClassifyDefaults | None = None
    batch: BatchProfile

    @model_validator(mode="after")
    def _task_parts(self) -> ExportMetadata:
        if self.task == "detect" and (self.detect is None or not isinstance(self.resize, Letterbox)):
            raise ValueError("a 'detect' export needs a 'detect' section and a 'letterbox' resize")
        if self.task == "classify" and (self.classify is None or not isinstance(self.resize, ResizeCrop)):
            raise ValueError("a 'classify' export needs a 'classify' section and a 'resize_crop' resize")
        return self

    def to_json(self) -> str:
        return self.model_dump_json()


def parse_metadata(text: str | None, source: str) -> ExportMetadata:
    """Validate metadata JSON; MetadataError names `source` and says how to produce a valid file."""
    if text is None:
        raise MetadataError(
            f"{source} has no {METADATA_KEY!r} metadata; export it with `model-router export` so the serving "
            "plugin knows its task, input size, normalisation and labels"
        )
    try:
        data: Any = loads_bounded(text, f"its {METADATA_KEY!r} metadata")
        return ExportMetadata.model_validate(data)
    except InputError as exc:  # not JSON, nested too deep, too large once parsed
        raise MetadataError(f"{source}: {exc.detail}") from None
    except (ValueError, ValidationError) as exc:
        detail = str(exc).splitlines()
        summary = "; ".join(line.strip() for line in detail[:4])
        raise MetadataError(f"{source}: invalid {METADATA_KEY!r} metadata: {summary}") from None


def sidecar_path(engine: Path) -> Path:
    """Where an engine's metadata lives: `yolov8n.engine` -> `yolov8n.engine.json`."""
    return engine.with_name(engine.name + ".json")


def write_sidecar(path: Path, metadata: ExportMetadata) -> None:
    path.write_text(json.dumps(metadata.model_dump(mode="json"), indent=2) + "\n", encoding="utf-8")


def read_sidecar(path: Path) -> ExportMetadata:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise MetadataError(
            f"metadata file {str(path)!r} cannot be read ({exc.strerror}); `model-router export --format tensorrt` "
            "writes it beside the engine"
        ) from None
    return parse_metadata(text, str(path))
