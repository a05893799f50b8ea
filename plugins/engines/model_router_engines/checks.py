"""What an export is checked with before it gets its final name: the inputs, the reference that
answers them, and the comparison. The ONNX export is checked against eager PyTorch; a TensorRT
engine against onnxruntime running the ONNX file it was built from, so an engine can be built
where only the ONNX file is (the machine that serves it), without the source checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from model_router_engines.metadata import METADATA_KEY, BatchProfile, ExportMetadata, MetadataError, parse_metadata
from model_router_engines.parity import ParityReport, Tolerance, compare
from router.sdk import ExportError, synthetic_images

__all__ = ["CHECK_BATCH", "OnnxReference", "check_inputs", "check_outputs", "check_sizes"]

CHECK_BATCH = 8  # the full batch the checks run, when the batch profile allows one that large

#: batch size -> (network input, reference output)
Expected = Mapping[int, tuple[torch.Tensor, torch.Tensor]]


def check_sizes(profile: BatchProfile) -> list[int]:
    """Batch 1 and a full batch (at most CHECK_BATCH)."""
    return sorted({1, min(profile.max, CHECK_BATCH)})


def check_inputs(metadata: ExportMetadata, count: int, *, seed: int = 0) -> torch.Tensor:
    """`count` photo-like images as the network takes them: synthetic 8-bit pixels (colour fields,
    noise, solid shapes, letterbox bands), normalised as the metadata says. Needs no task
    processing, so any export can be checked by any exporter."""
    channels, height, width = metadata.input.shape
    if channels != 3 or height != width:
        raise ExportError(f"the check inputs are square RGB images; the network takes {metadata.input.shape}")
    images = synthetic_images(torch.Generator().manual_seed(seed), count=count, side=height)
    norm = metadata.normalisation
    mean = torch.tensor(norm.mean).view(1, 3, 1, 1)
    std = torch.tensor(norm.std).view(1, 3, 1, 1)
    pixels: torch.Tensor = (images * 255).round()
    return ((pixels * norm.scale - mean) / std).float().contiguous()


def check_outputs(
    metadata: ExportMetadata,
    run: Callable[[torch.Tensor], torch.Tensor],
    expected: Expected,
    tolerance: Tolerance,
    *,
    engine: str,
    against: str,
) -> list[ParityReport]:
    """Run every checked batch through `run` and compare it with the reference's output."""
    top_k = metadata.classify.top_k if metadata.classify is not None else 5
    return [
        compare(metadata.task, want, run(inputs), tolerance, engine=engine, against=against, top_k=top_k)
        for _, (inputs, want) in sorted(expected.items())
    ]


class OnnxReference:
    """An ONNX file written by `model-router export`, on onnxruntime's CPU provider: its metadata
    and its raw outputs. Needs onnxruntime (imported here, not when the module is)."""

    def __init__(self, path: Path) -> None:
        ort = _onnxruntime()
        try:
            self._session: Any = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001  # onnxruntime raises its own Fail, InvalidProtobuf, NoSuchFile ...
            raise ExportError(f"onnxruntime cannot open {str(path)!r}: {type(exc).__name__}: {exc}") from None
        try:
            props = self._session.get_modelmeta().custom_metadata_map
            self.metadata = parse_metadata(props.get(METADATA_KEY), str(path))
        except MetadataError as exc:
            raise ExportError(str(exc)) from None

    def run(self, inputs: torch.Tensor) -> torch.Tensor:
        meta = self.metadata
        (raw,) = self._session.run([meta.output.name], {meta.input.name: inputs.detach().cpu().contiguous().numpy()})
        return torch.from_numpy(raw)

    def expected(self, sizes: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The check inputs at each batch size and onnxruntime's outputs for them."""
        inputs = check_inputs(self.metadata, max(sizes))
        return {size: (inputs[:size], self.run(inputs[:size])) for size in sizes}


def _onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise ExportError(f"checking an export needs onnxruntime (pip install onnxruntime): {exc}") from None
    return onnxruntime
