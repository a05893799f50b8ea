"""Serving an exported ONNX model on onnxruntime: the task, input size, normalisation and labels
come from the export's metadata; pre- and post-processing are the vision plugins' own."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from model_router_engines import (
    ExportMetadata,
    ProcessingHooks,
    ServingOverrides,
    TaskProcessing,
    build_processing,
    staged_input_bytes,
)
from pydantic import BaseModel, Field, field_validator

from model_router_onnx.graph import GraphFacts, read_graph
from model_router_onnx.providers import CUDA, TENSORRT, ProviderError, choose_providers
from router.sdk import (
    ACCEPTED_MEDIA_TYPES,
    MemoryEstimate,
    ModelPlugin,
    Payload,
    PluginContext,
    device_index,
    example_jpeg,
    image_size,
)

__all__ = ["OnnxOptions", "OnnxPlugin"]

log = logging.getLogger("model_router_onnx")


class OnnxOptions(ServingOverrides):
    """`options:` of a `plugin: onnx` model."""

    model: str = Field(description=".onnx file in the model store, written by `model-router export`")
    tensorrt_ep: bool = Field(True, description="on CUDA, run through onnxruntime's TensorRT EP where TensorRT is installed")
    tensorrt_fp16: bool = Field(False, description="let the TensorRT EP use fp16 kernels")
    threads: int = Field(0, ge=0, description="intra-op threads; 0 = onnxruntime's default (all cores)")

    @field_validator("model")
    @classmethod
    def _onnx_suffix(cls, value: str) -> str:
        if not value.lower().endswith(".onnx"):
            raise ValueError(f"model must be an .onnx file written by `model-router export`, got {value!r}")
        return value


class OnnxPlugin(ProcessingHooks, ModelPlugin[OnnxOptions]):
    """Any model exported by `model-router export`, on CPU, CUDA or the TensorRT EP."""

    Options: ClassVar[type[BaseModel]] = OnnxOptions
    accepts: ClassVar[tuple[str, ...]] = ACCEPTED_MEDIA_TYPES
    torch_memory: ClassVar[bool] = False  # onnxruntime / TensorRT allocate it, not torch

    def __init__(self, options: OnnxOptions, context: PluginContext) -> None:
        super().__init__(options, context)
        self.path = context.resolve_path(options.model)  # a path escaping the store fails here, at start-up
        self.device = torch.device("cpu")
        self.providers: list[str] = []
        self._facts: GraphFacts | None = None
        self._processing: TaskProcessing | None = None
        self._session: Any = None

    @property
    def metadata(self) -> ExportMetadata:
        return self._loaded()[0].metadata

    def load(self, device: str) -> None:
        """Read the metadata, pick providers for `device`, open the session and check it."""
        name = self.context.model_name
        ort = _onnxruntime(name)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"model {name!r}: ONNX file {str(self.path)!r} not found; write it with "
                "`model-router export --config FLEET --model SOURCE_MODEL`"
            )
        device_index(device)  # a bad device name fails before the file is read
        facts = read_graph(self.path)
        metadata = facts.metadata
        processing = build_processing(metadata, self.options, name)
        providers = choose_providers(
            device,
            ort.get_available_providers(),
            tensorrt_libs=importlib.util.find_spec("tensorrt") is not None,
            use_tensorrt=self.options.tensorrt_ep,
            fp16=self.options.tensorrt_fp16,
            profile=(metadata.input.name, metadata.input.shape, metadata.batch),
            cache_dir=self._engine_cache_dir() if device != "cpu" else None,
        )
        settings = ort.SessionOptions()
        if self.options.threads:
            settings.intra_op_num_threads = self.options.threads
        session = ort.InferenceSession(str(self.path), settings, providers=providers)
        self.providers = list(session.get_providers())
        self._check_session(session, device, [p for p, _ in providers], metadata)
        self.device = torch.device(device)
        self._facts, self._processing, self._session = facts, processing, session
        log.info("model %s: %s task on %s via %s", name, metadata.task, device, ", ".join(self.providers))

    def predict_batch(self, items: Sequence[Any]) -> list[Any]:
        """One session run for the batch; decoding (NMS or top-k) where the output is."""
        _, processing = self._loaded()
        with torch.inference_mode():
            batch = processing.network_input(items, self.device)
            raw = self._run(batch) if self.device.type == "cpu" else self._run_bound(batch)
            return processing.decode(raw)

    def describe_input(self, payload: Payload, item: Any) -> dict[str, Any]:
        size = image_size(payload.body)
        return {} if size is None else {"image_width": size[0], "image_height": size[1]}

    def memory_estimate(self) -> MemoryEstimate:
        """Initializers as weights; per item the input plus every shape-inferred intermediate (an upper bound)."""
        facts, _ = self._loaded()
        return MemoryEstimate(facts.weights_bytes, staged_input_bytes(facts.metadata) + facts.activation_bytes_per_item)

    def example_payload(self) -> Payload:
        return example_jpeg()

    def unload(self) -> None:
        self._session = None
        self._processing = None

    def _engine_cache_dir(self) -> str | None:
        """Where the TensorRT EP keeps the engines it builds, so a restart does not rebuild them."""
        cache = self.path.parent / ".trt-ep-cache"
        try:
            cache.mkdir(exist_ok=True)
        except OSError:  # a read-only model store: build every start instead
            return None
        return str(cache)

    def _check_session(self, session: Any, device: str, requested: list[str], metadata: ExportMetadata) -> None:
        """onnxruntime falls back to the CPU silently when a GPU provider fails to start: refuse that."""
        name = self.context.model_name
        if CUDA in requested and CUDA not in self.providers:
            raise ProviderError(
                f"model {name!r}: onnxruntime could not start {CUDA} on {device} (active: {self.providers}); "
                "check the CUDA and cuDNN libraries that onnxruntime-gpu needs"
            )
        if TENSORRT in requested and TENSORRT not in self.providers:
            log.warning("model %s: the TensorRT EP did not start; running on %s", name, ", ".join(self.providers))
        inputs = {i.name for i in session.get_inputs()}
        outputs = {o.name for o in session.get_outputs()}
        if metadata.input.name not in inputs or metadata.output.name not in outputs:
            raise ValueError(
                f"model {name!r}: the metadata names input {metadata.input.name!r} and output "
                f"{metadata.output.name!r}; the graph has inputs {sorted(inputs)} and outputs {sorted(outputs)}"
            )

    def _run(self, batch: torch.Tensor) -> torch.Tensor:
        session, metadata = self._session, self.metadata
        (raw,) = session.run([metadata.output.name], {metadata.input.name: batch.contiguous().numpy()})
        return torch.from_numpy(raw)

    def _run_bound(self, batch: torch.Tensor) -> torch.Tensor:
        """GPU: bind torch's device buffers as the session's input and output, so nothing crosses to the host."""
        metadata, index = self.metadata, self.device.index or 0
        batch = batch.contiguous().float()
        output = torch.empty((batch.shape[0], *metadata.output.shape), dtype=torch.float32, device=self.device)
        binding = self._session.io_binding()
        binding.bind_input(metadata.input.name, "cuda", index, np.float32, tuple(batch.shape), batch.data_ptr())
        binding.bind_output(metadata.output.name, "cuda", index, np.float32, tuple(output.shape), output.data_ptr())
        torch.cuda.current_stream(self.device).synchronize()  # the input was written on torch's stream
        self._session.run_with_iobinding(binding)  # returns once onnxruntime's stream has finished
        return output

    def _loaded(self) -> tuple[GraphFacts, TaskProcessing]:
        if self._facts is None or self._processing is None:
            raise RuntimeError(f"model {self.context.model_name!r} is not loaded")
        return self._facts, self._processing


def _onnxruntime(model: str) -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise RuntimeError(
            f"model {model!r}: the onnx plugin needs onnxruntime (pip install onnxruntime, or onnxruntime-gpu for "
            f"CUDA): {exc}"
        ) from None
    return onnxruntime
