"""The demo model store: untrained but deterministic checkpoints built locally, so the demo fleet
runs with nothing downloaded. Heavy libraries are imported only while building."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEMO_FILES", "DemoFile", "DemoStoreError", "Progress", "init_demo"]

Progress = Callable[[str], None]
_SEED = 0


class DemoStoreError(RuntimeError):
    """A demo file cannot be built, e.g. the plugin package that brings its library is missing."""


@dataclass(frozen=True)
class DemoFile:
    """One file of the demo store and how to build it."""

    name: str
    description: str
    modules: tuple[str, ...]  # importable modules the builder needs
    install: str  # what to install when they are missing
    build: Callable[[Path], None]


def init_demo(store_dir: Path, *, force: bool = False, progress: Progress | None = None) -> list[Path]:
    """Build the demo checkpoints in `store_dir`, skipping existing files unless `force`; return the files built.

    Raises DemoStoreError before building anything if a needed library is missing.
    """
    report = progress or _to_stderr
    store_dir.mkdir(parents=True, exist_ok=True)
    todo = [demo for demo in DEMO_FILES if force or not (store_dir / demo.name).exists()]
    for demo in DEMO_FILES:
        if demo not in todo:
            report(f"skip {demo.name}: already in {store_dir} (force to rebuild)")
    _check_modules(todo)
    built = []
    for step, demo in enumerate(todo, 1):
        target = store_dir / demo.name
        report(f"[{step}/{len(todo)}] {demo.name}: building {demo.description} ...")
        started = time.perf_counter()
        _build_atomically(demo, target)
        size_mb = target.stat().st_size / 1e6
        report(f"[{step}/{len(todo)}] {demo.name}: done, {size_mb:.1f} MB in {time.perf_counter() - started:.1f} s")
        built.append(target)
    return built


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _check_modules(todo: list[DemoFile]) -> None:
    missing = [
        f"{demo.name} needs {', '.join(m for m in demo.modules if importlib.util.find_spec(m) is None)}: {demo.install}"
        for demo in todo
        if any(importlib.util.find_spec(m) is None for m in demo.modules)
    ]
    if missing:
        raise DemoStoreError("cannot build the demo store; " + "; ".join(missing))


def _build_atomically(demo: DemoFile, target: Path) -> None:
    """Write next to the target and rename, so an interrupted build never leaves a file that later counts as built."""
    partial = target.with_name(f".{target.stem}.partial{target.suffix}")
    try:
        demo.build(partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _build_yolo(path: Path) -> None:
    """YOLOv8n from its architecture YAML, seeded and calibrated, saved as a real ultralytics checkpoint."""
    os.environ.setdefault("YOLO_OFFLINE", "1")  # no connectivity probe, no downloads
    os.environ.setdefault("YOLO_AUTOINSTALL", "false")  # and no pip installs
    import torch
    from ultralytics import YOLO  # type: ignore[attr-defined]  # lazily re-exported
    from ultralytics.utils import YAML
    from ultralytics.utils.checks import check_yaml

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        yolo = YOLO("yolov8n.yaml", verbose=False)
    network: Any = yolo.model
    _calibrate_batchnorm(network, torch.Generator().manual_seed(_SEED), side=256)
    _tune_class_logits(network)
    coco: Any = YAML.load(check_yaml("coco.yaml"))  # type: ignore[no-untyped-call]  # ships with ultralytics
    network.names = dict(coco["names"])
    yolo.save(path)


def _calibrate_batchnorm(network: Any, generator: Any, *, side: int) -> None:
    """Make an untrained network's output depend on the image.

    With default initialisation the BatchNorm statistics (mean 0, variance 1) do not match the real
    activations: in YOLO they fade layer by layer until every score is about 1e-5, in ResNet one
    input-independent direction dominates the logits. Statistics measured on a few synthetic
    images restore unit-scale, image-dependent activations.
    """
    import torch

    norms = [m for m in network.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    momenta = [bn.momentum for bn in norms]
    for bn in norms:
        bn.reset_running_stats()
        bn.momentum = None  # a plain average over the calibration batches
    network.train()
    with torch.no_grad():
        for _ in range(3):
            network(_synthetic_images(generator, count=4, side=side))
    for bn, momentum in zip(norms, momenta, strict=True):
        bn.momentum = momentum
    network.eval()


def _tune_class_logits(detector: Any) -> None:
    """Narrow and lift the Detect head's class logits: untrained scores then spread over (0, 1)
    without saturating at 1.0, and some boxes pass the default conf of 0.25."""
    import torch

    with torch.no_grad():
        for branch in detector.model[-1].cv3:  # one class branch per detection level
            branch[-1].weight.mul_(0.25)
            branch[-1].bias.fill_(-3.0)


def _synthetic_images(generator: Any, *, count: int, side: int) -> Any:
    """Photo-like inputs in [0, 1]: smooth colour fields, fine noise, solid rectangles, letterbox bands."""
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


def _build_resnet(path: Path) -> None:
    """torchvision resnet18 with seeded random weights, calibrated, saved as a plain state dict."""
    import torch
    import torchvision  # type: ignore[import-untyped]

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        network = torchvision.models.resnet18(weights=None)
    _calibrate_batchnorm(network, torch.Generator().manual_seed(_SEED), side=224)
    torch.save(network.state_dict(), path)


DEMO_FILES: tuple[DemoFile, ...] = (
    DemoFile(
        name="yolov8n.pt",
        description="YOLOv8n detector (untrained, COCO labels)",
        modules=("torch", "ultralytics"),
        install="install the yolo plugin: pip install -e plugins/yolo (model-router-yolo)",
        build=_build_yolo,
    ),
    DemoFile(
        name="resnet18.pt",
        description="ResNet-18 classifier state dict (untrained, ImageNet labels)",
        modules=("torch", "torchvision"),
        install="install the resnet plugin: pip install -e plugins/resnet (model-router-resnet)",
        build=_build_resnet,
    ),
)
