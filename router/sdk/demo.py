"""Demo model files: untrained but deterministic checkpoints a plugin can build locally, so a demo
fleet runs with nothing downloaded.

A plugin distribution declares each file under the entry-point group `model_router.demo_files`;
`model-router store init-demo` builds the missing ones:

    [project.entry-points."model_router.demo_files"]
    resnet18 = "model_router_resnet.demo:RESNET18"

The torch helpers import torch only when called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEMO_FILES_GROUP", "DemoFile", "calibrate_batchnorm", "synthetic_images"]

DEMO_FILES_GROUP = "model_router.demo_files"


@dataclass(frozen=True)
class DemoFile:
    """One file of the demo store and how to build it. `build` writes the file at the path it is
    given (a partial path, renamed once it returns) and imports heavy libraries only when called."""

    name: str
    description: str
    build: Callable[[Path], None]


def calibrate_batchnorm(network: Any, seed: int, *, side: int) -> None:
    """Make an untrained network's output depend on the image.

    With default initialisation the BatchNorm statistics (mean 0, variance 1) do not match the real
    activations: in YOLO they fade layer by layer until every score is about 1e-5, in ResNet one
    input-independent direction dominates the logits. Statistics measured on a few synthetic
    images restore unit-scale, image-dependent activations. They are measured on one thread: the
    sums come out a little differently with each thread count, and the checkpoint should not depend
    on the machine (or the thread setting) that built it.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _calibrate(network, torch.Generator().manual_seed(seed), side)
    finally:
        torch.set_num_threads(threads)


def _calibrate(network: Any, generator: Any, side: int) -> None:
    import torch

    norms = [m for m in network.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    momenta = [bn.momentum for bn in norms]
    for bn in norms:
        bn.reset_running_stats()
        bn.momentum = None  # a plain average over the calibration batches
    network.train()
    with torch.no_grad():
        for _ in range(3):
            network(synthetic_images(generator, count=4, side=side))
    for bn, momentum in zip(norms, momenta, strict=True):
        bn.momentum = momentum
    network.eval()


def synthetic_images(generator: Any, *, count: int, side: int) -> Any:
    """Photo-like (count, 3, side, side) float images in [0, 1]: smooth colour fields, fine noise,
    solid rectangles and the grey bands a letterbox adds. `generator` is a torch.Generator; the
    same seed gives the same images (the demo checkpoints depend on it)."""
    import torch
    import torch.nn.functional as F

    coarse = torch.rand(count, 3, 8, 8, generator=generator)
    images = F.interpolate(coarse, size=(side, side), mode="bilinear", align_corners=False)
    images += 0.05 * torch.randn(count, 3, side, side, generator=generator)
    for image in images:
        for _ in range(4):
            x0, y0 = torch.randint(0, side - 8, (2,), generator=generator).tolist()
            width, height = torch.randint(8, side // 2, (2,), generator=generator).tolist()
            image[:, y0 : y0 + height, x0 : x0 + width] = torch.rand(3, 1, 1, generator=generator)
        band = int(torch.randint(0, side // 3, (1,), generator=generator))
        if band:  # the grey (114) padding a letterbox adds
            image[:, :band] = 114 / 255
            image[:, side - band :] = 114 / 255
    return images.clamp_(0, 1)
