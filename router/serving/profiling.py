"""Memory figures for a model: declared values, plugin estimates, and CUDA peak profiling at warm-up."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence

from router.config import MemoryConfig
from router.sdk.plugin import MemoryEstimate, ModelPlugin

__all__ = ["SAFETY_MARGIN", "apply_declared", "fit_linear", "max_batch_within", "profile_cuda", "profile_sizes"]

log = logging.getLogger("router.serving.profiling")
SAFETY_MARGIN = 0.2


def apply_declared(estimate: MemoryEstimate, declared: MemoryConfig) -> MemoryEstimate:
    """Values declared in the fleet file override the plugin's estimate."""
    if declared.weights is None and declared.per_item is None and declared.fixed is None:
        return estimate
    return MemoryEstimate(
        weights_bytes=int(declared.weights) if declared.weights is not None else estimate.weights_bytes,
        per_item_bytes=int(declared.per_item) if declared.per_item is not None else estimate.per_item_bytes,
        fixed_bytes=int(declared.fixed) if declared.fixed is not None else estimate.fixed_bytes,
        source="declared",
    )


def fit_linear(points: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """Least-squares fit of bytes = fixed + per_item * n; both clamped at zero."""
    if not points:
        raise ValueError("no points to fit")
    if len(points) == 1:
        n, peak = points[0]
        return 0, max(0, peak // max(n, 1))
    count = len(points)
    mean_n = sum(n for n, _ in points) / count
    mean_b = sum(b for _, b in points) / count
    var = sum((n - mean_n) ** 2 for n, _ in points)
    slope = sum((n - mean_n) * (b - mean_b) for n, b in points) / var if var else 0.0
    per_item = max(0.0, slope)
    fixed = max(0.0, mean_b - per_item * mean_n)
    return int(fixed), int(per_item + 0.5)


def max_batch_within(estimate: MemoryEstimate, budget: int | None, limit: int, margin: float = SAFETY_MARGIN) -> int:
    """The largest batch (<= limit) whose cost, plus the margin, fits beside the weights in budget."""
    if budget is None:
        return limit
    room = budget - estimate.weights_bytes
    best = 0
    for n in range(1, limit + 1):
        if estimate.batch_bytes(n) * (1 + margin) <= room:
            best = n
        else:
            break
    return best


def profile_sizes(max_size: int) -> list[int]:
    """1, 2, 4, ... up to and including max_size."""
    sizes, n = [], 1
    while n < max_size:
        sizes.append(n)
        n *= 2
    sizes.append(max_size)
    return sizes


def profile_cuda(
    plugin: ModelPlugin,  # type: ignore[type-arg]
    device: str,
    weights_bytes: int,
    sizes: Sequence[int],
    progress: Callable[[int, int, int], None] | None = None,
) -> MemoryEstimate | None:
    """Measure peak allocated memory per batch size with torch.cuda.max_memory_allocated and fit a
    per-item cost. Runs on the instance's thread. Stops at the first size that runs out of memory."""
    torch = sys.modules.get("torch")
    if torch is None or not device.startswith("cuda") or plugin.example_payload() is None:
        return None
    index = torch.device(device)
    points: list[tuple[int, int]] = []
    for step, n in enumerate(sizes, start=1):
        torch.cuda.synchronize(index)
        torch.cuda.reset_peak_memory_stats(index)
        base = torch.cuda.memory_allocated(index)
        try:
            plugin.warmup(n)
        except torch.cuda.OutOfMemoryError:
            log.warning("profiling stopped at batch %d: out of memory", n)
            torch.cuda.empty_cache()
            break
        torch.cuda.synchronize(index)
        points.append((n, torch.cuda.max_memory_allocated(index) - base))
        if progress is not None:
            progress(step, len(sizes), n)
    if not points:
        return None
    fixed, per_item = fit_linear(points)
    return MemoryEstimate(weights_bytes, per_item, fixed, source="profiled")
