"""The tensorrt plugin: options, the profile -> batch logic, start-up problems and the memory
estimate as plain functions (no TensorRT needed); engines really built and served under `gpu`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch
from model_router_engines import sidecar_path
from model_router_tensorrt import BatchLimits, TensorRTOptions, TensorRTPlugin, limits_from_profile, plan_chunks
from model_router_tensorrt.limits import engine_estimate, startup_error, startup_problems
from pydantic import ValidationError

from router.config import FleetConfig
from router.exporting import source_model
from router.sdk.plugin import Payload, PluginContext
from router.serving.plan import FleetPlan, resolve_fleet
from router.serving.registry import PluginRegistry

# -- options -------------------------------------------------------------------------------------------


def test_options_accept_engines_and_plans() -> None:
    assert TensorRTOptions(engine="yolov8n.engine").metadata is None
    assert TensorRTOptions(engine="r.plan", metadata="r.json", top_k=3).top_k == 3


@pytest.mark.parametrize(("options", "message"), [
    ({"engine": "yolov8n.onnx"}, "engine must be a TensorRT .engine or .plan file, got 'yolov8n.onnx'"),
    ({"engine": "a.engine", "metadata": "a.yaml"}, "metadata must be the .json file written beside the engine"),
    ({"engine": "a.engine", "fp16": True}, "Extra inputs are not permitted"),  # precision is fixed at build time
    ({"engine": "a.engine", "iou": 1.5}, "less than or equal to 1"),
    ({"engine": "a.engine", "classes": []}, "List should have at least 1 item"),
    ({}, "Field required"),
])
def test_options_refuse_mistakes(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TensorRTOptions(**options)


def test_paths_resolve_in_the_store_at_construction(tmp_path: Path) -> None:
    plugin = TensorRTPlugin(TensorRTOptions(engine="m/yolo.engine"), PluginContext("det", tmp_path))
    assert plugin.metadata_path == tmp_path.resolve() / "m" / "yolo.engine.json" == sidecar_path(plugin.engine_path)
    with pytest.raises(ValueError, match="resolves outside the model store"):
        TensorRTPlugin(TensorRTOptions(engine="../x.engine"), PluginContext("det", tmp_path))


# -- profile -> batch ------------------------------------------------------------------------------------


def test_limits_come_from_the_profile_batch_axis() -> None:
    limits = limits_from_profile("images", (1, 3, 640, 640), (8, 3, 640, 640), (16, 3, 640, 640), expected=[3, 640, 640])
    assert limits == BatchLimits(min=1, opt=8, max=16)


@pytest.mark.parametrize(("shapes", "message"), [
    (((1, 3, 320, 320), (1, 3, 640, 640), (1, 3, 640, 640)), "varies more than the batch axis"),
    (((1, 3, 224, 224), (4, 3, 224, 224), (8, 3, 224, 224)), r"takes \[3, 224, 224\] per item, the metadata says"),
    (((4, 3, 640, 640), (2, 3, 640, 640), (8, 3, 640, 640)), "1 <= min <= opt <= max, got 4, 2, 8"),
    (((1, 3, 640, 640), (1, 3, 640), (1, 3, 640, 640)), "different or zero rank"),
])
def test_profiles_the_plugin_cannot_serve_are_refused(
    shapes: tuple[Sequence[int], Sequence[int], Sequence[int]], message: str
) -> None:
    low, opt, high = shapes
    with pytest.raises(ValueError, match=message):
        limits_from_profile("images", low, opt, high, expected=[3, 640, 640])


@pytest.mark.parametrize(("count", "limits", "runs"), [
    (1, BatchLimits(1, 8, 8), [(1, 1)]),
    (8, BatchLimits(1, 8, 8), [(8, 8)]),
    (13, BatchLimits(1, 4, 4), [(4, 4), (4, 4), (4, 4), (1, 1)]),
    (3, BatchLimits(4, 4, 8), [(3, 4)]),  # padded up to the profile's min
    (9, BatchLimits(2, 4, 8), [(8, 8), (1, 2)]),
])
def test_batches_are_split_and_padded_to_the_profile(count: int, limits: BatchLimits, runs: list[tuple[int, int]]) -> None:
    assert plan_chunks(count, limits) == runs


def test_every_chunk_plan_covers_the_batch_within_the_profile() -> None:
    for low, high in [(1, 1), (1, 8), (2, 5), (4, 4)]:
        limits = BatchLimits(low, high, high)
        for count in range(1, 40):
            runs = plan_chunks(count, limits)
            assert sum(take for take, _ in runs) == count
            assert all(low <= size <= high and take <= size for take, size in runs)
    with pytest.raises(ValueError, match="at least one item, got 0"):
        plan_chunks(0, BatchLimits(1, 1, 1))


# -- start-up problems and memory ------------------------------------------------------------------------


def test_start_up_problems_are_named() -> None:
    assert startup_problems("cuda:0", tensorrt_version="10.9.0", cuda_available=True) == []
    missing = startup_problems("cuda:0", tensorrt_version=None, cuda_available=False)
    assert missing == ["the `tensorrt` package is not installed (pip install -e 'plugins/tensorrt[tensorrt]')",
                       "device 'cuda:0' is not available: torch.cuda.is_available() is False"]
    assert startup_problems("cpu", tensorrt_version="8.6.1", cuda_available=True) == [
        "TensorRT 8.6.1 is too old; 10.0 or newer is needed",
        "device 'cpu' is not a CUDA device; TensorRT engines run on device: cuda:N"]
    assert startup_error("det", ["a", "b"]) == "model 'det': the tensorrt plugin cannot start: a; b"


def test_memory_estimate_is_engine_plus_device_memory_plus_buffers() -> None:
    estimate = engine_estimate(engine_bytes=9_000_000, device_memory_bytes=40_000_000, buffer_bytes=2_000_000,
                               per_item_bytes=700_000)
    assert (estimate.weights_bytes, estimate.per_item_bytes, estimate.fixed_bytes) == (51_000_000, 700_000, 0)
    assert estimate.source == "estimate"


def test_loading_on_the_cpu_is_a_clear_error_naming_the_model(tmp_path: Path) -> None:
    plugin = TensorRTPlugin(TensorRTOptions(engine="yolo.engine"), PluginContext("detector-trt", tmp_path))
    with pytest.raises(RuntimeError, match="model 'detector-trt': the tensorrt plugin cannot start: .*"
                                           "device 'cpu' is not a CUDA device"):
        plugin.load("cpu")


def test_missing_tensorrt_package_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import model_router_tensorrt.plugin as plugin_module

    monkeypatch.setattr(plugin_module, "tensorrt_version", lambda: None)
    plugin = TensorRTPlugin(TensorRTOptions(engine="yolo.engine"), PluginContext("detector-trt", tmp_path))
    with pytest.raises(RuntimeError, match=r"model 'detector-trt': .*`tensorrt` package is not installed"):
        plugin.load("cuda:0")


def test_the_package_imports_and_registers_without_tensorrt() -> None:
    code = ("import sys, model_router_tensorrt; from router.serving.registry import PluginRegistry; "
            "assert PluginRegistry.from_entry_points().get('tensorrt').cls is model_router_tensorrt.TensorRTPlugin; "
            "print('tensorrt' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", "importing the plugin must not import tensorrt"
    (point,) = [p for p in entry_points(group="model_router.plugins") if p.name == "tensorrt"]
    assert point.dist is not None and point.dist.name == "vision-model-router-tensorrt"


# -- on a GPU with TensorRT ------------------------------------------------------------------------------

IMGSZ = 320


def gpu_plan(store: Path, max_batch: int) -> FleetPlan:
    fleet = FleetConfig.model_validate({
        "model_store": str(store),
        "models": {
            "yolov8n": {"plugin": "yolo", "options": {"model": "yolov8n.pt", "imgsz": IMGSZ, "conf": 0.1},
                        "batch": {"max_size": max_batch}},
            "resnet18": {"plugin": "resnet", "options": {"weights": "resnet18.pt"}, "batch": {"max_size": max_batch}},
        },
    })
    return resolve_fleet(fleet, PluginRegistry.from_entry_points(), "gpu-fleet")


@pytest.fixture(scope="module")
def engines(demo_store: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both demo models exported with batch policy max 4 and built from their ONNX files into fp32 engines."""
    pytest.importorskip("tensorrt", reason="needs the tensorrt package (pip install -e 'plugins/tensorrt[tensorrt]')")
    from model_router_onnx.export import export_onnx
    from model_router_tensorrt.build import build_engine

    out = tmp_path_factory.mktemp("engines")
    plan = gpu_plan(demo_store, max_batch=4)
    built = {}
    for name in ("yolov8n", "resnet18"):
        export = export_onnx(source_model(plan, name), out=out / f"{name}.onnx", progress=lambda line: None)
        built[name] = build_engine(export.path, optimization_level=1, progress=lambda line: None)
    return built


def serve_engine(path: Path, **options: Any) -> TensorRTPlugin:
    plugin = TensorRTPlugin(TensorRTOptions(engine=path.name, **options), PluginContext("trt", path.parent))
    plugin.load("cuda:0")
    return plugin


def run(plugin: Any, payloads: Sequence[Payload]) -> list[dict[str, Any]]:
    items = [plugin.preprocess(p) for p in payloads]
    return [plugin.postprocess(o, i) for o, i in zip(plugin.predict_batch(items), items, strict=True)]


@pytest.mark.gpu
def test_engine_profile_and_metadata_come_from_the_batch_policy(engines: dict[str, Path]) -> None:
    plugin = serve_engine(engines["resnet18"])
    assert plugin.batch_limits == BatchLimits(1, 4, 4)
    metadata = json.loads(sidecar_path(engines["resnet18"]).read_text())
    assert metadata["task"] == "classify" and metadata["source"]["precision"] == "fp32"


@pytest.mark.gpu
def test_engines_match_eager_pytorch_at_batch_1_and_8(
    engines: dict[str, Path], demo_store: Path, payloads: list[Payload]
) -> None:
    from model_router_resnet import ResNetOptions, ResNetPlugin
    from model_router_yolo import YoloOptions, YoloPlugin

    from tests.plugins.test_yolo import assert_same_detections

    eager_yolo = YoloPlugin(YoloOptions(model="yolov8n.pt", imgsz=IMGSZ, conf=0.1), PluginContext("e", demo_store))
    eager_resnet = ResNetPlugin(ResNetOptions(weights="resnet18.pt"), PluginContext("e", demo_store))
    eager_yolo.load("cuda:0")
    eager_resnet.load("cuda:0")
    detector, classifier = serve_engine(engines["yolov8n"]), serve_engine(engines["resnet18"])
    for size in (1, 8):  # 8 runs as two chunks of the profile's max 4
        for got, want in zip(run(detector, payloads[:size]), run(eager_yolo, payloads[:size]), strict=True):
            assert_same_detections(got["detections"], want["detections"], conf=0.1)
        for got, want in zip(run(classifier, payloads[:size]), run(eager_resnet, payloads[:size]), strict=True):
            assert [e["class_id"] for e in got["top_k"]] == [e["class_id"] for e in want["top_k"]]


@pytest.mark.gpu
def test_memory_estimate_covers_what_loading_the_engine_takes(engines: dict[str, Path]) -> None:
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info(0)
    plugin = serve_engine(engines["yolov8n"])
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info(0)
    estimate = plugin.memory_estimate()
    assert estimate.weights_bytes >= engines["yolov8n"].stat().st_size
    taken = free_before - free_after
    assert taken <= estimate.weights_bytes + 256 * 2**20, f"load took {taken} B, estimate {estimate.weights_bytes} B"
    plugin.unload()
