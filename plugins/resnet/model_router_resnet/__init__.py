"""model-router plugin `resnet`: image classification with torchvision ResNets."""

from model_router_resnet.plugin import ARCHS, ResNetOptions, ResNetPlugin, TopK

__all__ = ["ARCHS", "ResNetOptions", "ResNetPlugin", "TopK"]
