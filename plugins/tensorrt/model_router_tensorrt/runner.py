"""One deserialised TensorRT engine on one GPU: its execution context, its own CUDA stream, and
device buffers it owns, addressed by tensor name. Needs `tensorrt` (imported when constructed)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from model_router_engines.metadata import ExportMetadata

from model_router_tensorrt.limits import BatchLimits, limits_from_profile, plan_chunks

__all__ = ["EngineRunner", "tensorrt_logger", "tensorrt_version"]

_LOGGERS: dict[str, Any] = {}


def tensorrt_version() -> str | None:
    """The installed TensorRT's version, or None when the package is missing or broken."""
    try:
        import tensorrt
    except Exception:  # noqa: BLE001  # ImportError, or a wheel whose native libraries do not load
        return None
    return str(tensorrt.__version__)


def tensorrt_logger(trt: Any) -> Any:
    """One logger for every builder and runtime: TensorRT warns when they are given different ones."""
    if "logger" not in _LOGGERS:
        _LOGGERS["logger"] = trt.Logger(trt.Logger.WARNING)
    return _LOGGERS["logger"]


class EngineRunner:
    """Runs batches through an engine; the only thing that touches TensorRT objects."""

    def __init__(self, engine_bytes: bytes, device: torch.device, metadata: ExportMetadata, model: str) -> None:
        import tensorrt as trt

        self._trt = trt
        self.device = device
        self.model = model
        self.input_name, self.output_name = metadata.input.name, metadata.output.name
        self.engine_bytes = len(engine_bytes)
        with torch.cuda.device(device):
            self._runtime = trt.Runtime(tensorrt_logger(trt))
            self._engine = self._runtime.deserialize_cuda_engine(engine_bytes)
            if self._engine is None:
                raise ValueError(
                    f"model {model!r}: TensorRT {trt.__version__} cannot deserialise the engine; engines are tied "
                    "to the TensorRT version and GPU they were built with: rebuild it with `model-router export`"
                )
            self._check_io()
            low, opt, high = self._engine.get_tensor_profile_shape(self.input_name, 0)
            self.limits: BatchLimits = limits_from_profile(self.input_name, low, opt, high, expected=metadata.input.shape)
            self._context = self._engine.create_execution_context()
            self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self._context.set_optimization_profile_async(0, self.stream.cuda_stream)
            self.buffers = self._allocate()
            self.stream.synchronize()

    @property
    def device_memory_bytes(self) -> int:
        """The execution context's scratch memory, as the engine reports it."""
        engine = self._engine
        size = getattr(engine, "device_memory_size_v2", None)  # TensorRT >= 10.1
        return int(size if size is not None else engine.device_memory_size)

    @property
    def buffer_bytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers.values())

    def run(self, batch: torch.Tensor) -> torch.Tensor:
        """The engine's output for a batch already on the device, in chunks the profile accepts."""
        outputs, start = [], 0
        with torch.cuda.device(self.device):  # TensorRT runs on the current device
            for take, size in plan_chunks(int(batch.shape[0]), self.limits):
                outputs.append(self._run_chunk(batch[start : start + take], size))
                start += take
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def close(self) -> None:
        """Release in dependency order: context, engine, runtime, then the buffers."""
        self.stream.synchronize()
        self._context = None
        self._engine = None
        self._runtime = None
        self.buffers = {}

    def _check_io(self) -> None:
        trt, engine = self._trt, self._engine
        modes = {}
        for index in range(engine.num_io_tensors):
            name = engine.get_tensor_name(index)
            modes[name] = "input" if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else "output"
        wanted = {self.input_name: "input", self.output_name: "output"}
        inputs = [name for name, mode in modes.items() if mode == "input"]
        if any(modes.get(name) != mode for name, mode in wanted.items()) or len(inputs) != 1:
            raise ValueError(
                f"model {self.model!r}: the metadata expects input {self.input_name!r} and output "
                f"{self.output_name!r}; the engine has {modes}"
            )

    def _allocate(self) -> dict[str, torch.Tensor]:
        """One buffer per I/O tensor, sized for the profile's max batch; their addresses never change."""
        trt, engine, context = self._trt, self._engine, self._context
        tail = tuple(engine.get_tensor_profile_shape(self.input_name, 0)[2])[1:]
        context.set_input_shape(self.input_name, (self.limits.max, *tail))
        buffers = {}
        for index in range(engine.num_io_tensors):
            name = engine.get_tensor_name(index)
            shape = tuple(context.get_tensor_shape(name))
            dtype = torch.from_numpy(np.empty(0, dtype=trt.nptype(engine.get_tensor_dtype(name)))).dtype
            buffers[name] = torch.empty(shape, dtype=dtype, device=self.device)
            context.set_tensor_address(name, buffers[name].data_ptr())
        return buffers

    def _run_chunk(self, chunk: torch.Tensor, size: int) -> torch.Tensor:
        take, context = int(chunk.shape[0]), self._context
        staged = self.buffers[self.input_name]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the chunk was written on torch's stream
        with torch.cuda.stream(self.stream):
            staged[:take].copy_(chunk)
            if size > take:
                staged[take:size].zero_()
        if not context.set_input_shape(self.input_name, (size, *staged.shape[1:])):
            raise ValueError(f"model {self.model!r}: batch {size} is outside the engine's profile {self.limits}")
        shape = tuple(context.get_tensor_shape(self.output_name))
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError(f"model {self.model!r}: TensorRT execute_async_v3 failed (see its log)")
        self.stream.synchronize()
        output = self.buffers[self.output_name].view(-1)[: math.prod(shape)].view(shape)
        return output[:take].to(torch.float32, copy=True)  # the buffer is reused by the next run
