"""The `onnx` exporter: a fleet model (yolo or resnet) to ONNX, checked against eager PyTorch.
`model-router export` finds it under the entry-point group `model_router.exporters` and hands it
plain values (`router.sdk.ExportJob`); it never reads the fleet file.

The source model is loaded by its own plugin, so the export sees exactly the network, input size,
labels and thresholds that the fleet serves. The ONNX file is written next to its final name and
renamed only once onnxruntime's outputs match eager PyTorch's at batch 1 and a full batch.
"""

from __future__ import annotations

import copy
import importlib.util
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from model_router_engines.checks import OnnxReference, check_inputs, check_outputs, check_sizes
from model_router_engines.metadata import (
    METADATA_KEY,
    BatchProfile,
    ClassifyDefaults,
    DetectDefaults,
    ExportMetadata,
    Letterbox,
    Normalisation,
    ResizeCrop,
    TensorSpec,
)
from model_router_engines.parity import FP32, ParityReport

from router.sdk import Exporter, ExportError, ExportJob, ModelPlugin, Progress, SourceModel, partial_file

__all__ = ["OPSET", "OnnxExport", "OnnxExporter", "export_onnx", "profile_for"]

OPSET = 18


@dataclass(frozen=True)
class OnnxExport:
    """A written, checked ONNX file."""

    model: str
    path: Path
    metadata: ExportMetadata
    checks: list[ParityReport]


class OnnxExporter(Exporter):
    """A yolo or resnet fleet model to `<model>.onnx`, with the metadata the engine plugins serve it by."""

    format: ClassVar[str] = "onnx"
    title: ClassVar[str] = "ONNX model"
    suffix: ClassVar[str] = ".onnx"

    def problems(self, device: str) -> list[str]:
        missing = [name for name in ("onnxruntime", "onnxscript") if importlib.util.find_spec(name) is None]
        return [f"{', '.join(missing)} not installed (pip install -e plugins/onnx)"] if missing else []

    def export(self, job: ExportJob) -> Path:
        if job.source is None:
            raise ExportError(f"the onnx exporter exports a fleet model; {job.model!r} came as a file ({job.input})")
        if job.fp16:
            job.progress("note: --fp16 applies to engine builds only; the ONNX file is fp32")
        return export_onnx(job.source, out=job.out, progress=job.progress).path


@dataclass(frozen=True)
class _Source:
    """What the export needs from the source plugin: the torch module and the metadata to store."""

    module: torch.nn.Module
    metadata: dict[str, Any]  # ExportMetadata fields except input/output shapes, batch and source
    input_name: str
    output_name: str


def profile_for(max_batch: int) -> BatchProfile:
    """The engine's batch range from the model's largest batch: 1 to max_batch, tuned for full
    batches (under load the dynamic batcher fills them)."""
    return BatchProfile(min=1, opt=max_batch, max=max_batch)


def export_onnx(source: SourceModel, *, out: Path, progress: Progress = print) -> OnnxExport:
    """Load the fleet model on the CPU, export it with a dynamic batch axis, check it, write it."""
    model, started = source.name, time.perf_counter()
    _check_plugin(source)
    progress(f"[1/4] {model}: loading the {source.plugin} model on the CPU")
    network = _source(source)
    draft = _metadata(source, network, profile_for(source.max_batch))
    sizes = check_sizes(draft.batch)
    inputs = check_inputs(draft, max(sizes))
    with torch.inference_mode():
        expected = {size: (inputs[:size], _single_output(network.module(inputs[:size])).clone()) for size in sizes}
    output = TensorSpec(name=network.output_name, shape=list(expected[sizes[-1]][1].shape[1:]))
    metadata = draft.model_copy(update={"output": output})
    progress(f"[2/4] {model}: exporting with torch.onnx (dynamo, opset {OPSET}), dynamic batch axis")
    with partial_file(out) as partial:
        _write_onnx(network, inputs, metadata, partial)
        progress(f"[3/4] {model}: checking onnxruntime against PyTorch at batch {' and '.join(map(str, sizes))}")
        checks = check_outputs(metadata, OnnxReference(partial).run, expected, FP32, engine="onnxruntime",
                               against="PyTorch")
        for report in checks:
            progress(f"      {report.line()}")
        if not all(report.ok for report in checks):
            raise ExportError(f"{model}: the ONNX export does not match PyTorch; nothing written")
    size_mb = out.stat().st_size / 1e6
    progress(f"[4/4] {model}: wrote {out} ({size_mb:.1f} MB) in {time.perf_counter() - started:.1f} s")
    return OnnxExport(model, out, metadata, checks)


def _check_plugin(source: SourceModel) -> None:
    from model_router_resnet import ResNetPlugin
    from model_router_yolo import YoloPlugin

    if not issubclass(source.plugin_class, (YoloPlugin, ResNetPlugin)):
        raise ExportError(f"model {source.name!r} uses plugin {source.plugin!r}; export supports 'yolo' and 'resnet' models")


def _source(source: SourceModel) -> _Source:
    """Instantiate and load the model's own plugin on the CPU (fp32), then take its network."""
    from model_router_yolo import YoloPlugin

    try:
        plugin: ModelPlugin[Any] = source.create(half=False)  # the export is fp32; fp16 is an engine build flag
        plugin.load("cpu")
    except (OSError, ValueError, RuntimeError) as exc:
        raise ExportError(f"model {source.name!r} cannot be loaded for export: {exc}") from exc
    return _yolo_source(plugin) if isinstance(plugin, YoloPlugin) else _resnet_source(plugin)


def _yolo_source(plugin: Any) -> _Source:
    module = copy.deepcopy(plugin.module).eval()
    head = module.model[-1]
    head.export, head.format = True, "onnx"  # the head returns the decoded (n, 4 + classes, anchors) tensor alone
    processing, settings = plugin.processing, plugin.processing.settings
    detect = DetectDefaults(
        conf=settings.conf,
        iou=settings.iou,
        max_det=settings.max_det,
        classes=list(settings.classes) if settings.classes is not None else None,
        end2end=settings.end2end,
    )
    metadata = {
        "task": "detect",
        "resize": Letterbox(imgsz=processing.imgsz, stride=processing.stride),
        "normalisation": Normalisation(),
        "labels": list(processing.names),
        "detect": detect,
    }
    return _Source(module, metadata, "images", "output0")


def _resnet_source(plugin: Any) -> _Source:
    processing = plugin.processing
    metadata = {
        "task": "classify",
        "resize": ResizeCrop(resize=processing.resize, crop=processing.crop),
        "normalisation": Normalisation(scale=1 / 255, mean=processing.mean, std=processing.std),
        "labels": list(processing.labels),
        "classify": ClassifyDefaults(top_k=processing.top_k),
    }
    return _Source(plugin.module.eval(), metadata, "images", "logits")


def _single_output(output: Any) -> torch.Tensor:
    if isinstance(output, (list, tuple)):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise ExportError(f"the network returned {type(output).__name__}, expected a tensor")
    return output


def _metadata(source: SourceModel, network: _Source, profile: BatchProfile) -> ExportMetadata:
    """Everything but the output's shape, which the first forward pass tells."""
    resize = network.metadata["resize"]
    side = resize.imgsz if isinstance(resize, Letterbox) else resize.crop
    file = getattr(source.options, "model", None) or getattr(source.options, "weights", "")
    return ExportMetadata.model_validate({
        **network.metadata,
        "source": {
            "plugin": source.plugin,
            "model": source.name,
            "file": str(file),
            "exporter": f"torch.onnx dynamo, opset {OPSET}",
            "torch": torch.__version__,
        },
        "input": TensorSpec(name=network.input_name, shape=[3, side, side]),
        "output": TensorSpec(name=network.output_name, shape=[]),
        "batch": profile,
    })


def _write_onnx(network: _Source, example: torch.Tensor, metadata: ExportMetadata, path: Path) -> None:
    """torch.onnx's dynamo exporter with a symbolic batch axis; the metadata goes in metadata_props."""
    batch = torch.export.Dim("batch", min=1, max=max(metadata.batch.max, 1024))
    sample = example[:2] if example.shape[0] >= 2 else example.repeat(2, 1, 1, 1)  # 2: batch 1 would specialise
    try:
        with warnings.catch_warnings():
            # YOLO's head caches anchors computed from the input size; the size is fixed, so they are constants.
            warnings.filterwarnings("ignore", message="The tensor attributes .* were assigned during export")
            program = torch.onnx.export(
                network.module,
                (sample,),
                dynamo=True,
                input_names=[network.input_name],
                output_names=[network.output_name],
                dynamic_shapes=({0: batch},),
                opset_version=OPSET,
                verbose=False,
            )
    except Exception as exc:
        raise ExportError(f"torch.onnx could not export the network: {type(exc).__name__}: {exc}") from exc
    assert program is not None  # dynamo=True always returns the program
    program.model.metadata_props[METADATA_KEY] = metadata.to_json()
    program.save(str(path), external_data=False)
