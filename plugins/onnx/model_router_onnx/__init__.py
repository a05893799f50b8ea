"""model-router plugin `onnx`: models exported by `model-router export`, served on onnxruntime; and
the `onnx` exporter that writes them. The export metadata and checks live in `model_router_engines`."""

from model_router_onnx.plugin import OnnxOptions, OnnxPlugin
from model_router_onnx.providers import ProviderError, choose_providers

__all__ = ["OnnxOptions", "OnnxPlugin", "ProviderError", "choose_providers"]
