"""The demo checkpoints this plugin serves: torchvision's resnet18 with seeded random weights,
calibrated, saved as a plain state dict; a second one, seeded differently, is the other version of
the demo fleet with versions (config/fleet.versions.yaml). Declared under `model_router.demo_files`."""

from __future__ import annotations

from pathlib import Path

from router.sdk import DemoFile, calibrate_batchnorm

__all__ = ["RESNET18", "RESNET18_B"]

_SEED = 0
_SEED_B = 1


def build_resnet18(path: Path, seed: int = _SEED) -> None:
    import torch
    import torchvision

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        network = torchvision.models.resnet18(weights=None)
    calibrate_batchnorm(network, seed, side=224)
    torch.save(network.state_dict(), path)


def build_resnet18_b(path: Path) -> None:
    build_resnet18(path, _SEED_B)


RESNET18 = DemoFile("resnet18.pt", "ResNet-18 classifier state dict (untrained, ImageNet labels)", build_resnet18)
RESNET18_B = DemoFile("resnet18-b.pt", "ResNet-18 classifier state dict, seeded differently (a second version)",
                      build_resnet18_b)
