"""The `tensorrt` exporter: a TensorRT engine built from an ONNX file that `model-router export`
wrote, on the machine that will serve it. One optimisation profile whose batch range is the
export's, optional fp16, then a check against onnxruntime running the same ONNX file on the same
inputs, before anything is written under its final name. Needs neither the source checkpoint nor
its plugin: only the `.onnx` file, TensorRT, onnxruntime and a GPU.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any, ClassVar

import torch
from model_router_engines.checks import OnnxReference, check_outputs, check_sizes
from model_router_engines.metadata import ExportMetadata, sidecar_path, write_sidecar
from model_router_engines.parity import FP16, FP32, ParityReport, Tolerance

from model_router_tensorrt.limits import startup_problems
from model_router_tensorrt.runner import EngineRunner, tensorrt_logger, tensorrt_version
from router.sdk import Exporter, ExportError, ExportJob, Progress, partial_file

__all__ = ["TensorRTExporter", "build_engine", "engine_problems"]


class TensorRTExporter(Exporter):
    """An ONNX export to `<model>.engine` and its metadata `<model>.engine.json`."""

    format: ClassVar[str] = "tensorrt"
    title: ClassVar[str] = "TensorRT engine"
    suffix: ClassVar[str] = ".engine"
    needs: ClassVar[str | None] = "onnx"

    def problems(self, device: str) -> list[str]:
        return engine_problems(device)

    def export(self, job: ExportJob) -> Path:
        if job.input is None:
            raise ExportError(f"the tensorrt exporter builds from an ONNX file; none was given for {job.model!r}")
        return build_engine(job.input, fp16=job.fp16, device=job.device, out=job.out, progress=job.progress,
                            model=job.model)


def engine_problems(device: str = "cuda:0") -> list[str]:
    """Why no engine can be built here (empty: it can)."""
    problems = startup_problems(device, tensorrt_version=tensorrt_version(), cuda_available=torch.cuda.is_available())
    if importlib.util.find_spec("onnxruntime") is None:
        problems.append("the engine is checked against onnxruntime, which is not installed "
                        "(pip install -e 'plugins/tensorrt[tensorrt]')")
    return problems


def build_engine(
    onnx_path: Path,
    *,
    fp16: bool = False,
    device: str = "cuda:0",
    out: Path | None = None,
    optimization_level: int | None = None,
    progress: Progress = print,
    model: str | None = None,
) -> Path:
    """Build, check and write `<onnx stem>.engine` and its metadata `<engine>.json`; return the engine path.

    `optimization_level` (TensorRT's 0-5, default 3) trades engine speed for build time; tests use 1.
    """
    import tensorrt as trt

    name = model or onnx_path.stem
    target = out if out is not None else onnx_path.with_suffix(".engine")
    reference = OnnxReference(onnx_path)
    batch, precision = reference.metadata.batch, "fp16" if fp16 else "fp32"
    started = time.perf_counter()
    progress(f"[1/3] {name}: building a TensorRT {trt.__version__} {precision} engine from {onnx_path}, "
             f"batch min {batch.min} / opt {batch.opt} / max {batch.max}")
    serialized = _build(trt, onnx_path, reference.metadata, fp16, optimization_level, progress)
    metadata = _engine_metadata(reference.metadata, trt.__version__, precision)
    sizes = check_sizes(batch)
    progress(f"[2/3] {name}: checking the engine against onnxruntime at batch {' and '.join(map(str, sizes))}")
    checks = _check(serialized, torch.device(device), metadata, reference, sizes, FP16 if fp16 else FP32, name)
    for report in checks:
        progress(f"      {report.line()}")
    if not all(report.ok for report in checks):
        raise ExportError(f"{name}: the TensorRT engine does not match onnxruntime; nothing written")
    with partial_file(target) as partial:
        partial.write_bytes(serialized)
        write_sidecar(sidecar_path(target), metadata)
    size_mb = target.stat().st_size / 1e6
    progress(f"[3/3] {name}: wrote {target} ({size_mb:.1f} MB) and {sidecar_path(target).name} "
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
    serialized: bytes,
    device: torch.device,
    metadata: ExportMetadata,
    reference: OnnxReference,
    sizes: list[int],
    tolerance: Tolerance,
    model: str,
) -> list[ParityReport]:
    runner = EngineRunner(serialized, device, metadata, model)
    try:
        expected = reference.expected(sizes)
        return check_outputs(metadata, lambda inputs: runner.run(inputs.to(device)), expected, tolerance,
                             engine="tensorrt", against="onnxruntime")
    finally:
        runner.close()
