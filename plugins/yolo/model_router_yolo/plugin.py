"""YOLO object detection on ultralytics: a fixed square letterbox on the CPU so any mix of image
sizes stacks into one batch, then one forward pass and NMS per batch on the device."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from model_router_yolo.processing import DetectSettings, Letterboxed, YoloProcessing, check_class_ids
from model_router_yolo.processing import offline as _offline
from router.sdk import (
    ACCEPTED_MEDIA_TYPES,
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_PIXELS,
    DETECTIONS,
    MemoryEstimate,
    ModelPlugin,
    Payload,
    PluginContext,
    example_jpeg,
    require_cuda_for_half,
)
from router.sdk.device_images import use_device_decode

if TYPE_CHECKING:
    import numpy as np
    import torch
    from ultralytics.nn.autobackend import AutoBackend

__all__ = ["Letterboxed", "YoloOptions", "YoloPlugin"]

_MODEL_SUFFIXES = (".pt", ".yaml", ".yml")
_YAML_SEED = 0  # an architecture YAML gets random weights; seed them so replicas agree


class YoloOptions(BaseModel):
    """`options:` of a `plugin: yolo` model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="checkpoint (.pt) in the model store, or an architecture YAML like yolov8n.yaml")
    imgsz: int = Field(640, description="side of the square network input in pixels, a multiple of 32")
    conf: float = Field(0.25, ge=0.0, le=1.0, description="minimum detection score")
    iou: float = Field(0.7, ge=0.0, le=1.0, description="NMS IoU threshold")
    max_det: int = Field(300, ge=1, description="most detections kept per image")
    classes: list[int] | None = Field(None, description="keep only these class ids")
    half: bool = Field(False, description="fp16 weights and inputs; CUDA devices only")
    labels: list[str] | None = Field(None, description="class names, one per class id; default: the checkpoint's")
    max_pixels: int = Field(DEFAULT_MAX_PIXELS, ge=1, description="largest accepted input image, in pixels")
    max_aspect_ratio: float = Field(
        DEFAULT_MAX_ASPECT_RATIO, ge=1, le=100, description="long side / short side; more elongated images get 400"
    )
    decode: Literal["exact", "fast"] = Field(
        "exact", description="fast: JPEGs decoded at 1/2, 1/4 or 1/8 scale while the long side stays >= imgsz"
    )
    gpu_decode: bool = Field(False, description="on cuda:N, decode JPEGs on the device in batches (nvJPEG)")

    @field_validator("model")
    @classmethod
    def _known_suffix(cls, value: str) -> str:
        if not value.lower().endswith(_MODEL_SUFFIXES):
            raise ValueError(f"model must be a .pt checkpoint or a .yaml architecture, got {value!r}")
        return value

    @field_validator("imgsz")
    @classmethod
    def _stride_multiple(cls, value: int) -> int:
        if value < 32 or value % 32:
            nearest = max(32, round(value / 32) * 32)
            raise ValueError(f"imgsz must be a positive multiple of 32, got {value}; try {nearest}")
        return value

    @field_validator("classes")
    @classmethod
    def _non_negative(cls, value: list[int] | None) -> list[int] | None:
        return check_class_ids(value)


class YoloPlugin(ModelPlugin[YoloOptions]):
    """Detection with any ultralytics YOLO detect checkpoint (v5u, v8, 11, ...)."""

    Options: ClassVar[type[BaseModel]] = YoloOptions
    accepts: ClassVar[tuple[str, ...]] = ACCEPTED_MEDIA_TYPES
    answers: ClassVar[str | None] = DETECTIONS  # a pipeline's `crop` reads the boxes

    def __init__(self, options: YoloOptions, context: PluginContext) -> None:
        super().__init__(options, context)
        self.path = context.resolve_path(options.model)  # a path escaping the store fails here, at start-up
        self.device: torch.device | None = None  # set by `load`; a split host's front never loads, nor imports torch
        self.names: list[str] = []
        self._network: AutoBackend | None = None
        self._processing: YoloProcessing | None = None

    def load(self, device: str) -> None:
        """Build the network from the checkpoint or YAML, fuse it and move it to `device`."""
        _offline()
        import torch
        from ultralytics.nn.autobackend import AutoBackend

        self.device = torch.device(device)
        require_cuda_for_half(self.context.model_name, device, self.options.half)
        yolo = self._build()
        network = AutoBackend(yolo.model, device=self.device, fp16=self.options.half, fuse=True, verbose=False)
        network.eval()
        self.names = self._class_names(network.names)
        settings = DetectSettings(
            conf=self.options.conf,
            iou=self.options.iou,
            max_det=self.options.max_det,
            classes=tuple(self.options.classes) if self.options.classes is not None else None,
            end2end=bool(getattr(network, "end2end", False)),
        )
        self._processing = YoloProcessing(
            self.options.imgsz, int(network.stride), self.names, settings, self.options.max_pixels,
            max_aspect_ratio=self.options.max_aspect_ratio,
            decode_mode=self.options.decode,
            device_decode=use_device_decode(self.options.gpu_decode, device, self.context.model_name),
        )
        self._network = network

    def front_state(self) -> YoloProcessing:
        """What preprocessing and postprocessing need of the loaded model (stride, class names): the
        front processes of a split host adopt it."""
        return self.processing

    def adopt_front_state(self, state: YoloProcessing) -> None:
        self._processing, self.names = state, list(state.names)

    @property
    def processing(self) -> YoloProcessing:
        """The pre- and post-processing this model uses (after `load`); engine plugins reuse it."""
        if self._processing is None:
            raise RuntimeError(f"model {self.context.model_name!r} is not loaded")
        return self._processing

    @property
    def module(self) -> torch.nn.Module:
        """The loaded, fused torch network (an ultralytics DetectionModel), e.g. for export."""
        module: torch.nn.Module = self._loaded().model  # AutoBackend does not register the network as a child
        return module

    def preprocess(self, payload: Payload) -> Letterboxed:
        """Decode, letterbox to the fixed square input (ultralytics' LetterBox), HWC -> CHW."""
        return self.processing.preprocess(payload)

    def predict_batch(self, items: Sequence[Letterboxed]) -> list[np.ndarray]:
        """One forward pass and NMS for the batch; each output is an (n, 6) float32 array x1 y1 x2 y2 score class."""
        import torch

        network, processing = self._loaded(), self.processing
        with torch.inference_mode():
            raw = network(processing.network_input(items, self.device, half=self.options.half))
            return processing.decode(raw)

    def postprocess(self, output: np.ndarray, item: Letterboxed) -> dict[str, Any]:
        """Boxes back in the original image's pixels, with scores and labels."""
        return self.processing.postprocess(output, item)

    def describe_input(self, payload: Payload, item: Letterboxed) -> dict[str, Any]:
        return {"image_width": item.width, "image_height": item.height}

    def memory_estimate(self) -> MemoryEstimate:
        """Weights as loaded; per item the input plus every activation of one forward (an upper bound)."""
        import torch

        from router.sdk import activation_bytes, tensor_bytes  # need torch: imported here, not at the top

        module = self.module
        weights = tensor_bytes([*module.parameters(), *module.buffers()])
        dtype = torch.float16 if self.options.half else torch.float32
        probe = torch.zeros((1, 3, self.options.imgsz, self.options.imgsz), dtype=dtype, device=self.device)
        inputs = probe.numel() * (1 + probe.element_size())  # the uint8 upload and its float copy
        per_item = inputs + activation_bytes(module, probe) + self.processing.decode_bytes()
        return MemoryEstimate(weights_bytes=weights, per_item_bytes=per_item)

    def example_payload(self) -> Payload:
        return example_jpeg()

    def unload(self) -> None:
        self._network = None
        self._processing = None
        if self.device is not None and self.device.type == "cuda":
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _build(self) -> Any:
        """The ultralytics YOLO object for the option `model`; never lets ultralytics download."""
        import torch
        from ultralytics import YOLO  # type: ignore[attr-defined]  # lazily re-exported

        if self.path.is_file():
            source = str(self.path)
        elif self.path.suffix.lower() in (".yaml", ".yml") and Path(self.options.model).name == self.options.model:
            source = self.options.model  # an architecture ultralytics ships, e.g. yolov8n.yaml
        else:
            # A missing .pt must never reach ultralytics: it would try to download a file of that name.
            raise FileNotFoundError(
                f"model file {self.options.model!r} not found in the model store {str(self.context.store_dir)!r} "
                f"(looked for {str(self.path)!r}); run `model-router store init-demo` for the demo checkpoints"
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_YAML_SEED)
            yolo = YOLO(source, verbose=False)
        if yolo.task != "detect":
            raise ValueError(f"{self.options.model!r} is a {yolo.task!r} model; the yolo plugin serves 'detect' models")
        return yolo

    def _class_names(self, names: dict[int, str]) -> list[str]:
        """Labels from the options, else the checkpoint; check `classes` against them."""
        count = len(names)
        labels = list(self.options.labels) if self.options.labels is not None else [names[i] for i in range(count)]
        if len(labels) != count:
            raise ValueError(f"labels has {len(labels)} names but the model has {count} classes")
        if self.options.classes and max(self.options.classes) >= count:
            raise ValueError(
                f"classes {self.options.classes} has ids beyond the model's {count} classes (0..{count - 1})"
            )
        return labels

    def _loaded(self) -> AutoBackend:
        if self._network is None:
            raise RuntimeError(f"model {self.context.model_name!r} is not loaded")
        return self._network
