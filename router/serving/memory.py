"""Giving freed memory back to the device, so an unload shows in the probe."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
from collections.abc import Callable
from functools import cache

__all__ = ["give_back_memory", "malloc_trim"]


@cache
def _libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None elsewhere (musl, macOS)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    return trim


def malloc_trim() -> bool:
    """Return the allocator's free memory to the system; False where that is not possible."""
    trim = _libc_malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def give_back_memory(device: str) -> None:
    """After an unload, on the instance's thread: collect garbage, empty torch's CUDA cache for a
    GPU, and hand glibc's free lists back to the system (without this, freed host memory stays in
    the process and an unload never shows)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if device.startswith("cuda") and torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
    malloc_trim()
