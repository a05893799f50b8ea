"""Device names (`cpu`, `cuda:N`): parsed in one place for the fleet file and for plugins."""

from __future__ import annotations

import re

__all__ = ["DEVICE_PATTERN", "check_device_name", "device_index", "require_cuda_for_half"]

DEVICE_PATTERN = re.compile(r"^(cpu|cuda:(\d+))$")


def check_device_name(name: str) -> None:
    """ValueError naming the accepted forms unless `name` is `cpu` or `cuda:N`."""
    device_index(name)


def device_index(name: str) -> int | None:
    """None for `cpu`, N for `cuda:N`; ValueError for anything else."""
    match = DEVICE_PATTERN.match(name)
    if match is None:
        raise ValueError(f"device {name!r} is not valid; accepted: 'cpu' or 'cuda:N'")
    return None if match.group(2) is None else int(match.group(2))


def require_cuda_for_half(model: str, device: str, half: bool) -> None:
    """fp16 weights and inputs are a CUDA feature: refuse `half: true` elsewhere, at load."""
    if half and not device.startswith("cuda"):
        raise ValueError(
            f"model {model!r}: half: true needs a CUDA device, got {device!r}; set half: false for CPU instances"
        )
