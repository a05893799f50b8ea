"""vision-model-router-engines, what the onnx and tensorrt plugins share: the check inputs, onnxruntime as
the reference an engine is checked against, the TensorRT build from an ONNX file (with TensorRT
itself stood in for, so it runs on a CPU), the per-task processing, and what serving TensorRT imports."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest
import torch
from model_router_engines import (
    OnnxReference,
    ServingOverrides,
    build_processing,
    check_inputs,
    read_sidecar,
    sidecar_path,
    staged_input_bytes,
)

from router.sdk import ExportError

if TYPE_CHECKING:
    from model_router_onnx.export import OnnxExport


def test_check_inputs_are_normalised_as_the_metadata_says(exports: dict[str, OnnxExport]) -> None:
    detect, classify = exports["yolov8n"].metadata, exports["resnet18"].metadata
    pixels = check_inputs(detect, 3)
    assert pixels.shape == (3, 3, 320, 320) and pixels.dtype == torch.float32
    assert 0.0 <= float(pixels.min()) and float(pixels.max()) <= 1.0
    assert torch.equal(check_inputs(detect, 3), pixels), "the same seed gives the same inputs"
    normalised = check_inputs(classify, 2)
    assert normalised.shape == (2, 3, 224, 224) and float(normalised.min()) < 0.0  # (x - mean) / std


def test_onnxruntime_reference_reads_the_metadata_from_the_file(exports: dict[str, OnnxExport]) -> None:
    reference = OnnxReference(exports["resnet18"].path)
    assert reference.metadata == exports["resnet18"].metadata
    expected = reference.expected([1, 8])
    assert sorted(expected) == [1, 8] and expected[8][1].shape == (8, 1000)
    torch.testing.assert_close(expected[1][1], expected[8][1][:1], rtol=0, atol=1e-4)  # batch 1 is batch 8's first


def test_a_file_without_export_metadata_is_no_reference(tmp_path: Path) -> None:
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(ExportError, match="onnxruntime cannot open"):
        OnnxReference(tmp_path / "junk.onnx")


# -- the TensorRT build, with TensorRT stood in for ----------------------------------------------------


class StandInRunner:
    """Runs the ONNX file on onnxruntime where the engine would run, optionally a little off."""

    onnx_path: Path
    scale = 1.0

    def __init__(self, engine_bytes: bytes, device: torch.device, metadata: Any, model: str) -> None:
        assert engine_bytes == b"serialised engine"
        self.reference = OnnxReference(self.onnx_path)

    def run(self, batch: torch.Tensor) -> torch.Tensor:
        return self.reference.run(batch) * self.scale

    def close(self) -> None:
        pass


@pytest.fixture
def stand_in_tensorrt(monkeypatch: pytest.MonkeyPatch, exports: dict[str, OnnxExport]) -> type[StandInRunner]:
    from model_router_tensorrt import build

    monkeypatch.setitem(sys.modules, "tensorrt", SimpleNamespace(__version__="10.99.0"))
    monkeypatch.setattr(build, "_build", lambda *args: b"serialised engine")
    runner = type("Runner", (StandInRunner,), {"onnx_path": exports["resnet18"].path})
    monkeypatch.setattr(build, "EngineRunner", runner)
    return runner


def test_an_engine_is_built_from_the_onnx_file_and_checked_against_onnxruntime(
    stand_in_tensorrt: type[StandInRunner], exports: dict[str, OnnxExport], tmp_path: Path
) -> None:
    from model_router_tensorrt.build import build_engine

    lines: list[str] = []
    engine = build_engine(exports["resnet18"].path, device="cpu", out=tmp_path / "r.engine", progress=lines.append)

    assert engine == tmp_path / "r.engine" and engine.read_bytes() == b"serialised engine"
    metadata = read_sidecar(sidecar_path(engine))
    assert metadata.source["tensorrt"] == "10.99.0" and metadata.source["precision"] == "fp32"
    assert metadata.model_copy(update={"source": exports["resnet18"].metadata.source}) == exports["resnet18"].metadata
    checks = [line.strip() for line in lines if " vs " in line]
    assert checks[0].startswith("tensorrt vs onnxruntime at batch 1: ") and checks[0].endswith(": ok")
    assert checks[1].startswith("tensorrt vs onnxruntime at batch 8: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.engine", "r.engine.json"]


def test_an_engine_that_does_not_match_onnxruntime_writes_nothing(
    stand_in_tensorrt: type[StandInRunner], exports: dict[str, OnnxExport], tmp_path: Path
) -> None:
    from model_router_tensorrt.build import build_engine

    stand_in_tensorrt.scale = 1.5  # every logit off: the top-k may agree, the probabilities do not
    with pytest.raises(ExportError, match="does not match onnxruntime; nothing written"):
        build_engine(exports["resnet18"].path, device="cpu", out=tmp_path / "r.engine", progress=lambda line: None)
    assert list(tmp_path.iterdir()) == []


def test_the_tensorrt_exporter_converts_onnx_and_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from model_router_tensorrt.build import TensorRTExporter, engine_problems

    assert (TensorRTExporter.format, TensorRTExporter.needs, TensorRTExporter.suffix) == ("tensorrt", "onnx", ".engine")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    assert any("checked against onnxruntime, which is not installed" in p for p in engine_problems("cuda:0"))


# -- processing and dependencies ----------------------------------------------------------------------


def test_staged_input_bytes_follow_the_task(exports: dict[str, OnnxExport]) -> None:
    assert staged_input_bytes(exports["yolov8n"].metadata) == 3 * 320 * 320 * 5  # uint8 upload + float
    assert staged_input_bytes(exports["resnet18"].metadata) == 3 * 224 * 224 * 8  # float upload + copy


def test_a_task_whose_processing_is_not_installed_is_a_clear_load_error(
    exports: dict[str, OnnxExport], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "model_router_yolo.processing", None)  # as if vision-model-router-yolo were missing
    with pytest.raises(RuntimeError, match=r"model 'det': a 'detect' export is served with the yolo plugin's "
                                           r"processing, which is not installed \(pip install -e 'plugins/engines\[detect\]'"):
        build_processing(exports["yolov8n"].metadata, ServingOverrides(), "det")


def test_serving_tensorrt_does_not_pull_in_ultralytics(exports: dict[str, OnnxExport]) -> None:
    """Neither the tensorrt distribution's requirements nor importing it, building engines or
    serving a classify engine bring ultralytics, the yolo plugin or the onnx plugin."""
    base = [r for r in requires("vision-model-router-tensorrt") or [] if "extra ==" not in r]
    assert not [r for r in base if r.startswith(("vision-model-router-onnx", "vision-model-router-yolo", "ultralytics"))], base
    code = (
        "import json, sys\n"
        "import model_router_tensorrt, model_router_tensorrt.build\n"
        "from model_router_engines import ServingOverrides, build_processing, parse_metadata\n"
        "from router.sdk import example_jpeg\n"
        "metadata = parse_metadata(sys.stdin.read(), 'stdin')\n"
        "processing = build_processing(metadata, ServingOverrides(), 'classifier')\n"
        "processing.preprocess(example_jpeg())\n"
        "print(json.dumps([m for m in ('ultralytics', 'model_router_yolo', 'model_router_onnx', 'onnx') "
        "if m in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], input=exports["resnet18"].metadata.to_json(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
