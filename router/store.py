"""The demo model store: untrained but deterministic checkpoints built locally, so the demo fleet
runs with nothing downloaded.

The files and their builders belong to the plugins that serve them (the `yolo` plugin builds
`yolov8n.pt`, the `resnet` plugin `resnet18.pt`), declared under the entry-point group
`model_router.demo_files`; this module only finds them and builds the missing ones.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from router.errors import PluginValidationError
from router.sdk.demo import DEMO_FILES_GROUP, DemoFile
from router.sdk.files import partial_file
from router.serving.registry import Discovered, discover

__all__ = ["DemoStoreError", "Progress", "demo_files", "init_demo"]

Progress = Callable[[str], None]


class DemoStoreError(RuntimeError):
    """A demo file cannot be built, e.g. the plugin package that declares it does not load."""


def demo_files() -> Discovered[DemoFile]:
    """Every declared demo file, by entry-point name; broken declarations with their error."""
    return discover(DEMO_FILES_GROUP, _demo_file)


def init_demo(
    store_dir: Path, *, force: bool = False, progress: Progress | None = None, files: Discovered[DemoFile] | None = None
) -> list[Path]:
    """Build the demo checkpoints in `store_dir`, skipping existing files unless `force`; return the files built.

    Raises DemoStoreError before building anything if a declared demo file cannot be loaded.
    """
    report = progress or _to_stderr
    found = demo_files() if files is None else files
    if found.broken:
        problems = "; ".join(f"{name}: {reason}" for name, reason in sorted(found.broken.items()))
        raise DemoStoreError(f"cannot build the demo store; broken demo file entry points: {problems}")
    declared = sorted((entry.target for entry in found.entries.values()), key=lambda demo: demo.name)
    if not declared:
        raise DemoStoreError("no plugin declares demo files; install the bundled ones: pip install -e plugins/yolo "
                             "-e plugins/resnet")
    store_dir.mkdir(parents=True, exist_ok=True)
    todo = [demo for demo in declared if force or not (store_dir / demo.name).exists()]
    for demo in declared:
        if demo not in todo:
            report(f"skip {demo.name}: already in {store_dir} (force to rebuild)")
    built = []
    for step, demo in enumerate(todo, 1):
        target = store_dir / demo.name
        report(f"[{step}/{len(todo)}] {demo.name}: building {demo.description} ...")
        started = time.perf_counter()
        with partial_file(target) as partial:
            demo.build(partial)
        size_mb = target.stat().st_size / 1e6
        report(f"[{step}/{len(todo)}] {demo.name}: done, {size_mb:.1f} MB in {time.perf_counter() - started:.1f} s")
        built.append(target)
    return built


def _demo_file(name: str, target: object) -> DemoFile:
    if not isinstance(target, DemoFile):
        raise PluginValidationError(name, f"demo file entry point must name a router.sdk.DemoFile, got {target!r}")
    if "/" in target.name or target.name.startswith("."):
        raise PluginValidationError(name, f"demo file name must be a plain file name, got {target.name!r}")
    return target


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
