"""An Open Inference Protocol request as data, whatever it came over (JSON over HTTP, protobuf over
gRPC), and the checks both decoders make on what a client declares: datatypes, shapes, item counts,
request and tensor parameters.

The decoders turn their wire format into plain values (`parameters` are a mapping of str to bool,
int, float or str on both) and call these functions, so a bad request gets the same words over
either protocol.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from router.errors import InputError, PayloadTooLarge, brief
from router.inference_protocol.shared_memory import RegionSlice
from router.inference_protocol.tensors import DATATYPES, DATATYPES_TEXT, Tensor

__all__ = [
    "MAX_DIMS",
    "InferRequest",
    "RequestOptions",
    "RequestedOutput",
    "check_unique_names",
    "checked_datatype",
    "checked_shape",
    "flag",
    "region_slice",
    "request_options",
    "requested_output",
    "router_priority",
]

#: Dimensions of one tensor (numpy's limit, and Triton's); each at most an int64.
MAX_DIMS: Final = 64
_MAX_DIM: Final = 2**63 - 1
_UNSUPPORTED_PARAMETERS: Final = ("sequence_id", "sequence_start", "sequence_end")


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool
    region: RegionSlice | None = None  # written to this shared memory region instead of the answer


@dataclass(frozen=True)
class InferRequest:
    id: str | None
    inputs: tuple[Tensor, ...]
    outputs: tuple[RequestedOutput, ...] | None  # None: every output
    binary_output: bool  # the default for outputs not named in `outputs`
    timeout_ms: float | None
    priority: int | None  # as the client sent it: Triton's 1 is the highest, None the default

    @property
    def items(self) -> int:
        """The batch size: the first dimension of the first input."""
        return self.inputs[0].shape[0]


@dataclass(frozen=True)
class RequestOptions:
    binary_output: bool
    timeout_ms: float | None
    priority: int | None


def checked_datatype(value: Any, name: str) -> str:
    if not isinstance(value, str) or value not in DATATYPES:
        raise InputError(f"input {name}: datatype must be one of {DATATYPES_TEXT}, got {brief(value, 40)}")
    return value


def checked_shape(value: Any, name: str, max_items: int | None) -> tuple[int, ...]:
    """The declared shape (a list, or gRPC's repeated field), refused (400) when malformed and (413)
    when its first dimension has more than `max_items` items: before any of the tensor's data is
    decoded. Its length is checked before its dimensions are read."""
    dims = value if isinstance(value, Sequence) and not isinstance(value, str | bytes) else []
    if len(dims) > MAX_DIMS:
        raise InputError(f"input {name}: shape has {len(dims)} dimensions; at most {MAX_DIMS} are accepted")
    dims = list(dims)
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= _MAX_DIM for d in dims):
        raise InputError(f"input {name}: shape must be a non-empty list of non-negative integers, got {brief(value)}")
    if math.prod(dims) > _MAX_DIM:
        raise InputError(f"input {name}: shape {dims} has more than 2**63 - 1 elements")
    if max_items is not None and dims[0] > max_items:
        raise PayloadTooLarge(
            f"input {name} has {dims[0]} items (its first dimension); a request to this model may carry at most {max_items}"
        )
    return tuple(dims)


def check_unique_names(inputs: tuple[Tensor, ...]) -> None:
    names = [t.name for t in inputs]
    if len(set(names)) != len(names):
        raise InputError(f"input names must be unique, got {brief(names)}")


def flag(parameters: Mapping[str, Any], key: str, where: str) -> bool:
    value = parameters.get(key, False)
    if not isinstance(value, bool):
        raise InputError(f"{where}: parameter {brief(key, 40)} must be true or false, got {brief(value, 40)}")
    return value


def request_options(parameters: Mapping[str, Any]) -> RequestOptions:
    """The request's own parameters: binary output, `timeout` (microseconds), `priority`; sequence
    batching is refused."""
    for key in _UNSUPPORTED_PARAMETERS:
        if parameters.get(key):
            raise InputError(f"parameter {key!r}: sequence batching is not supported")
    return RequestOptions(flag(parameters, "binary_data_output", "the request"), _timeout_ms(parameters),
                          _priority(parameters))


def _timeout_ms(parameters: Mapping[str, Any]) -> float | None:
    """Triton's `timeout` is in microseconds; 0 or absent means the model's queue timeout."""
    value = parameters.get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"parameter 'timeout' must be a non-negative integer of microseconds, got {brief(value, 40)}")
    return value / 1000.0 if value else None


def _priority(parameters: Mapping[str, Any]) -> int | None:
    value = parameters.get("priority")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"parameter 'priority' must be a non-negative integer, got {brief(value, 40)}")
    return value or None


def router_priority(priority: int | None, levels: int) -> int | None:
    """Triton's priority (1 is the highest, `levels` the lowest) as the router's level (`levels` is the highest)."""
    if priority is None:
        return None
    if priority > levels:
        raise InputError(f"parameter 'priority' must be 0 (the default) or 1..{levels} (1 is the highest), "
                         f"got {brief(priority, 40)}")
    return levels + 1 - priority


def region_slice(parameters: Mapping[str, Any], where: str) -> RegionSlice | None:
    """The shared memory extension's parameters of a tensor, or None when it names no region.
    `shared_memory_region` and `shared_memory_byte_size` go together; the offset defaults to 0."""
    region = parameters.get("shared_memory_region")
    size = parameters.get("shared_memory_byte_size")
    offset = parameters.get("shared_memory_offset", 0)
    if region is None and size is None:
        return None
    if not isinstance(region, str) or not region:
        raise InputError(f"{where}: shared_memory_byte_size needs shared_memory_region, the name of a registered region")
    for key, value in (("shared_memory_byte_size", size), ("shared_memory_offset", offset)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError(f"{where}: parameter {key} must be a non-negative integer, got {brief(value, 40)}")
    return RegionSlice(region, offset, size)


def requested_output(name: str, parameters: Mapping[str, Any]) -> RequestedOutput:
    """One entry of the request's `outputs`: classification is refused; shared memory is a region."""
    where = f"output {brief(name, 64)}"
    if parameters.get("classification"):
        raise InputError(f"{where}: classification is not supported")
    return RequestedOutput(name, flag(parameters, "binary_data", where), region_slice(parameters, where))
