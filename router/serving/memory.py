"""Giving freed memory back to the device, so an unload shows in the probe."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
from functools import cache

__all__ = ["give_back_memory"]


@cache
def _malloc_trim() -> object | None:
    """glibc's malloc_trim, or None elsewhere (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


def give_back_memory(device: str) -> None:
    """After an unload, on the instance's thread: collect garbage, empty torch's CUDA cache for a
    GPU, and hand glibc's free lists back to the system (without this, freed host memory stays in
    the process and an unload never shows)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if device.startswith("cuda") and torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)  # type: ignore[operator]
