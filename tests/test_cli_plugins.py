"""`model-router plugins`: every entry point the router reads, and a non-zero exit when one is broken."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def broken_distribution(root: Path) -> Path:
    """A distribution on sys.path whose plugin and exporter entry points name modules that do not exist."""
    info = root / "model_router_broken-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: model-router-broken\nVersion: 0.1.0\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(
        "[model_router.plugins]\nbroken = no_such_package.plugin:Plugin\n\n"
        "[model_router.exporters]\ngif = no_such_package.export:GifExporter\n",
        encoding="utf-8",
    )
    return root


def plugins_command(extra_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "router", "plugins"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_plugins_lists_plugins_exporters_and_demo_files_and_exits_zero() -> None:
    done = plugins_command()

    assert done.returncode == 0, done.stdout + done.stderr
    names = [line.split("\t")[0] for line in done.stdout.splitlines()]
    assert {"yolo", "resnet", "onnx", "tensorrt", "toy", "scripted", "mean-colour"} <= set(names)
    assert {"exporter onnx", "exporter tensorrt", "demo file yolov8n", "demo file resnet18"} <= set(names)
    assert "BROKEN" not in done.stdout


def test_plugins_exits_non_zero_naming_each_broken_entry_point(tmp_path: Path) -> None:
    done = plugins_command(broken_distribution(tmp_path))

    assert done.returncode == 1
    broken = [line.split("\t") for line in done.stdout.splitlines() if "\tBROKEN\t" in line]
    assert [(name, reason.split(":")[0]) for name, _, reason in broken] == [
        ("broken", "ModuleNotFoundError"), ("exporter gif", "ModuleNotFoundError")]
    assert "no_such_package" in broken[0][2]
    assert "model-router: 2 broken entry point(s): broken, exporter gif" in done.stderr
    assert "yolo\t" in done.stdout  # the healthy ones are still listed
