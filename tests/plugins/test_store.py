"""The demo model store (router.store): the files come from the plugins that serve them, through
the `model_router.demo_files` entry points; skip, rebuild, determinism, a broken declaration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_router_resnet.demo import RESNET18, RESNET18_B
from model_router_yolo.demo import YOLOV8N

from router.sdk import DemoFile
from router.serving.registry import Discovered, Entry
from router.store import DemoStoreError, demo_files, init_demo
from tests.conftest import REPO


def test_each_demo_file_is_declared_by_the_plugin_that_serves_it() -> None:
    found = demo_files()
    assert found.broken == {}
    assert {name: (e.target, e.distribution) for name, e in found.entries.items()} == {
        "yolov8n": (YOLOV8N, "vision-model-router-yolo"),
        "resnet18": (RESNET18, "vision-model-router-resnet"),
        "resnet18-b": (RESNET18_B, "vision-model-router-resnet"),
    }


def test_init_demo_skips_files_that_exist(demo_store: Path) -> None:
    lines: list[str] = []
    assert init_demo(demo_store, progress=lines.append) == []
    assert [line.split(":")[0] for line in lines] == ["skip resnet18-b.pt", "skip resnet18.pt", "skip yolov8n.pt"]


def test_init_demo_builds_the_same_weights_every_time(demo_store: Path, tmp_path: Path) -> None:
    (tmp_path / "resnet18.pt").write_bytes(b"stale")
    lines: list[str] = []
    built = init_demo(tmp_path, force=True, progress=lines.append)
    assert [p.name for p in built] == ["resnet18-b.pt", "resnet18.pt", "yolov8n.pt"]
    assert any(line.startswith("[3/3] yolov8n.pt: done") for line in lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resnet18-b.pt", "resnet18.pt", "yolov8n.pt"]  # no partial files
    second = torch.load(tmp_path / "resnet18-b.pt", weights_only=True)
    assert any(not torch.equal(second[k], v) for k, v in torch.load(tmp_path / "resnet18.pt", weights_only=True).items())
    again, first = (torch.load(store / "resnet18.pt", weights_only=True) for store in (tmp_path, demo_store))
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    from ultralytics import YOLO

    again, first = (YOLO(str(store / "yolov8n.pt")).model.state_dict() for store in (tmp_path, demo_store))
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)


def test_a_failed_build_leaves_no_file_that_counts_as_built(tmp_path: Path) -> None:
    def half_written(path: Path) -> None:
        path.write_bytes(b"half a checkpoint")
        raise OSError("disk full")

    files: Discovered[DemoFile] = Discovered(entries={"x": Entry("x", DemoFile("x.pt", "a file", half_written))})
    with pytest.raises(OSError, match="disk full"):
        init_demo(tmp_path, files=files, progress=lambda line: None)
    assert list(tmp_path.iterdir()) == []


def test_a_broken_declaration_is_named_before_anything_is_built(tmp_path: Path) -> None:
    files: Discovered[DemoFile] = Discovered(
        entries={"resnet18": Entry("resnet18", RESNET18)},
        broken={"yolov8n": "ModuleNotFoundError: No module named 'ultralytics'"},
    )
    with pytest.raises(DemoStoreError, match="broken demo file entry points: yolov8n: ModuleNotFoundError"):
        init_demo(tmp_path, files=files, progress=lambda line: None)
    assert list(tmp_path.iterdir()) == []


def test_the_command_line_prints_progress_and_what_it_built(demo_store: Path) -> None:
    """As the Makefile runs it: `model-router store init-demo --store DIR`."""
    done = subprocess.run([sys.executable, "-m", "router", "store", "init-demo", "--store", str(demo_store)],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""  # nothing built: both files exist
    assert "skip resnet18.pt: already in" in done.stderr and "skip yolov8n.pt: already in" in done.stderr
    assert "skip resnet18-b.pt: already in" in done.stderr
