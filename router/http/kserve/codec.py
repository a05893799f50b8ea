"""Open Inference Protocol (KServe V2 / Triton) codec: pure functions between V2 requests and router payloads.

A V2 request is a batch of N items. `decode_request` parses it (plain JSON, or Triton's binary
tensor data extension), `to_payloads` splits it into one `Payload` per item for the model's
queue, and `encode_response` puts the N answers back together as V2 output tensors.

Every model is described by its media types (`ModelPlugin.accepts`), so any plugin is served:

- image models take `IMAGE`: encoded images as `BYTES` `[N]`, or decoded pixels as `UINT8`
  `[N, H, W, 3]` (each item is re-encoded losslessly as an uncompressed BMP);
- JSON models take `JSON` (`BYTES` `[N]`, one JSON document per item), or any named tensors,
  which become one JSON object per item: `{"x": [...]}` from an input `x` of shape `[N, ...]`;
- other models take `INPUT` (`BYTES` `[N]`), passed through as bytes.

Every model answers `OUTPUT` (`BYTES` `[N]`): each item's native JSON answer as a string.
"""

from __future__ import annotations

import enum
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any, Final

import numpy as np
from litestar.exceptions import HTTPException
from litestar.serialization import encode_json
from PIL import Image

from router.errors import InputError, PayloadTooLarge, RouterError, brief, clip, v2_status
from router.http.kserve.bounded_json import loads_bounded
from router.http.kserve.tensors import DATATYPES, DATATYPES_TEXT, Tensor, serialize_bytes, tensor_from_binary, tensor_from_json
from router.sdk.images import DEFAULT_MAX_PIXELS
from router.sdk.plugin import Payload

__all__ = [
    "HEADER_LENGTH",
    "MAX_DIMS",
    "MODEL_VERSION",
    "OUTPUT_NAME",
    "InferRequest",
    "InputKind",
    "ItemFailed",
    "NotSupported",
    "RequestedOutput",
    "Signature",
    "Tensor",
    "decode_request",
    "encode_error",
    "encode_response",
    "router_priority",
    "select_outputs",
    "signature",
    "to_payloads",
]

HEADER_LENGTH: Final = "Inference-Header-Content-Length"
MODEL_VERSION: Final = "1"
OUTPUT_NAME: Final = "OUTPUT"
_UNSUPPORTED_PARAMETERS: Final = ("sequence_id", "sequence_start", "sequence_end")
#: Dimensions of one tensor (numpy's limit, and Triton's); each at most an int64.
MAX_DIMS: Final = 64
_MAX_DIM: Final = 2**63 - 1


class NotSupported(RouterError):
    """A V2 feature the router does not have yet. 400, as Triton answers a load or unload that its
    model control mode does not allow."""

    status_code = 400


class ItemFailed(Exception):
    """One item of a V2 batch failed; the request answers with its error, naming the item."""

    def __init__(self, index: int, count: int, error: RouterError) -> None:
        super().__init__(f"item {index} of {count}: {error.detail}")
        self.index, self.count, self.error = index, count, error


class InputKind(enum.Enum):
    IMAGE = "IMAGE"
    JSON = "JSON"
    RAW = "INPUT"


@dataclass(frozen=True)
class Signature:
    """How a model's inputs and outputs look over V2, derived from the media types its plugin accepts."""

    kind: InputKind
    media_type: str  # what each item's Payload declares

    @property
    def input_name(self) -> str:
        return self.kind.value

    def metadata(self) -> dict[str, list[dict[str, Any]]]:
        """`inputs` and `outputs` of the model metadata; -1 marks the batch dimension."""
        return {
            "inputs": [{"name": self.input_name, "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": OUTPUT_NAME, "datatype": "BYTES", "shape": [-1]}],
        }


def signature(accepts: Sequence[str]) -> Signature:
    """The V2 signature of a plugin that accepts these media types (`image/*` wildcards allowed)."""
    if any(pattern.lower().startswith("image/") for pattern in accepts):
        return Signature(InputKind.IMAGE, "application/octet-stream")  # the image decoder sniffs the format
    if any(fnmatch("application/json", pattern.lower()) for pattern in accepts):
        return Signature(InputKind.JSON, "application/json")
    concrete = [a for a in accepts if "*" not in a]
    return Signature(InputKind.RAW, concrete[0] if concrete else "application/octet-stream")


# -- requests ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool


@dataclass(frozen=True)
class InferRequest:
    id: str | None
    inputs: tuple[Tensor, ...]
    outputs: tuple[RequestedOutput, ...] | None  # None: every output
    binary_output: bool  # the default for outputs not named in `outputs`
    timeout_ms: float | None
    priority: int | None  # as the client sent it: Triton's 1 is the highest, None the default


def decode_request(body: bytes, header_length: str | None = None, *, max_items: int | None = None) -> InferRequest:
    """Parse an infer request: the whole body is JSON, or (binary extension) the first
    `header_length` bytes are, and the rest holds the inputs that declare `binary_data_size`.
    An input with more than `max_items` items (its first dimension) is refused (413) from its
    shape, before its data is decoded."""
    header, blob = _split_body(body, header_length)
    inputs_json = header.get("inputs")
    if not isinstance(inputs_json, list) or not inputs_json:
        raise InputError("the request needs 'inputs': a non-empty list of tensors")
    offset = 0
    inputs: list[Tensor] = []
    for index, spec in enumerate(inputs_json):
        tensor, used = _decode_input(spec, index, blob, offset, max_items)
        inputs.append(tensor)
        offset += used
    if offset != len(blob):
        raise InputError(f"{len(blob) - offset} bytes of binary data follow the inputs' binary_data_size total of {offset}")
    names = [t.name for t in inputs]
    if len(set(names)) != len(names):
        raise InputError(f"input names must be unique, got {brief(names)}")
    parameters = _parameters(header.get("parameters"), "the request")
    for key in _UNSUPPORTED_PARAMETERS:
        if parameters.get(key):
            raise InputError(f"parameter {key!r}: sequence batching is not supported")
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InputError(f"'id' must be a string, got {brief(request_id)}")
    return InferRequest(
        id=request_id, inputs=tuple(inputs), outputs=_requested_outputs(header.get("outputs")),
        binary_output=_flag(parameters, "binary_data_output", "the request"),
        timeout_ms=_timeout_ms(parameters), priority=_priority(parameters),
    )


def _split_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    if header_length is None:
        length = len(body)
    else:
        digits = header_length.strip()
        if not (digits.isascii() and digits.isdigit() and len(digits) <= 18):
            raise InputError(f"{HEADER_LENGTH} must be a number of bytes in decimal digits, "
                             f"got {brief(header_length, 40)}")
        length = int(digits)
        if not 0 < length <= len(body):
            raise InputError(f"{HEADER_LENGTH} is {length}, but the body has {len(body)} bytes")
    where = f"the first {length} bytes ({HEADER_LENGTH})" if header_length is not None else "the body"
    header = loads_bounded(body[:length], where, expected="the JSON inference request")
    if not isinstance(header, dict):
        raise InputError(f"the inference request must be a JSON object, got {type(header).__name__}")
    return header, body[length:]


def _decode_input(spec: Any, index: int, blob: bytes, offset: int, max_items: int | None) -> tuple[Tensor, int]:
    """One input tensor, and how many bytes of the binary section it used."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InputError(f"inputs[{index}] must be an object with a string 'name', got {brief(spec)}")
    name = brief(spec["name"], 64)  # as the messages quote it
    datatype = spec.get("datatype")
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise InputError(f"input {name}: datatype must be one of {DATATYPES_TEXT}, got {brief(datatype, 40)}")
    shape = _shape(spec.get("shape"), name)
    if max_items is not None and shape[0] > max_items:
        raise PayloadTooLarge(
            f"input {name} has {shape[0]} items (its first dimension); a request to this model may carry at most {max_items}"
        )
    parameters = _parameters(spec.get("parameters"), f"input {name}")
    if "shared_memory_region" in parameters:
        raise InputError(f"input {name}: shared memory is not supported; send the data in the request")
    size = parameters.get("binary_data_size")
    if size is None:
        if "data" not in spec:
            raise InputError(f"input {name} has no 'data' and no binary_data_size parameter")
        base64_bytes = parameters.get("content_type") == "base64"
        return tensor_from_json(spec["name"], datatype, shape, spec["data"], base64_bytes=base64_bytes), 0
    if "data" in spec:
        raise InputError(f"input {name} has both 'data' and binary_data_size; send one")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InputError(f"input {name}: binary_data_size must be a non-negative integer, got {brief(size, 40)}")
    if offset + size > len(blob):
        raise InputError(
            f"input {name}: binary_data_size {size} runs past the end of the body "
            f"({len(blob) - offset} bytes of binary data left)"
        )
    return tensor_from_binary(spec["name"], datatype, shape, blob[offset:offset + size]), size


def _shape(value: Any, name: str) -> tuple[int, ...]:
    dims = value if isinstance(value, list) else []
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= _MAX_DIM for d in dims):
        raise InputError(f"input {name}: shape must be a non-empty list of non-negative integers, got {brief(value)}")
    if len(dims) > MAX_DIMS:
        raise InputError(f"input {name}: shape has {len(dims)} dimensions; at most {MAX_DIMS} are accepted")
    if math.prod(dims) > _MAX_DIM:
        raise InputError(f"input {name}: shape {dims} has more than 2**63 - 1 elements")
    return tuple(dims)


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"{where}: 'parameters' must be an object, got {brief(value)}")
    return value


def _flag(parameters: Mapping[str, Any], key: str, where: str) -> bool:
    value = parameters.get(key, False)
    if not isinstance(value, bool):
        raise InputError(f"{where}: parameter {brief(key, 40)} must be true or false, got {brief(value, 40)}")
    return value


def _requested_outputs(value: Any) -> tuple[RequestedOutput, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise InputError(f"'outputs' must be a list of {{\"name\": ...}} objects, got {brief(value)}")
    outputs = []
    for index, spec in enumerate(value):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise InputError(f"outputs[{index}] must be an object with a string 'name', got {brief(spec)}")
        where = f"output {brief(spec['name'], 64)}"
        parameters = _parameters(spec.get("parameters"), where)
        for feature, text in (("classification", "classification"), ("shared_memory_region", "shared memory")):
            if parameters.get(feature):
                raise InputError(f"{where}: {text} is not supported")
        outputs.append(RequestedOutput(spec["name"], _flag(parameters, "binary_data", where)))
    return tuple(outputs)


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


# -- from tensors to payloads, and answers back to tensors ---------------------------------------------------


def to_payloads(request: InferRequest, model: str, sig: Signature) -> list[Payload]:
    """One payload per item of the batch dimension, in order."""
    sizes = {t.shape[0] for t in request.inputs}
    if len(sizes) != 1:
        shapes = ", ".join(f"{clip(t.name, 40)} {list(t.shape)}" for t in request.inputs[:4])
        raise InputError(f"every input must have the same batch size (first dimension); got {shapes}")
    if sizes == {0}:
        raise InputError("the batch is empty: the inputs' first dimension is 0")
    if sig.kind is InputKind.JSON and not (len(request.inputs) == 1 and request.inputs[0].name == sig.input_name):
        return _json_objects(request.inputs, sig)
    tensor = _only_input(request.inputs, model, sig)
    if sig.kind is InputKind.IMAGE and tensor.datatype == "UINT8" and len(tensor.shape) == 4 and tensor.shape[3] == 3:
        height, width = tensor.shape[1:3]
        if height * width > DEFAULT_MAX_PIXELS:  # refused before any image is re-encoded
            raise PayloadTooLarge(f"input {brief(tensor.name, 64)}: images of {width}x{height} pixels are over the "
                                  f"limit of {DEFAULT_MAX_PIXELS} pixels")
        return [_bmp(pixels) for pixels in tensor.data]
    if tensor.datatype == "BYTES" and (len(tensor.shape) == 1 or tensor.shape[1:] == (1,)):
        return [Payload(bytes(element), sig.media_type) for element in tensor.data.reshape(-1)]
    forms = "BYTES [N] or UINT8 [N,H,W,3]" if sig.kind is InputKind.IMAGE else "BYTES [N]"
    raise InputError(
        f"input {brief(tensor.name, 64)} of model {model!r} must be {forms}, got {tensor.datatype} {list(tensor.shape)}"
    )


def _only_input(inputs: Sequence[Tensor], model: str, sig: Signature) -> Tensor:
    names = [t.name for t in inputs]
    if names != [sig.input_name]:
        raise InputError(f"model {model!r} takes one input named {sig.input_name!r}, got {brief(names)}")
    return inputs[0]


def _bmp(pixels: np.ndarray[Any, Any]) -> Payload:
    """Decoded RGB pixels as an uncompressed BMP: lossless, cheap, and read by every image plugin."""
    if not pixels.size:
        raise InputError(f"an image of shape {list(pixels.shape)} has no pixels")
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels), "RGB").save(buffer, format="BMP")
    return Payload(buffer.getvalue(), "image/bmp")


def _json_objects(inputs: Sequence[Tensor], sig: Signature) -> list[Payload]:
    """Named tensors of a JSON model as one object per item: `{"x": row i of x, ...}`."""
    if any(t.name == sig.input_name for t in inputs):
        raise InputError(f"input {sig.input_name!r} holds whole JSON documents; send it alone, not with other inputs")
    columns = {t.name: _json_values(t) for t in inputs}
    count = inputs[0].shape[0]
    return [Payload(encode_json({name: rows[i] for name, rows in columns.items()}), sig.media_type) for i in range(count)]


def _json_values(tensor: Tensor) -> list[Any]:
    if tensor.datatype != "BYTES":
        return list(tensor.data.tolist())
    try:
        text = np.array([b.decode("utf-8") for b in tensor.data.reshape(-1)], dtype=object)
    except UnicodeDecodeError as exc:
        raise InputError(f"input {brief(tensor.name, 64)}: BYTES elements must be UTF-8 text for this model: {exc}") from None
    return list(text.reshape(tensor.shape).tolist())


def select_outputs(request: InferRequest, sig: Signature) -> tuple[RequestedOutput, ...]:
    """The outputs to answer with: those asked for, else all of them in the request's default form."""
    available = [o["name"] for o in sig.metadata()["outputs"]]
    if request.outputs is None:
        return tuple(RequestedOutput(name, request.binary_output) for name in available)
    unknown = [o.name for o in request.outputs if o.name not in available]
    if unknown:
        raise InputError(f"unknown output {brief(unknown[0], 64)}; outputs: {', '.join(available)}")
    return request.outputs


def encode_response(
    model: str, request: InferRequest, outputs: Sequence[RequestedOutput], answers: Sequence[Any]
) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary output data follows it."""
    header: dict[str, Any] = {"model_name": model, "model_version": MODEL_VERSION}
    if request.id is not None:
        header["id"] = request.id
    header["outputs"] = []
    blobs: list[bytes] = []
    elements = [encode_json(answer) for answer in answers]
    for output in outputs:
        tensor: dict[str, Any] = {"name": output.name, "datatype": "BYTES", "shape": [len(answers)]}
        if output.binary:
            blob = serialize_bytes(elements)
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = [e.decode("utf-8") for e in elements]
        header["outputs"].append(tensor)
    head = encode_json(header)
    if not blobs:
        return head, None
    return head + b"".join(blobs), len(head)


# -- errors -----------------------------------------------------------------------------------------


def encode_error(exc: BaseException) -> tuple[int, dict[str, str], dict[str, str]] | None:
    """A known error as (status, `{"error": ...}` body, headers); None for an unexpected one.
    Statuses are the native ones except where `router.errors.V2_STATUS` says otherwise."""
    if isinstance(exc, ItemFailed):
        status, _, headers = _router_error(exc.error)
        return status, {"error": str(exc)}, headers
    if isinstance(exc, RouterError):
        return _router_error(exc)
    if isinstance(exc, HTTPException):
        return exc.status_code, {"error": str(exc.detail)}, dict(exc.headers or {})
    return None


def _router_error(exc: RouterError) -> tuple[int, dict[str, str], dict[str, str]]:
    status, headers = v2_status(exc)
    return status, {"error": exc.detail}, headers
