"""The plugin SDK: everything a model plugin imports from the router, and nothing else.

    from router.sdk import InputError, MemoryEstimate, ModelPlugin, Payload, PluginContext, decode_image

See docs/plugins.md for the contract: which thread runs each hook, the memory estimate, warm-up,
what KServe V2 hands to `preprocess`, and the errors to raise. `activation_bytes` and
`tensor_bytes` (torch helpers for memory estimates) import torch only when first used.
"""

from __future__ import annotations

from typing import Any

from router.errors import DeviceOutOfMemory, InputError, PayloadTooLarge, UnsupportedMediaType
from router.sdk.images import (
    ACCEPTED_MEDIA_TYPES,
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_PIXELS,
    ImageHeader,
    OpenedImage,
    decode_image,
    example_jpeg,
    image_size,
    open_image,
    reduction_for,
)
from router.sdk.plugin import MemoryEstimate, ModelPlugin, NoOptions, Payload, PluginContext

__all__ = [
    "ACCEPTED_MEDIA_TYPES",
    "DEFAULT_MAX_ASPECT_RATIO",
    "DEFAULT_MAX_PIXELS",
    "DeviceOutOfMemory",
    "ImageHeader",
    "InputError",
    "MemoryEstimate",
    "ModelPlugin",
    "NoOptions",
    "OpenedImage",
    "Payload",
    "PayloadTooLarge",
    "PluginContext",
    "UnsupportedMediaType",
    "activation_bytes",
    "decode_image",
    "example_jpeg",
    "image_size",
    "open_image",
    "reduction_for",
    "tensor_bytes",
]

_TORCH_HELPERS = ("activation_bytes", "tensor_bytes")


def __getattr__(name: str) -> Any:
    if name in _TORCH_HELPERS:
        from router.sdk import torch_memory

        return getattr(torch_memory, name)
    raise AttributeError(f"module 'router.sdk' has no attribute {name!r}")
