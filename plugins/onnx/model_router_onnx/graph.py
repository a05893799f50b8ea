"""Facts read from an ONNX graph: the export metadata, weight bytes, and an activation estimate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_router_engines.metadata import METADATA_KEY, ExportMetadata, parse_metadata

__all__ = ["GraphFacts", "read_graph"]


@dataclass(frozen=True)
class GraphFacts:
    """What the onnx plugin needs from the file before it opens a session."""

    metadata: ExportMetadata
    weights_bytes: int
    activation_bytes_per_item: int


def read_graph(path: Path) -> GraphFacts:
    """Parse the model once: metadata, initializer bytes, and the shape-inferred activations at batch 1."""
    import onnx

    try:
        proto = onnx.load(str(path))
    except Exception as exc:  # noqa: BLE001  # onnx raises DecodeError, OSError, ... for a file that is not a model
        raise ValueError(f"{str(path)!r} is not a readable ONNX model: {type(exc).__name__}: {exc}") from None
    props = {prop.key: prop.value for prop in proto.metadata_props}
    metadata = parse_metadata(props.get(METADATA_KEY), str(path))
    weights = sum(_tensor_bytes(onnx, init.data_type, init.dims) for init in proto.graph.initializer)
    return GraphFacts(metadata, weights, _activation_bytes(onnx, proto))


def _tensor_bytes(onnx: Any, data_type: int, dims: Any) -> int:
    count = 1
    for dim in dims:
        count *= int(dim)
    return int(count * onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize)


def _activation_bytes(onnx: Any, proto: Any) -> int:
    """Sum of every intermediate tensor for one input (symbolic dims taken as 1): an upper bound on
    what one more item in a batch costs, like `router.sdk.torch_memory.activation_bytes` for torch."""
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:  # noqa: BLE001  # a graph shape inference cannot follow: no estimate rather than no model
        return 0
    total = 0
    for value in [*inferred.graph.value_info, *inferred.graph.output]:
        tensor = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else (1 if d.dim_param else None) for d in tensor.shape.dim]
        if tensor.elem_type and None not in dims:
            total += _tensor_bytes(onnx, tensor.elem_type, dims)
    return total
