"""ResNet classification on torchvision: ImageNet preprocessing on the CPU, one forward pass per batch."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from model_router_resnet.processing import CROP, ClassifyItem, ClassifyProcessing, TopK
from router.sdk import (
    ACCEPTED_MEDIA_TYPES,
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_PIXELS,
    MemoryEstimate,
    ModelPlugin,
    Payload,
    PluginContext,
    activation_bytes,
    example_jpeg,
    image_size,
    require_cuda_for_half,
    tensor_bytes,
)
from router.sdk.device_images import use_device_decode

__all__ = ["ARCHS", "ResNetOptions", "ResNetPlugin", "TopK"]

ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")


class ResNetOptions(BaseModel):
    """`options:` of a `plugin: resnet` model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    arch: str = Field("resnet18", description="one of " + ", ".join(ARCHS))
    weights: str = Field(description="state-dict file in the model store, loaded with weights_only=True")
    top_k: int = Field(5, ge=1, description="classes returned per image, most likely first")
    half: bool = Field(False, description="fp16 weights and inputs; CUDA devices only")
    labels_file: str | None = Field(None, description="one label per line; default: the ImageNet categories")
    max_pixels: int = Field(DEFAULT_MAX_PIXELS, ge=1, description="largest accepted input image, in pixels")
    max_aspect_ratio: float = Field(
        DEFAULT_MAX_ASPECT_RATIO, ge=1, le=100, description="long side / short side; more elongated images get 400"
    )
    decode: Literal["exact", "fast"] = Field(
        "exact", description="fast: JPEGs decoded at 1/2, 1/4 or 1/8 scale while at least the resize size"
    )
    gpu_decode: bool = Field(False, description="on cuda:N, decode JPEGs on the device in batches (nvJPEG)")

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, value: str) -> str:
        if value not in ARCHS:
            raise ValueError(f"arch {value!r} is not supported; accepted: {', '.join(ARCHS)}")
        return value


class ResNetPlugin(ModelPlugin[ResNetOptions]):
    """Image classification with a torchvision ResNet and a state dict from the model store."""

    Options: ClassVar[type[BaseModel]] = ResNetOptions
    accepts: ClassVar[tuple[str, ...]] = ACCEPTED_MEDIA_TYPES
    answers: ClassVar[str | None] = "classes"  # {"top_k": [...]}

    def __init__(self, options: ResNetOptions, context: PluginContext) -> None:
        super().__init__(options, context)
        # Paths escaping the store fail here, at start-up.
        self.weights_path = context.resolve_path(options.weights)
        self.labels_path = context.resolve_path(options.labels_file) if options.labels_file else None
        self.device = torch.device("cpu")
        self.labels: list[str] = []
        self._network: torch.nn.Module | None = None
        # Labels are known after load; preprocessing works before it.
        self.processing = ClassifyProcessing(
            top_k=options.top_k,
            max_pixels=options.max_pixels,
            max_aspect_ratio=options.max_aspect_ratio,
            decode_mode=options.decode,
        )

    def load(self, device: str) -> None:
        """Build the architecture sized by the state dict's `fc` layer, load the weights, move to `device`."""
        self.device = torch.device(device)
        require_cuda_for_half(self.context.model_name, device, self.options.half)
        state = _read_state_dict(self.weights_path)
        num_classes = _fc_rows(state, self.weights_path)
        import torchvision  # here, not at the top: a split host's fronts run the hooks without it

        # Built on the meta device (no random initialisation to throw away), then the checkpoint's
        # tensors are taken as they are: a load, and an on-demand reload, cost little beyond reading the file.
        with torch.device("meta"):
            network: torch.nn.Module = getattr(torchvision.models, self.options.arch)(weights=None, num_classes=num_classes)
        try:
            network.load_state_dict(state, assign=True)
        except RuntimeError as exc:
            detail = str(exc).splitlines()[1:3]
            raise ValueError(
                f"weights {self.options.weights!r} do not fit arch {self.options.arch!r}: {' '.join(detail).strip()}"
            ) from None
        if self.options.top_k > num_classes:
            raise ValueError(f"top_k {self.options.top_k} is more than the model's {num_classes} classes")
        self.labels = self._read_labels(num_classes)
        device_decode = use_device_decode(self.options.gpu_decode, device, self.context.model_name)
        self.processing = dataclasses.replace(self.processing, labels=tuple(self.labels), device_decode=device_decode)
        network.eval().to(self.device)
        self._network = network.half() if self.options.half else network

    def front_state(self) -> ClassifyProcessing:
        """What preprocessing and postprocessing need of the loaded model (its labels): the front
        processes of a split host adopt it."""
        return self.processing

    def adopt_front_state(self, state: ClassifyProcessing) -> None:
        self.processing, self.labels = state, list(state.labels)

    @property
    def module(self) -> torch.nn.Module:
        """The loaded torch network, e.g. for export."""
        return self._loaded()

    def preprocess(self, payload: Payload) -> ClassifyItem:
        """Decode, resize the short side to 256, centre-crop 224, scale to [0, 1], normalise: (3, 224, 224) float."""
        return self.processing.preprocess(payload)

    def predict_batch(self, items: Sequence[ClassifyItem]) -> list[TopK]:
        """One forward pass; softmax in fp32 and top-k on the device, results on the CPU."""
        network = self._loaded()
        with torch.inference_mode():
            logits = network(self.processing.network_input(items, self.device, half=self.options.half))
            return self.processing.decode(logits)

    def postprocess(self, output: TopK, item: ClassifyItem) -> dict[str, Any]:
        return self.processing.postprocess(output, item)

    def describe_input(self, payload: Payload, item: ClassifyItem) -> dict[str, Any]:
        size = image_size(payload.body)
        return {} if size is None else {"image_width": size[0], "image_height": size[1]}

    def memory_estimate(self) -> MemoryEstimate:
        """Weights as loaded; per item the input plus every activation of one forward (an upper bound)."""
        network = self._loaded()
        weights = tensor_bytes([*network.parameters(), *network.buffers()])
        dtype = torch.float16 if self.options.half else torch.float32
        probe = torch.zeros((1, 3, CROP, CROP), dtype=dtype, device=self.device)
        inputs = probe.numel() * (4 + probe.element_size())  # the fp32 upload and its device copy
        per_item = inputs + activation_bytes(network, probe) + self.processing.decode_bytes()
        return MemoryEstimate(weights_bytes=weights, per_item_bytes=per_item)

    def example_payload(self) -> Payload:
        return example_jpeg()

    def unload(self) -> None:
        self._network = None
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _read_labels(self, num_classes: int) -> list[str]:
        """The labels file, or the ImageNet categories for a 1000-class model, or the ids as text."""
        if self.labels_path is None:
            if num_classes == 1000:  # the categories live in the weights enum's metadata; nothing downloads
                import torchvision

                return list(torchvision.models.ResNet18_Weights.IMAGENET1K_V1.meta["categories"])
            return [str(i) for i in range(num_classes)]
        try:
            lines = self.labels_path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise FileNotFoundError(f"labels_file {self.options.labels_file!r}: {exc.strerror}") from None
        while lines and not lines[-1].strip():
            lines.pop()
        labels = [line.strip() for line in lines]
        if len(labels) != num_classes:
            name = self.options.labels_file
            raise ValueError(f"labels_file {name!r} has {len(labels)} labels; the model has {num_classes} classes")
        return labels

    def _loaded(self) -> torch.nn.Module:
        if self._network is None:
            raise RuntimeError(f"model {self.context.model_name!r} is not loaded")
        return self._network


def _read_state_dict(path: Path) -> Mapping[str, torch.Tensor]:
    """A plain state dict (or {"state_dict": ...}) read with weights_only=True, so no code runs."""
    if not path.is_file():
        raise FileNotFoundError(
            f"weights file {str(path)!r} not found; run `model-router store init-demo` for the demo weights"
        )
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{str(path)!r} is not a readable state dict (torch.load weights_only=True): {first}"
        ) from None
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ValueError(f"{str(path)!r} does not hold a state dict of tensors, got {type(loaded).__name__}")
    return loaded


def _fc_rows(state: Mapping[str, torch.Tensor], path: Path) -> int:
    weight = state.get("fc.weight")
    if weight is None or weight.dim() != 2:
        raise ValueError(f"{str(path)!r} has no 2-d 'fc.weight'; it is not a torchvision ResNet state dict")
    return int(weight.shape[0])

