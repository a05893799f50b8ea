"""model-router plugin `onnx`: models exported by `model-router export`, served on onnxruntime."""

from model_router_onnx.metadata import METADATA_KEY, BatchProfile, ExportMetadata, MetadataError
from model_router_onnx.plugin import OnnxOptions, OnnxPlugin
from model_router_onnx.providers import ProviderError, choose_providers

__all__ = [
    "METADATA_KEY",
    "BatchProfile",
    "ExportMetadata",
    "MetadataError",
    "OnnxOptions",
    "OnnxPlugin",
    "ProviderError",
    "choose_providers",
]
