"""Memory estimates for torch networks, shared by torch-based plugins (importing it needs torch)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["activation_bytes", "tensor_bytes"]


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def activation_bytes(network: torch.nn.Module, probe: torch.Tensor) -> int:
    """Sum of every leaf module's output bytes for one forward of `probe`: an upper bound on the
    activation memory one input needs."""
    total = 0

    def count(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        nonlocal total
        outputs = output if isinstance(output, (list, tuple)) else [output]
        total += tensor_bytes(t for t in outputs if isinstance(t, torch.Tensor))

    leaves = [m for m in network.modules() if next(m.children(), None) is None]
    handles = [m.register_forward_hook(count) for m in leaves]
    try:
        with torch.inference_mode():
            network(probe)
    finally:
        for handle in handles:
            handle.remove()
    return total
