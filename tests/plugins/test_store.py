"""The demo model store (router.store): skip, rebuild, determinism, a missing plugin package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from router.store import DemoStoreError, init_demo


def test_init_demo_skips_files_that_exist(demo_store: Path) -> None:
    lines: list[str] = []
    assert init_demo(demo_store, progress=lines.append) == []
    assert [line.split(":")[0] for line in lines] == ["skip yolov8n.pt", "skip resnet18.pt"]


def test_init_demo_builds_the_same_weights_every_time(demo_store: Path, tmp_path: Path) -> None:
    (tmp_path / "resnet18.pt").write_bytes(b"stale")
    lines: list[str] = []
    built = init_demo(tmp_path, force=True, progress=lines.append)
    assert [p.name for p in built] == ["yolov8n.pt", "resnet18.pt"]
    assert any(line.startswith("[2/2] resnet18.pt: done") for line in lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resnet18.pt", "yolov8n.pt"]  # no partial files left
    again, first = (torch.load(store / "resnet18.pt", weights_only=True) for store in (tmp_path, demo_store))
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    from ultralytics import YOLO

    again, first = (YOLO(str(store / "yolov8n.pt")).model.state_dict() for store in (tmp_path, demo_store))
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)


def test_init_demo_names_the_missing_plugin_package_before_building(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ultralytics" else real_find_spec(name, *a)
    )
    needs = r"yolov8n\.pt needs ultralytics: install the yolo plugin: pip install -e plugins/yolo"
    with pytest.raises(DemoStoreError, match=needs):
        init_demo(tmp_path, progress=lambda line: None)
    assert list(tmp_path.iterdir()) == []
