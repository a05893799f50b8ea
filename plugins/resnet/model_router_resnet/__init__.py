"""model-router plugin `resnet`: image classification with torchvision ResNets."""

from model_router_resnet.plugin import ARCHS, ResNetOptions, ResNetPlugin
from model_router_resnet.processing import ClassifyProcessing, TopK

__all__ = ["ARCHS", "ClassifyProcessing", "ResNetOptions", "ResNetPlugin", "TopK"]
