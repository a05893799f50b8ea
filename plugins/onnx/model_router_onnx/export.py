"""`model-router export`: a fleet model (yolo or resnet) to ONNX, checked against PyTorch, and on
to a TensorRT engine where TensorRT and a GPU are present.

The source model is loaded by its own plugin, so the export sees exactly the network, input size,
labels and thresholds that the fleet serves. The ONNX file is written next to its final name and
renamed only once onnxruntime's outputs match eager PyTorch's at batch 1 and a full batch.
"""

from __future__ import annotations

import copy
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from model_router_onnx.metadata import (
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
from model_router_onnx.parity import FP32, ParityReport, check_payloads, compare
from router.config import BatchPolicy
from router.sdk import ModelPlugin, PluginContext
from router.serving.plan import FleetPlan

__all__ = ["ExportError", "OnnxExport", "Progress", "export_model", "export_onnx", "profile_from_policy"]

Progress = Callable[[str], None]
Format = Literal["auto", "onnx", "tensorrt"]
OPSET = 18
CHECK_BATCH = 8  # the full batch the check runs, when the batch policy allows one that large


class ExportError(RuntimeError):
    """The export cannot be made or does not match its source; the message says why."""


@dataclass(frozen=True)
class OnnxExport:
    """A written, checked ONNX file, and the eager inputs/outputs it was checked on (for the engine check)."""

    model: str
    path: Path
    metadata: ExportMetadata
    checks: list[ParityReport]
    reference: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)  # batch -> (input, PyTorch output)


@dataclass(frozen=True)
class _Source:
    """What the export needs from the source plugin: the torch module and the metadata to store."""

    module: torch.nn.Module
    metadata: dict[str, Any]  # ExportMetadata fields except input/output shapes, batch and source
    input_name: str
    output_name: str
    processing: Any


def profile_from_policy(policy: BatchPolicy) -> BatchProfile:
    """The engine's batch range from the model's batch policy: 1 to max_size, tuned for full batches
    (under load the dynamic batcher fills them)."""
    return BatchProfile(min=1, opt=policy.max_size, max=policy.max_size)


def export_model(
    plan: FleetPlan,
    model: str,
    *,
    fmt: Format = "auto",
    fp16: bool = False,
    out: Path | None = None,
    progress: Progress = print,
) -> list[Path]:
    """ONNX always; a TensorRT engine too for `tensorrt`, or for `auto` where TensorRT and a GPU are present."""
    problems = [] if fmt == "onnx" else _engine_problems()
    if fmt == "tensorrt" and problems:  # before the export, so a doomed run costs nothing
        raise ExportError(f"cannot build a TensorRT engine for {model!r}: {'; '.join(problems)}")
    result = export_onnx(plan, model, out=out, progress=progress)
    if fmt == "onnx":
        if fp16:
            progress("note: --fp16 applies to TensorRT engines only; the ONNX file is fp32")
        return [result.path]
    if problems:
        progress(f"skipped the TensorRT engine: {'; '.join(problems)}")
        return [result.path]
    from model_router_tensorrt.build import build_engine

    return [result.path, build_engine(result, fp16=fp16, progress=progress)]


def _engine_problems() -> list[str]:
    """Why no TensorRT engine can be built here: the tensorrt plugin, TensorRT or a GPU missing."""
    try:
        from model_router_tensorrt.build import engine_problems
    except ImportError as exc:
        return [f"the tensorrt plugin is not installed (pip install -e 'plugins/tensorrt[tensorrt]'): {exc}"]
    return engine_problems("cuda:0")


def export_onnx(plan: FleetPlan, model: str, *, out: Path | None = None, progress: Progress = print) -> OnnxExport:
    """Load the fleet model on the CPU, export it with a dynamic batch axis, check it, write it."""
    if model not in plan.models:
        raise ExportError(f"{plan.source}: no model {model!r}; the fleet has: {', '.join(sorted(plan.models))}")
    config = plan.fleet.models[model]
    profile = profile_from_policy(config.batch)
    target = out if out is not None else plan.fleet.model_store / f"{model}.onnx"
    started = time.perf_counter()
    progress(f"[1/4] {model}: loading the {plan.models[model].plugin.name} model on the CPU")
    source = _source(plan, model)
    sizes = sorted({1, min(profile.max, CHECK_BATCH)})
    reference = _reference(source, sizes)
    metadata = _metadata(plan, model, source, reference[sizes[-1]][1], profile)
    progress(f"[2/4] {model}: exporting with torch.onnx (dynamo, opset {OPSET}), dynamic batch axis")
    partial = target.with_name(f".{target.stem}.partial{target.suffix}")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        _write_onnx(source, reference[sizes[-1]][0], metadata, partial)
        progress(f"[3/4] {model}: checking onnxruntime against PyTorch at batch {' and '.join(map(str, sizes))}")
        checks = _check_onnx(partial, metadata, reference)
        for report in checks:
            progress(f"      {report.line()}")
        if not all(report.ok for report in checks):
            raise ExportError(f"{model}: the ONNX export does not match PyTorch; nothing written")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    size_mb = target.stat().st_size / 1e6
    progress(f"[4/4] {model}: wrote {target} ({size_mb:.1f} MB) in {time.perf_counter() - started:.1f} s")
    return OnnxExport(model, target, metadata, checks, reference)


def _source(plan: FleetPlan, model: str) -> _Source:
    """Instantiate and load the model's own plugin on the CPU (fp32), then take its network."""
    from model_router_resnet import ResNetPlugin
    from model_router_yolo import YoloPlugin

    info, options = plan.models[model].plugin, plan.models[model].options
    if not issubclass(info.cls, (YoloPlugin, ResNetPlugin)):
        raise ExportError(f"model {model!r} uses plugin {info.name!r}; export supports 'yolo' and 'resnet' models")
    if "half" in type(options).model_fields:
        options = options.model_copy(update={"half": False})  # the export is fp32; fp16 is a TensorRT build flag
    context = PluginContext(model, plan.fleet.model_store, plan.fleet.allow_absolute_paths)
    factory: Any = info.cls  # a YoloPlugin or ResNetPlugin class, checked above
    try:
        plugin: ModelPlugin[Any] = factory(options, context)
        plugin.load("cpu")
    except (OSError, ValueError, RuntimeError) as exc:
        raise ExportError(f"model {model!r} cannot be loaded for export: {exc}") from exc
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
    return _Source(module, metadata, "images", "output0", processing)


def _resnet_source(plugin: Any) -> _Source:
    processing = plugin.processing
    metadata = {
        "task": "classify",
        "resize": ResizeCrop(resize=processing.resize, crop=processing.crop),
        "normalisation": Normalisation(scale=1 / 255, mean=processing.mean, std=processing.std),
        "labels": list(processing.labels),
        "classify": ClassifyDefaults(top_k=processing.top_k),
    }
    return _Source(plugin.module.eval(), metadata, "images", "logits", processing)


def _reference(source: _Source, sizes: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Real (generated) images through the serving preprocessing, and eager PyTorch's raw outputs."""
    payloads = check_payloads(max(sizes))
    items = [source.processing.preprocess(payload) for payload in payloads]
    result = {}
    with torch.inference_mode():
        for size in sizes:
            batch = source.processing.network_input(items[:size], torch.device("cpu"))
            result[size] = (batch.clone(), _single_output(source.module(batch)).clone())
    return result


def _single_output(output: Any) -> torch.Tensor:
    if isinstance(output, (list, tuple)):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise ExportError(f"the network returned {type(output).__name__}, expected a tensor")
    return output


def _metadata(plan: FleetPlan, model: str, source: _Source, output: torch.Tensor, profile: BatchProfile) -> ExportMetadata:
    info, options = plan.models[model].plugin, plan.models[model].options
    file = getattr(options, "model", None) or getattr(options, "weights", "")
    return ExportMetadata.model_validate({
        **source.metadata,
        "source": {
            "plugin": info.name,
            "model": model,
            "file": str(file),
            "exporter": f"torch.onnx dynamo, opset {OPSET}",
            "torch": torch.__version__,
        },
        "input": TensorSpec(name=source.input_name, shape=[3, *_input_side(source)]),
        "output": TensorSpec(name=source.output_name, shape=list(output.shape[1:])),
        "batch": profile,
    })


def _input_side(source: _Source) -> tuple[int, int]:
    resize = source.metadata["resize"]
    side = resize.imgsz if isinstance(resize, Letterbox) else resize.crop
    return side, side


def _write_onnx(source: _Source, example: torch.Tensor, metadata: ExportMetadata, path: Path) -> None:
    """torch.onnx's dynamo exporter with a symbolic batch axis; the metadata goes in metadata_props."""
    batch = torch.export.Dim("batch", min=1, max=max(metadata.batch.max, 1024))
    sample = example[:2] if example.shape[0] >= 2 else example.repeat(2, 1, 1, 1)  # 2: batch 1 would specialise
    try:
        with warnings.catch_warnings():
            # YOLO's head caches anchors computed from the input size; the size is fixed, so they are constants.
            warnings.filterwarnings("ignore", message="The tensor attributes .* were assigned during export")
            program = torch.onnx.export(
                source.module,
                (sample,),
                dynamo=True,
                input_names=[source.input_name],
                output_names=[source.output_name],
                dynamic_shapes=({0: batch},),
                opset_version=OPSET,
                verbose=False,
            )
    except Exception as exc:
        raise ExportError(f"torch.onnx could not export the network: {type(exc).__name__}: {exc}") from exc
    assert program is not None  # dynamo=True always returns the program
    program.model.metadata_props[METADATA_KEY] = metadata.to_json()
    program.save(str(path), external_data=False)


def _check_onnx(
    path: Path, metadata: ExportMetadata, reference: dict[int, tuple[torch.Tensor, torch.Tensor]]
) -> list[ParityReport]:
    try:
        import onnxruntime
    except ImportError as exc:
        raise ExportError(f"checking the export needs onnxruntime (pip install onnxruntime): {exc}") from None
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    top_k = metadata.classify.top_k if metadata.classify is not None else 5
    reports = []
    for _, (inputs, expected) in sorted(reference.items()):
        (raw,) = session.run([metadata.output.name], {metadata.input.name: inputs.numpy()})
        got = torch.from_numpy(raw)
        reports.append(compare(metadata.task, expected, got, FP32, engine="onnxruntime", top_k=top_k))
    return reports
