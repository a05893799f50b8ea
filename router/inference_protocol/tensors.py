"""V2 tensors: the datatypes, and the element data of one input as JSON, as typed values (gRPC's
`contents`) or in Triton's binary form (HTTP's binary extension, gRPC's raw contents, shared memory).

Every function checks the data against the declared datatype and shape and raises `InputError`
with the input's name and the bad value, so a client can see which tensor was wrong.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from router.errors import InputError, brief

__all__ = [
    "DATATYPES",
    "DATATYPES_TEXT",
    "Tensor",
    "bytes_from_binary",
    "serialize_bytes",
    "tensor_from_binary",
    "tensor_from_elements",
    "tensor_from_json",
    "tensor_from_values",
]

#: V2 datatypes and their little-endian numpy types; BYTES and BF16 have none (decoded by hand).
DATATYPES: Final[Mapping[str, np.dtype[Any] | None]] = {
    "BOOL": np.dtype("?"), "UINT8": np.dtype("u1"), "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"), "INT8": np.dtype("i1"), "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"), "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
    "BF16": None, "BYTES": None,
}
DATATYPES_TEXT: Final = ", ".join(DATATYPES)


@dataclass(frozen=True)
class Tensor:
    """One decoded input. `data` has the tensor's shape; BYTES data is an object array of `bytes`."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray[Any, Any]


def tensor_from_json(name: str, datatype: str, shape: tuple[int, ...], data: Any, *, base64_bytes: bool = False) -> Tensor:
    """An input whose `data` is JSON: row-major, flat or nested, checked against datatype and shape.
    BYTES elements are UTF-8 strings, or base64 strings when `base64_bytes`."""
    if datatype == "BYTES":
        elements = _flatten_strings(name, data)
        _check_count(name, shape, len(elements), "'data' has")
        return tensor_from_elements(name, shape, [_string_bytes(name, e, base64_bytes) for e in elements])
    try:
        array = np.asarray(data)
    except (ValueError, TypeError):
        raise InputError(f"input {brief(name, 64)}: 'data' must be a flat or evenly nested list of numbers") from None
    _check_count(name, shape, array.size, "'data' has")
    if datatype.startswith(("INT", "UINT")):
        array = _python_ints(data, array)
    return tensor_from_values(name, datatype, shape, array)


def tensor_from_values(name: str, datatype: str, shape: tuple[int, ...], values: np.ndarray[Any, Any]) -> Tensor:
    """An input of numbers or booleans given as values (JSON numbers, gRPC's typed contents),
    checked against the datatype (kind and range) and the shape."""
    _check_count(name, shape, values.size, "the data has")
    return Tensor(name, datatype, shape, _checked_numbers(name, datatype, values).reshape(shape))


def tensor_from_elements(name: str, shape: tuple[int, ...], elements: list[bytes]) -> Tensor:
    """A BYTES input from its elements, checked against the shape."""
    _check_count(name, shape, len(elements), "the data has")
    return Tensor(name, "BYTES", shape, _object_array(elements).reshape(shape))


def _check_count(name: str, shape: tuple[int, ...], count: int, what: str) -> None:
    needed = math.prod(shape)
    if count != needed:
        raise InputError(f"input {brief(name, 64)}: shape {list(shape)} needs {needed} elements, {what} {count}")


def _flatten_strings(name: str, data: Any) -> list[Any]:
    if not isinstance(data, list):
        raise InputError(f"input {brief(name, 64)}: BYTES 'data' must be a list of strings, got {type(data).__name__}")
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for element in stack[-1]:
            if isinstance(element, list):
                stack.append(iter(element))
                break
            flat.append(element)
        else:
            stack.pop()
    return flat


def _string_bytes(name: str, element: Any, base64_bytes: bool) -> bytes:
    if not isinstance(element, str):
        raise InputError(f"input {brief(name, 64)}: BYTES elements must be strings, got {brief(element, 40)}")
    if not base64_bytes:
        return element.encode("utf-8")
    try:
        return base64.b64decode(element, validate=True)
    except binascii.Error as exc:
        raise InputError(f"input {brief(name, 64)}: content_type base64, but an element is not base64: {exc}") from None


def _checked_numbers(name: str, datatype: str, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The JSON numbers as the datatype, refusing wrong kinds and integers out of range."""
    if datatype == "BOOL":
        if array.size and array.dtype.kind != "b":
            raise InputError(f"input {brief(name, 64)}: BOOL data must be true or false")
        return array.astype(bool)
    target = np.dtype("<f4") if datatype == "BF16" else DATATYPES[datatype]
    assert target is not None
    if not array.size:
        return array.astype(target)
    if target.kind == "f":
        if array.dtype.kind not in "iuf":
            raise InputError(f"input {brief(name, 64)}: {datatype} data must be numbers")
        return array.astype(target)
    exact = array.dtype.kind == "O" and all(type(v) is int for v in array.flat)  # from _python_ints
    if array.dtype.kind not in "iu" and not exact:
        raise InputError(f"input {brief(name, 64)}: {datatype} data must be integers")
    info = np.iinfo(target)
    low, high = int(array.min()), int(array.max())
    if low < info.min or high > info.max:
        bad = low if low < info.min else high
        raise InputError(f"input {brief(name, 64)}: {bad} is out of range for {datatype} ({info.min}..{info.max})")
    return array.astype(target)


def _python_ints(data: Any, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Numpy reads [2**63, 0] as floats; where JSON gave integers only, keep them exact (as objects)."""
    if array.dtype.kind not in "fO":
        return array
    objects = np.asarray(data, dtype=object)
    if all(type(v) is int for v in objects.flat):
        return objects
    return array


def tensor_from_binary(name: str, datatype: str, shape: tuple[int, ...], raw: bytes) -> Tensor:
    """An input in Triton's binary form: little-endian, row-major, no padding."""
    count = math.prod(shape)
    if datatype == "BYTES":
        values = bytes_from_binary(name, raw)
        _check_count(name, shape, len(values), "the binary data has")
        return tensor_from_elements(name, shape, values)
    dtype = np.dtype("<u2") if datatype == "BF16" else DATATYPES[datatype]
    assert dtype is not None
    if len(raw) != count * dtype.itemsize:
        raise InputError(
            f"input {brief(name, 64)}: shape {list(shape)} of {datatype} needs {count * dtype.itemsize} bytes, "
            f"the binary data has {len(raw)}"
        )
    array = np.frombuffer(raw, dtype=dtype)
    if datatype == "BF16":  # bfloat16 is the top half of a float32
        array = (array.astype("<u4") << 16).view("<f4")
    return Tensor(name, datatype, shape, array.reshape(shape))


def _object_array(values: list[bytes]) -> np.ndarray[Any, Any]:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def bytes_from_binary(name: str, raw: bytes) -> list[bytes]:
    """Triton's BYTES serialisation: each element is a 4-byte little-endian length, then its bytes."""
    values: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InputError(f"input {brief(name, 64)}: truncated BYTES data: a length prefix is cut off at byte {offset}")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InputError(f"input {brief(name, 64)}: truncated BYTES data: an element of {length} bytes runs past the end")
        values.append(raw[offset:offset + length])
        offset += length
    return values


def serialize_bytes(elements: Iterable[bytes]) -> bytes:
    """BYTES elements in Triton's binary form: each a 4-byte little-endian length, then its bytes."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)
