"""The demo checkpoint this plugin serves: torchvision's resnet18 with seeded random weights,
calibrated, saved as a plain state dict. Declared under `model_router.demo_files`."""

from __future__ import annotations

from pathlib import Path

from router.sdk import DemoFile, calibrate_batchnorm

__all__ = ["RESNET18"]

_SEED = 0


def build_resnet18(path: Path) -> None:
    import torch
    import torchvision

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        network = torchvision.models.resnet18(weights=None)
    calibrate_batchnorm(network, _SEED, side=224)
    torch.save(network.state_dict(), path)


RESNET18 = DemoFile("resnet18.pt", "ResNet-18 classifier state dict (untrained, ImageNet labels)", build_resnet18)
