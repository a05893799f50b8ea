"""The onnx plugin and `model-router export`: both demo models exported, checked and served on
onnxruntime, against the eager plugins at batch 1 and 8; metadata, providers and failure modes."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
from model_router_engines import METADATA_KEY, BatchProfile, MetadataError, Tolerance
from model_router_onnx import OnnxOptions, OnnxPlugin, ProviderError, choose_providers
from model_router_onnx.export import OnnxExport, OnnxExporter, export_onnx, profile_for
from model_router_resnet import ResNetOptions, ResNetPlugin
from model_router_yolo import YoloOptions, YoloPlugin
from pydantic import ValidationError

from router.exporting import export_steps, installed_exporters, run_export, source_model
from router.sdk import ExportError
from router.sdk.plugin import Payload, PluginContext
from router.serving.registry import PluginRegistry
from tests.plugins.conftest import YOLO_EXPORT_OPTIONS, fleet_plan
from tests.plugins.test_yolo import assert_same_detections

IMGSZ = YOLO_EXPORT_OPTIONS["imgsz"]
CONF = YOLO_EXPORT_OPTIONS["conf"]
MAX_DET = YOLO_EXPORT_OPTIONS["max_det"]
SCORE_TOLERANCE = 1e-4
YOLO_OPTIONS = YOLO_EXPORT_OPTIONS


def onnx_plugin(store: Path, model: str, **options: Any) -> OnnxPlugin:
    plugin = OnnxPlugin(OnnxOptions(model=model, **options), PluginContext("engine", store))
    plugin.load("cpu")
    return plugin


@pytest.fixture(scope="module")
def detector(exports: dict[str, OnnxExport], onnx_store: Path) -> OnnxPlugin:
    return onnx_plugin(onnx_store, "yolov8n.onnx")


@pytest.fixture(scope="module")
def classifier(exports: dict[str, OnnxExport], onnx_store: Path) -> OnnxPlugin:
    return onnx_plugin(onnx_store, "resnet18.onnx")


@pytest.fixture(scope="module")
def eager_detector(demo_store: Path) -> YoloPlugin:
    plugin = YoloPlugin(YoloOptions(**YOLO_OPTIONS), PluginContext("eager", demo_store))
    plugin.load("cpu")
    return plugin


@pytest.fixture(scope="module")
def eager_classifier(demo_store: Path) -> ResNetPlugin:
    plugin = ResNetPlugin(ResNetOptions(weights="resnet18.pt"), PluginContext("eager", demo_store))
    plugin.load("cpu")
    return plugin


def run(plugin: Any, payloads: Sequence[Payload]) -> list[dict[str, Any]]:
    """preprocess -> one predict_batch -> postprocess, as the router does."""
    items = [plugin.preprocess(p) for p in payloads]
    outputs = plugin.predict_batch(items)
    assert len(outputs) == len(items)
    return [plugin.postprocess(output, item) for output, item in zip(outputs, items, strict=True)]


# -- export ----------------------------------------------------------------------------------------


def test_export_is_checked_against_pytorch_at_batch_1_and_8(exports: dict[str, OnnxExport]) -> None:
    for export in exports.values():
        assert [report.batch for report in export.checks] == [1, 8]
        assert all(report.ok for report in export.checks), [report.line() for report in export.checks]
    detect = exports["yolov8n"].checks
    assert all(report.max_box_px is not None and report.max_box_px < 1.0 for report in detect)
    assert all(report.top_k_equal for report in exports["resnet18"].checks)


def test_export_has_a_dynamic_batch_axis_and_the_serving_metadata(exports: dict[str, OnnxExport]) -> None:
    detect = onnx.load(str(exports["yolov8n"].path))
    (graph_input,) = detect.graph.input
    dims = graph_input.type.tensor_type.shape.dim
    assert dims[0].dim_param and not dims[0].HasField("dim_value"), "the batch axis must be symbolic"
    assert [d.dim_value for d in dims[1:]] == [3, IMGSZ, IMGSZ]
    assert METADATA_KEY in {prop.key for prop in detect.metadata_props}
    meta = exports["yolov8n"].metadata
    assert meta.task == "detect" and meta.resize.kind == "letterbox" and meta.resize.imgsz == IMGSZ
    assert meta.labels[0] == "person" and len(meta.labels) == 80 and meta.output.shape[0] == 84
    assert meta.detect is not None and (meta.detect.conf, meta.detect.max_det) == (CONF, MAX_DET)
    assert meta.batch == BatchProfile(min=1, opt=8, max=8)
    classify = exports["resnet18"].metadata
    assert classify.task == "classify" and classify.resize.kind == "resize_crop"
    assert (classify.resize.resize, classify.resize.crop) == (256, 224)
    assert classify.normalisation.mean == (0.485, 0.456, 0.406) and classify.normalisation.std == (0.229, 0.224, 0.225)
    assert len(classify.labels) == 1000 and classify.classify is not None and classify.classify.top_k == 5


def test_profile_comes_from_the_largest_batch() -> None:
    assert profile_for(16) == BatchProfile(min=1, opt=16, max=16)
    assert profile_for(1) == BatchProfile(min=1, opt=1, max=1)


def test_export_that_does_not_match_pytorch_writes_nothing(
    demo_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import model_router_onnx.export as export_module

    monkeypatch.setattr(export_module, "FP32", Tolerance(box_px=-1.0, score=-1.0))  # nothing can pass
    source = source_model(fleet_plan(demo_store), "resnet18")
    with pytest.raises(ExportError, match="does not match PyTorch; nothing written"):
        export_onnx(source, out=tmp_path / "r.onnx", progress=lambda line: None)
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_other_plugins_before_loading_them(demo_store: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    with pytest.raises(ExportError, match="uses plugin 'toy'; export supports 'yolo' and 'resnet'"):
        export_onnx(source_model(fleet_plan(demo_store), "toy"), out=tmp_path / "t.onnx", progress=lines.append)
    assert lines == [] and list(tmp_path.iterdir()) == []


def test_the_exporter_is_found_through_its_entry_point() -> None:
    found = installed_exporters()
    assert isinstance(found.entries["onnx"].target, OnnxExporter)
    assert found.entries["onnx"].distribution == "vision-model-router-onnx"
    assert OnnxExporter.needs is None and OnnxExporter().problems("cpu") == []


def test_engine_format_where_tensorrt_cannot_run_fails_before_exporting(demo_store: Path, tmp_path: Path) -> None:
    from model_router_tensorrt.build import engine_problems

    if not engine_problems():
        pytest.skip("TensorRT and a GPU are present here: the engine would be built")
    steps = export_steps(installed_exporters(), "tensorrt")
    assert [step.exporter.format for step in steps] == ["onnx", "tensorrt"]
    lines: list[str] = []
    source = source_model(fleet_plan(demo_store), "resnet18")
    with pytest.raises(ExportError, match="cannot build the TensorRT engine for 'resnet18': .*tensorrt"):
        run_export(steps, model="resnet18", source=source, out=tmp_path / "r.onnx", progress=lines.append)
    assert lines == [] and list(tmp_path.iterdir()) == []


def test_cli_export_without_an_onnx_exporter_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import router.exporting
    from router.cli import main
    from router.serving.registry import Discovered

    monkeypatch.setattr(router.exporting, "installed_exporters", lambda: Discovered())  # as if none were installed
    assert main(["export", "--config", "unused.yaml", "--model", "m", "--format", "onnx"]) == 1
    err = capsys.readouterr().err
    assert "no exporter for format 'onnx' is installed (installed: none)" in err and "pip install -e plugins/onnx" in err


# -- serving -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 8])
def test_detections_match_eager_pytorch(
    detector: OnnxPlugin, eager_detector: YoloPlugin, payloads: list[Payload], batch_size: int
) -> None:
    batch = payloads[:batch_size]
    served, eager = run(detector, batch), run(eager_detector, batch)
    for got, expected in zip(served, eager, strict=True):
        assert got["image"] == expected["image"]
        assert_same_detections(got["detections"], expected["detections"], conf=CONF)
    assert sum(len(answer["detections"]) for answer in eager) > 0, "the comparison needs detections"


@pytest.mark.parametrize("batch_size", [1, 8])
def test_classification_top_k_matches_eager_pytorch(
    classifier: OnnxPlugin, eager_classifier: ResNetPlugin, payloads: list[Payload], batch_size: int
) -> None:
    batch = payloads[:batch_size]
    for got, expected in zip(run(classifier, batch), run(eager_classifier, batch), strict=True):
        assert [e["class_id"] for e in got["top_k"]] == [e["class_id"] for e in expected["top_k"]]
        assert [e["label"] for e in got["top_k"]] == [e["label"] for e in expected["top_k"]]
        scores = torch.tensor([e["score"] for e in got["top_k"]])
        torch.testing.assert_close(scores, torch.tensor([e["score"] for e in expected["top_k"]]),
                                   rtol=0, atol=SCORE_TOLERANCE)


def test_one_plugin_takes_its_task_from_the_metadata(
    detector: OnnxPlugin, classifier: OnnxPlugin, payloads: list[Payload]
) -> None:
    assert (detector.metadata.task, classifier.metadata.task) == ("detect", "classify")
    assert set(run(detector, payloads[:1])[0]) == {"detections", "image"}
    assert set(run(classifier, payloads[:1])[0]) == {"top_k"}
    assert detector.providers == classifier.providers == ["CPUExecutionProvider"]


def test_serving_options_override_the_export_defaults(
    exports: dict[str, OnnxExport], onnx_store: Path, payloads: list[Payload]
) -> None:
    (answer,) = run(onnx_plugin(onnx_store, "resnet18.onnx", top_k=2), payloads[:1])
    assert len(answer["top_k"]) == 2
    strict = onnx_plugin(onnx_store, "yolov8n.onnx", conf=0.9, classes=[0])
    assert all(d["score"] >= 0.9 and d["class_id"] == 0 for a in run(strict, payloads) for d in a["detections"])
    with pytest.raises(ValueError, match=r"model 'engine': option\(s\) conf do not apply to a 'classify' export"):
        onnx_plugin(onnx_store, "resnet18.onnx", conf=0.5)
    with pytest.raises(ValueError, match="top_k 1001 is more than the export's 1000 classes"):
        onnx_plugin(onnx_store, "resnet18.onnx", top_k=1001)


def test_memory_estimate_counts_initializers_and_activations(classifier: OnnxPlugin) -> None:
    estimate = classifier.memory_estimate()
    assert 46e6 < estimate.weights_bytes < 48e6  # resnet18's 11.7 M fp32 parameters
    assert estimate.per_item_bytes > 3 * 224 * 224 * 8


def test_model_without_export_metadata_is_refused(
    exports: dict[str, OnnxExport], onnx_store: Path, tmp_path: Path
) -> None:
    bare = onnx.load(str(exports["resnet18"].path))
    del bare.metadata_props[:]
    onnx.save(bare, str(tmp_path / "bare.onnx"))
    with pytest.raises(MetadataError, match="has no 'model_router' metadata; export it with `model-router export`"):
        onnx_plugin(tmp_path, "bare.onnx")
    with pytest.raises(FileNotFoundError, match="model 'engine': ONNX file .* not found"):
        onnx_plugin(tmp_path, "missing.onnx")


def test_cuda_device_without_onnxruntime_gpu_is_a_clear_load_error(
    exports: dict[str, OnnxExport], tmp_path: Path
) -> None:
    import onnxruntime

    if CUDA in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here: the CUDA provider exists")
    shutil.copy(exports["resnet18"].path, tmp_path / "ok.onnx")
    with pytest.raises(ProviderError, match="install onnxruntime-gpu"):
        OnnxPlugin(OnnxOptions(model="ok.onnx"), PluginContext("engine", tmp_path)).load("cuda:0")


def test_options_are_validated() -> None:
    with pytest.raises(ValidationError, match="model must be an .onnx file"):
        OnnxOptions(model="resnet18.pt")
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        OnnxOptions(model="a.onnx", imgsz=640)  # type: ignore[call-arg]  # the input size comes from the export
    with pytest.raises(ValidationError, match="List should have at least 1 item"):
        OnnxOptions(model="a.onnx", classes=[])
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        OnnxOptions(model="a.onnx", classes=[-1])


def test_entry_point_names_the_plugin() -> None:
    (point,) = [p for p in entry_points(group="model_router.plugins") if p.name == "onnx"]
    assert point.load() is OnnxPlugin and point.dist is not None and point.dist.name == "vision-model-router-onnx"
    assert PluginRegistry.from_entry_points().get("onnx").cls is OnnxPlugin


# -- execution providers: a pure function ------------------------------------------------------------

CPU, CUDA, TRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"
PROFILE = ("images", [3, 224, 224], BatchProfile(min=1, opt=4, max=8))


def test_cpu_device_gets_the_cpu_provider_whatever_is_installed() -> None:
    assert choose_providers("cpu", [TRT, CUDA, CPU], tensorrt_libs=True) == [(CPU, {})]


def test_cuda_device_gets_cuda_then_cpu() -> None:
    assert choose_providers("cuda:1", [CUDA, CPU]) == [(CUDA, {"device_id": 1}), (CPU, {})]


def test_tensorrt_ep_goes_first_only_when_its_libraries_are_present_and_wanted() -> None:
    chosen = choose_providers("cuda:0", [TRT, CUDA, CPU], tensorrt_libs=True, fp16=True, profile=PROFILE,
                              cache_dir="/cache")
    assert [name for name, _ in chosen] == [TRT, CUDA, CPU]
    options = chosen[0][1]
    assert options["device_id"] == 0 and options["trt_fp16_enable"] is True
    assert options["trt_engine_cache_path"] == "/cache" and options["trt_engine_cache_enable"] is True
    assert (options["trt_profile_min_shapes"], options["trt_profile_opt_shapes"], options["trt_profile_max_shapes"]) == (
        "images:1x3x224x224", "images:4x3x224x224", "images:8x3x224x224")
    no_libs = choose_providers("cuda:0", [TRT, CUDA, CPU], tensorrt_libs=False)
    not_wanted = choose_providers("cuda:0", [TRT, CUDA, CPU], tensorrt_libs=True, use_tensorrt=False)
    assert [n for n, _ in no_libs] == [n for n, _ in not_wanted] == [CUDA, CPU]


def test_cuda_device_without_the_cuda_provider_is_refused() -> None:
    with pytest.raises(ProviderError, match="'cuda:0' needs onnxruntime's CUDAExecutionProvider.*offers only "
                                            "CPUExecutionProvider; install onnxruntime-gpu"):
        choose_providers("cuda:0", [CPU])
    with pytest.raises(ValueError, match="device 'gpu0' is not valid"):
        choose_providers("gpu0", [CPU])


def has_cuda_provider() -> bool:
    import onnxruntime

    return CUDA in onnxruntime.get_available_providers()


# A mark rather than a skip in the body: the session's ONNX exports are not built only to be skipped.
@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda_provider(), reason="needs onnxruntime-gpu: the installed onnxruntime has no "
                                                    "CUDAExecutionProvider")
def test_cuda_provider_with_io_binding_matches_eager(
    exports: dict[str, OnnxExport], onnx_store: Path, eager_classifier: ResNetPlugin, payloads: list[Payload]
) -> None:
    plugin = OnnxPlugin(OnnxOptions(model="resnet18.onnx", tensorrt_ep=False), PluginContext("engine", onnx_store))
    plugin.load("cuda:0")
    assert plugin.providers[0] == CUDA
    for got, expected in zip(run(plugin, payloads), run(eager_classifier, payloads), strict=True):
        assert [e["class_id"] for e in got["top_k"]] == [e["class_id"] for e in expected["top_k"]]
