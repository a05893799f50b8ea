"""Decisions of the tensorrt plugin that need no TensorRT: the batch range an engine's
optimisation profile allows, how a batch is split to fit it, what keeps the plugin from starting,
and the memory estimate. Pure functions of plain values, unit-tested without a GPU."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.sdk import MemoryEstimate

__all__ = [
    "BatchLimits",
    "engine_estimate",
    "limits_from_profile",
    "plan_chunks",
    "startup_error",
    "startup_problems",
]

MIN_TENSORRT_MAJOR = 10  # named I/O tensors and execute_async_v3


@dataclass(frozen=True)
class BatchLimits:
    """The batch sizes an engine accepts (profile min and max) and the one it was tuned for (opt)."""

    min: int
    opt: int
    max: int


def limits_from_profile(
    name: str,
    min_shape: Sequence[int],
    opt_shape: Sequence[int],
    max_shape: Sequence[int],
    expected: Sequence[int] | None = None,
) -> BatchLimits:
    """The batch limits of input `name` from its profile shapes (min, opt, max).

    Only the leading batch axis may vary; `expected` (the shape without batch that the export
    metadata records) must match the rest. Raises ValueError naming the tensor and the shapes.
    """
    shapes = [tuple(int(d) for d in shape) for shape in (min_shape, opt_shape, max_shape)]
    if len({len(shape) for shape in shapes}) != 1 or not shapes[0]:
        raise ValueError(f"input {name!r}: profile shapes of different or zero rank: {shapes}")
    tails = {shape[1:] for shape in shapes}
    if len(tails) != 1:
        raise ValueError(
            f"input {name!r}: the profile varies more than the batch axis (min {shapes[0]}, max {shapes[2]}); "
            "the tensorrt plugin serves engines whose only dynamic axis is the batch"
        )
    tail = tails.pop()
    if expected is not None and tail != tuple(expected):
        raise ValueError(f"input {name!r}: the engine takes {list(tail)} per item, the metadata says {list(expected)}")
    low, opt, high = (shape[0] for shape in shapes)
    if not 1 <= low <= opt <= high:
        raise ValueError(f"input {name!r}: profile batch sizes must satisfy 1 <= min <= opt <= max, got {low}, {opt}, {high}")
    return BatchLimits(low, opt, high)


def plan_chunks(count: int, limits: BatchLimits) -> list[tuple[int, int]]:
    """Runs for a batch of `count`: (items, run size). Chunks of at most `max`; a chunk below `min`
    runs padded to `min` (the padding's outputs are dropped)."""
    if count < 1:
        raise ValueError(f"a batch needs at least one item, got {count}")
    runs = []
    left = count
    while left:
        take = min(left, limits.max)
        runs.append((take, max(take, limits.min)))
        left -= take
    return runs


def startup_problems(
    device: str, *, tensorrt_version: str | None, cuda_available: bool
) -> list[str]:
    """Why the plugin cannot run here (empty: it can). `tensorrt_version` None: not installed."""
    problems = []
    if tensorrt_version is None:
        problems.append("the `tensorrt` package is not installed (pip install -e 'plugins/tensorrt[tensorrt]')")
    elif _major(tensorrt_version) < MIN_TENSORRT_MAJOR:
        problems.append(f"TensorRT {tensorrt_version} is too old; {MIN_TENSORRT_MAJOR}.0 or newer is needed")
    if not device.startswith("cuda:"):
        problems.append(f"device {device!r} is not a CUDA device; TensorRT engines run on device: cuda:N")
    elif not cuda_available:
        problems.append(f"device {device!r} is not available: torch.cuda.is_available() is False")
    return problems


def startup_error(model: str, problems: Sequence[str]) -> str:
    return f"model {model!r}: the tensorrt plugin cannot start: " + "; ".join(problems)


def engine_estimate(
    engine_bytes: int, device_memory_bytes: int, buffer_bytes: int, per_item_bytes: int
) -> MemoryEstimate:
    """Everything an engine holds from load on counts as weights: the deserialised engine, its
    execution context's device memory (sized for the profile's max batch) and the plugin's own I/O
    buffers. A batch adds only its staged input and the copy of its output."""
    return MemoryEstimate(
        weights_bytes=engine_bytes + device_memory_bytes + buffer_bytes, per_item_bytes=per_item_bytes
    )


def _major(version: str) -> int:
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else 0
