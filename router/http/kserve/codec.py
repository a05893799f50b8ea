"""The Open Inference Protocol's HTTP/REST wire format: pure functions between request bodies (plain
JSON, or Triton's binary tensor data extension) and `router.inference_protocol`'s values.

`decode_request` parses a body into an `InferRequest` (inputs from JSON `data`, the binary section
or a shared memory region); the protocol-neutral code makes the payloads and runs them;
`encode_response` puts the answers back together as V2 output tensors, in JSON, in the binary
section or in a shared memory region.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from litestar.exceptions import HTTPException
from litestar.serialization import encode_json

from router.errors import InputError, RouterError, brief, v2_status
from router.inference_protocol.payloads import answer_elements
from router.inference_protocol.repository import MODEL_VERSION
from router.inference_protocol.request import (
    InferRequest,
    RequestedOutput,
    check_unique_names,
    checked_datatype,
    checked_shape,
    region_slice,
    request_options,
    requested_output,
)
from router.inference_protocol.shared_memory import ClientRegions
from router.inference_protocol.submission import ItemFailed
from router.inference_protocol.tensors import Tensor, serialize_bytes, tensor_from_binary, tensor_from_json
from router.sdk.bounded_json import loads_bounded

__all__ = ["HEADER_LENGTH", "decode_request", "encode_error", "encode_response"]

HEADER_LENGTH: Final = "Inference-Header-Content-Length"


def decode_request(body: bytes, header_length: str | None = None, *, max_items: int | None = None,
                   regions: ClientRegions | None = None) -> InferRequest:
    """Parse an infer request: the whole body is JSON, or (binary extension) the first
    `header_length` bytes are, and the rest holds the inputs that declare `binary_data_size`.
    An input with more than `max_items` items (its first dimension) is refused (413) from its
    shape, before its data is decoded. Inputs in shared memory are read through `regions`."""
    header, blob = _split_body(body, header_length)
    inputs_json = header.get("inputs")
    if not isinstance(inputs_json, list) or not inputs_json:
        raise InputError("the request needs 'inputs': a non-empty list of tensors")
    offset = 0
    inputs: list[Tensor] = []
    for index, spec in enumerate(inputs_json):
        tensor, used = _decode_input(spec, index, blob, offset, max_items, regions)
        inputs.append(tensor)
        offset += used
    if offset != len(blob):
        raise InputError(f"{len(blob) - offset} bytes of binary data follow the inputs' binary_data_size total of {offset}")
    check_unique_names(tuple(inputs))
    options = request_options(_parameters(header.get("parameters"), "the request"))
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InputError(f"'id' must be a string, got {brief(request_id)}")
    return InferRequest(id=request_id, inputs=tuple(inputs), outputs=_requested_outputs(header.get("outputs")),
                        binary_output=options.binary_output, timeout_ms=options.timeout_ms, priority=options.priority)


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


def _decode_input(spec: Any, index: int, blob: bytes, offset: int, max_items: int | None,
                  regions: ClientRegions | None) -> tuple[Tensor, int]:
    """One input tensor, and how many bytes of the binary section it used."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InputError(f"inputs[{index}] must be an object with a string 'name', got {brief(spec)}")
    name = brief(spec["name"], 64)  # as the messages quote it
    datatype = checked_datatype(spec.get("datatype"), name)
    shape = checked_shape(spec.get("shape"), name, max_items)
    parameters = _parameters(spec.get("parameters"), f"input {name}")
    size = parameters.get("binary_data_size")
    region = region_slice(parameters, f"input {name}")
    if region is not None:
        if "data" in spec or size is not None:
            raise InputError(f"input {name} is in shared memory; it cannot have 'data' or binary_data_size too")
        if regions is None:
            raise InputError(f"input {name}: shared memory is not supported here; send the data in the request")
        return tensor_from_binary(spec["name"], datatype, shape, regions.read(region, f"input {name}")), 0
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


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"{where}: 'parameters' must be an object, got {brief(value)}")
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
        outputs.append(requested_output(spec["name"], _parameters(spec.get("parameters"), f"output {brief(spec['name'], 64)}")))
    return tuple(outputs)


# -- responses --------------------------------------------------------------------------------------


def encode_response(
    model: str, request: InferRequest, outputs: Sequence[RequestedOutput], answers: Sequence[Any],
    regions: ClientRegions | None = None, *, version: str = MODEL_VERSION,
) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary output data follows it. An output
    asked for in shared memory is written there (through `regions`) and answers with no data."""
    header: dict[str, Any] = {"model_name": model, "model_version": version}
    if request.id is not None:
        header["id"] = request.id
    header["outputs"] = []
    blobs: list[bytes] = []
    elements = answer_elements(answers)
    for output in outputs:
        tensor: dict[str, Any] = {"name": output.name, "datatype": "BYTES", "shape": [len(answers)]}
        if output.region is not None:
            if regions is None:
                raise InputError(f"output {brief(output.name, 64)}: shared memory is not supported here")
            blob = serialize_bytes(elements)
            regions.write(output.region, blob, f"output {brief(output.name, 64)}")
            tensor["parameters"] = {"shared_memory_region": output.region.region,
                                    "shared_memory_byte_size": len(blob)}
        elif output.binary:
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
