"""The plugin SDK: everything a model plugin imports from the router, and nothing else.

    from router.sdk import InputError, MemoryEstimate, ModelPlugin, Payload, PluginContext, decode_image

See docs/plugins.md for the contract: which thread runs each hook, the memory estimate, warm-up,
what KServe V2 hands to `preprocess`, and the errors to raise. Besides model plugins, the SDK
holds the other kinds of entry point a plugin distribution may declare: exporters
(`Exporter`, for `model-router export`), demo files (`DemoFile`, for `model-router store
init-demo`) and pipeline transforms (`Transform`, docs/pipelines.md). `default_agreement`,
`top1_agreement` and `box_f1` measure how far two answers agree (`ModelPlugin.agreement`).
`loads_bounded` parses a client's JSON with its nesting and size bounded (400 or 413, never a
RecursionError). Importing it never imports torch: `activation_bytes` and `tensor_bytes` (torch
helpers for memory estimates) load it when first used, the demo helpers when called.
"""

from __future__ import annotations

from typing import Any

from router.devices import device_index, require_cuda_for_half
from router.errors import DeviceOutOfMemory, InputError, PayloadTooLarge, UnsupportedMediaType
from router.sdk.agreement import box_f1, default_agreement, iou, top1_agreement
from router.sdk.bounded_json import MAX_JSON_DEPTH, loads_bounded
from router.sdk.demo import DEMO_FILES_GROUP, DemoFile, calibrate_batchnorm, synthetic_images
from router.sdk.exporter import EXPORTERS_GROUP, Exporter, ExportError, ExportJob, Progress, SourceModel
from router.sdk.files import partial_file
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
from router.sdk.plugin import (
    DETECTIONS,
    PIXELS_MEDIA_TYPE,
    PLUGINS_GROUP,
    MemoryEstimate,
    ModelPlugin,
    NoOptions,
    Payload,
    PluginContext,
)
from router.sdk.transforms import TRANSFORMS_GROUP, ItemKind, StepItem, Transform, Transformed

__all__ = [
    "ACCEPTED_MEDIA_TYPES",
    "DEFAULT_MAX_ASPECT_RATIO",
    "DEFAULT_MAX_PIXELS",
    "DEMO_FILES_GROUP",
    "DETECTIONS",
    "EXPORTERS_GROUP",
    "MAX_JSON_DEPTH",
    "PIXELS_MEDIA_TYPE",
    "PLUGINS_GROUP",
    "TRANSFORMS_GROUP",
    "DemoFile",
    "DeviceOutOfMemory",
    "ExportError",
    "ExportJob",
    "Exporter",
    "ImageHeader",
    "InputError",
    "ItemKind",
    "MemoryEstimate",
    "ModelPlugin",
    "NoOptions",
    "OpenedImage",
    "Payload",
    "PayloadTooLarge",
    "PluginContext",
    "Progress",
    "SourceModel",
    "StepItem",
    "Transform",
    "Transformed",
    "UnsupportedMediaType",
    "activation_bytes",
    "box_f1",
    "calibrate_batchnorm",
    "decode_image",
    "default_agreement",
    "device_index",
    "example_jpeg",
    "image_size",
    "iou",
    "loads_bounded",
    "open_image",
    "partial_file",
    "reduction_for",
    "require_cuda_for_half",
    "synthetic_images",
    "tensor_bytes",
    "top1_agreement",
]

_TORCH_HELPERS = ("activation_bytes", "tensor_bytes")


def __getattr__(name: str) -> Any:
    if name in _TORCH_HELPERS:
        from router.sdk import torch_memory

        return getattr(torch_memory, name)
    raise AttributeError(f"module 'router.sdk' has no attribute {name!r}")
