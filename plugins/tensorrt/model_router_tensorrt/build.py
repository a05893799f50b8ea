"""Building a TensorRT engine from a checked ONNX export: one optimisation profile whose batch
range comes from the model's batch policy, optional fp16, then the same check against eager
PyTorch before anything is written under its final name."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from model_router_onnx.export import ExportError, OnnxExport, Progress
from model_router_onnx.metadata import ExportMetadata, sidecar_path, write_sidecar
from model_router_onnx.parity import FP16, FP32, ParityReport, Tolerance, compare

from model_router_tensorrt.limits import startup_problems
from model_router_tensorrt.runner import EngineRunner, tensorrt_logger, tensorrt_version

__all__ = ["build_engine", "engine_problems"]


def engine_problems(device: str = "cuda:0") -> list[str]:
    """Why no engine can be built here (empty: it can)."""
    return startup_problems(device, tensorrt_version=tensorrt_version(), cuda_available=torch.cuda.is_available())


def build_engine(
    export: OnnxExport,
    *,
    fp16: bool = False,
    device: str = "cuda:0",
    out: Path | None = None,
    optimization_level: int | None = None,
    progress: Progress = print,
) -> Path:
    """Build, check and write `<onnx stem>.engine` and its metadata `<engine>.json`; return the engine path.

    `optimization_level` (TensorRT's 0-5, default 3) trades engine speed for build time; tests use 1.
    """
    import tensorrt as trt

    target = out if out is not None else export.path.with_suffix(".engine")
    batch, precision = export.metadata.batch, "fp16" if fp16 else "fp32"
    started = time.perf_counter()
    progress(f"[1/3] {export.model}: building a TensorRT {trt.__version__} {precision} engine, "
             f"batch min {batch.min} / opt {batch.opt} / max {batch.max}")
    serialized = _build(trt, export.path, export.metadata, fp16, optimization_level, progress)
    metadata = _engine_metadata(export.metadata, trt.__version__, precision)
    progress(f"[2/3] {export.model}: checking the engine against PyTorch at batch "
             f"{' and '.join(map(str, sorted(export.reference)))}")
    checks = _check(serialized, torch.device(device), metadata, export, FP16 if fp16 else FP32)
    for report in checks:
        progress(f"      {report.line()}")
    if not all(report.ok for report in checks):
        raise ExportError(f"{export.model}: the TensorRT engine does not match PyTorch; nothing written")
    partial = target.with_name(f".{target.name}.partial")
    try:
        partial.write_bytes(serialized)
        write_sidecar(sidecar_path(target), metadata)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    size_mb = target.stat().st_size / 1e6
    progress(f"[3/3] {export.model}: wrote {target} ({size_mb:.1f} MB) and {sidecar_path(target).name} "
             f"in {time.perf_counter() - started:.1f} s")
    return target


def _build(
    trt: Any, onnx_path: Path, metadata: ExportMetadata, fp16: bool, level: int | None, progress: Progress
) -> bytes:
    logger = tensorrt_logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode from TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ExportError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    if fp16:
        if not hasattr(trt.BuilderFlag, "FP16"):  # TensorRT 11: strongly typed networks only
            raise ExportError(f"TensorRT {trt.__version__} has no fp16 builder flag; build without --fp16")
        config.set_flag(trt.BuilderFlag.FP16)
    if level is not None:
        config.builder_optimization_level = level
    shape, batch = metadata.input.shape, metadata.batch
    profile = builder.create_optimization_profile()
    profile.set_shape(metadata.input.name, (batch.min, *shape), (batch.opt, *shape), (batch.max, *shape))
    config.add_optimization_profile(profile)
    monitor = _monitor(trt, progress)  # held until the build returns: TensorRT keeps only a pointer
    if monitor is not None and hasattr(config, "progress_monitor"):
        config.progress_monitor = monitor
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError(f"TensorRT could not build an engine from {onnx_path}; see its log above")
    return bytes(serialized)


def _monitor(trt: Any, progress: Progress) -> Any:
    """Top-level build phases as progress lines (TensorRT >= 10 has IProgressMonitor)."""
    base = getattr(trt, "IProgressMonitor", None)
    if base is None:
        return None

    class Monitor(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()  # TensorRT's binding needs the base initialised

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            if parent_phase is None:
                progress(f"      TensorRT: {phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name: str, step: int) -> bool:
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            pass

    return Monitor()


def _engine_metadata(metadata: ExportMetadata, version: str, precision: str) -> ExportMetadata:
    source = {**metadata.source, "tensorrt": version, "precision": precision}
    return metadata.model_copy(update={"source": source})


def _check(
    serialized: bytes, device: torch.device, metadata: ExportMetadata, export: OnnxExport, tolerance: Tolerance
) -> list[ParityReport]:
    runner = EngineRunner(serialized, device, metadata, export.model)
    top_k = metadata.classify.top_k if metadata.classify is not None else 5
    try:
        reports = []
        for _, (inputs, expected) in sorted(export.reference.items()):
            got = runner.run(inputs.to(device))
            reports.append(compare(metadata.task, expected, got, tolerance, engine="tensorrt", top_k=top_k))
        return reports
    finally:
        runner.close()
