"""Serving a TensorRT engine built by `model-router export --format tensorrt`.

`tensorrt` is imported only at load, so the plugin installs, registers and validates its options
without it; a missing package or GPU is a load error naming the model. The task, input size,
normalisation and labels come from the engine's metadata file; pre- and post-processing are the
vision plugins' own.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from model_router_engines import (
    ExportMetadata,
    ProcessingHooks,
    ServingOverrides,
    TaskProcessing,
    build_processing,
    read_sidecar,
    sidecar_path,
    staged_input_bytes,
)
from pydantic import BaseModel, Field, field_validator

from model_router_tensorrt.limits import BatchLimits, engine_estimate, startup_error, startup_problems
from model_router_tensorrt.runner import EngineRunner, tensorrt_version
from router.sdk import ACCEPTED_MEDIA_TYPES, MemoryEstimate, ModelPlugin, Payload, PluginContext, example_jpeg

__all__ = ["TensorRTOptions", "TensorRTPlugin"]

log = logging.getLogger("model_router_tensorrt")
ENGINE_SUFFIXES = (".engine", ".plan")


class TensorRTOptions(ServingOverrides):
    """`options:` of a `plugin: tensorrt` model."""

    engine: str = Field(description="serialised engine (.engine or .plan) in the model store")
    metadata: str | None = Field(None, description="its export metadata; default: the engine's path + '.json'")

    @field_validator("engine")
    @classmethod
    def _engine_suffix(cls, value: str) -> str:
        if not value.lower().endswith(ENGINE_SUFFIXES):
            raise ValueError(f"engine must be a TensorRT .engine or .plan file, got {value!r}")
        return value

    @field_validator("metadata")
    @classmethod
    def _json_suffix(cls, value: str | None) -> str | None:
        if value is not None and not value.lower().endswith(".json"):
            raise ValueError(f"metadata must be the .json file written beside the engine, got {value!r}")
        return value


class TensorRTPlugin(ProcessingHooks, ModelPlugin[TensorRTOptions]):
    """A TensorRT engine with one dynamic batch axis, on its own CUDA stream."""

    Options: ClassVar[type[BaseModel]] = TensorRTOptions
    accepts: ClassVar[tuple[str, ...]] = ACCEPTED_MEDIA_TYPES
    torch_memory: ClassVar[bool] = False  # onnxruntime / TensorRT allocate it, not torch

    def __init__(self, options: TensorRTOptions, context: PluginContext) -> None:
        super().__init__(options, context)
        # Paths escaping the store fail here, at start-up.
        self.engine_path = context.resolve_path(options.engine)
        self.metadata_path = context.resolve_path(options.metadata) if options.metadata else sidecar_path(self.engine_path)
        self.device = torch.device("cpu")
        self.metadata: ExportMetadata | None = None
        self._processing: TaskProcessing | None = None
        self._runner: EngineRunner | None = None

    @property
    def batch_limits(self) -> BatchLimits:
        """The engine profile's batch range; larger batches run in chunks of at most `max`."""
        return self._loaded()[1].limits

    def load(self, device: str) -> None:
        """Check TensorRT and the GPU, read the metadata, deserialise the engine and allocate its buffers."""
        name = self.context.model_name
        problems = startup_problems(device, tensorrt_version=tensorrt_version(), cuda_available=torch.cuda.is_available())
        if problems:
            raise RuntimeError(startup_error(name, problems))
        if not self.engine_path.is_file():
            raise FileNotFoundError(
                f"model {name!r}: engine {str(self.engine_path)!r} not found; build it on this GPU with "
                "`model-router export --format tensorrt --model SOURCE_MODEL`"
            )
        metadata = read_sidecar(self.metadata_path)
        processing = build_processing(metadata, self.options, name)
        self.device = torch.device(device)
        runner = EngineRunner(self.engine_path.read_bytes(), self.device, metadata, name)
        if runner.limits.max < metadata.batch.max:
            log.warning("model %s: the engine's profile allows batches up to %d, the export asked for %d",
                        name, runner.limits.max, metadata.batch.max)
        self.metadata, self._processing, self._runner = metadata, processing, runner

    def predict_batch(self, items: Sequence[Any]) -> list[Any]:
        """Stage the batch on the device, run the engine on the plugin's stream, decode where the output is."""
        processing, runner = self._loaded()
        with torch.inference_mode():
            raw = runner.run(processing.network_input(items, self.device))
            return processing.decode(raw)

    def memory_estimate(self) -> MemoryEstimate:
        """Engine plus its device memory plus the owned buffers as weights; per item the staged input and output copy."""
        _, runner = self._loaded()
        assert self.metadata is not None
        per_item = staged_input_bytes(self.metadata) + 4 * math.prod(self.metadata.output.shape)
        return engine_estimate(runner.engine_bytes, runner.device_memory_bytes, runner.buffer_bytes, per_item)

    def example_payload(self) -> Payload:
        return example_jpeg()

    def unload(self) -> None:
        if self._runner is not None:
            self._runner.close()
        self._runner = None
        self._processing = None
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _loaded(self) -> tuple[TaskProcessing, EngineRunner]:
        if self._processing is None or self._runner is None:
            raise RuntimeError(f"model {self.context.model_name!r} is not loaded")
        return self._processing, self._runner
