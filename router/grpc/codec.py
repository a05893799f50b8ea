"""The Open Inference Protocol's gRPC wire format: pure functions between `ModelInferRequest` /
`ModelInferResponse` messages and `router.inference_protocol`'s values.

An input's data is in one of three places, as Triton reads it: a shared memory region (its
`shared_memory_*` parameters), typed `contents` (the field its datatype names), or the next entry
of `raw_input_contents` (the inputs that use neither take the entries in order). Answers go back
as one `BYTES` output in `raw_output_contents`, or into a shared memory region.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
from google.protobuf.message import Message

from router.errors import InputError, brief
from router.grpc.protos import grpc_service_pb2 as pb
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
from router.inference_protocol.tensors import (
    Tensor,
    serialize_bytes,
    tensor_from_binary,
    tensor_from_elements,
    tensor_from_values,
)

__all__ = ["decode_request", "encode_response", "parameter_values"]

#: The `InferTensorContents` field of each datatype, and the numpy type its values arrive as.
#: FP16 and BF16 have none: they travel as raw contents only.
CONTENTS: Final[Mapping[str, tuple[str, str | None]]] = {
    "BOOL": ("bool_contents", "?"), "INT8": ("int_contents", "<i4"), "INT16": ("int_contents", "<i4"),
    "INT32": ("int_contents", "<i4"), "INT64": ("int64_contents", "<i8"), "UINT8": ("uint_contents", "<u4"),
    "UINT16": ("uint_contents", "<u4"), "UINT32": ("uint_contents", "<u4"), "UINT64": ("uint64_contents", "<u8"),
    "FP32": ("fp32_contents", "<f4"), "FP64": ("fp64_contents", "<f8"), "BYTES": ("bytes_contents", None),
}


def parameter_values(parameters: Mapping[str, Message]) -> dict[str, Any]:
    """A protobuf parameter map (`InferParameter` oneofs) as plain values, as JSON would give them."""
    values: dict[str, Any] = {}
    for key, parameter in parameters.items():
        which = parameter.WhichOneof("parameter_choice")
        values[key] = None if which is None else getattr(parameter, which)
    return values


def decode_request(message: Any, *, max_items: int | None = None, regions: ClientRegions | None = None) -> InferRequest:
    """A `ModelInferRequest` as an `InferRequest`. An input with more than `max_items` items is
    refused (413) from its shape before its data is read; shared memory inputs are read through `regions`."""
    if not message.inputs:
        raise InputError("the request needs 'inputs': a non-empty list of tensors")
    raw = message.raw_input_contents
    next_raw = 0
    inputs: list[Tensor] = []
    for spec in message.inputs:
        tensor, used_raw = _decode_input(spec, raw, next_raw, max_items, regions)
        inputs.append(tensor)
        next_raw += used_raw
    if next_raw != len(raw):
        raise InputError(f"the request has {len(raw)} raw_input_contents entries, but {next_raw} inputs take their data "
                         "from them (those without contents or shared memory)")
    check_unique_names(tuple(inputs))
    options = request_options(parameter_values(message.parameters))
    outputs = tuple(requested_output(o.name, parameter_values(o.parameters)) for o in message.outputs)
    return InferRequest(id=message.id or None, inputs=tuple(inputs), outputs=outputs or None, binary_output=True,
                        timeout_ms=options.timeout_ms, priority=options.priority)


def _decode_input(spec: Any, raw: Sequence[bytes], next_raw: int, max_items: int | None,
                  regions: ClientRegions | None) -> tuple[Tensor, int]:
    """One input, and how many raw_input_contents entries it took (0 or 1)."""
    name = brief(spec.name, 64)
    datatype = checked_datatype(spec.datatype, name)
    shape = checked_shape(spec.shape, name, max_items)
    has_contents = spec.HasField("contents") and bool(spec.contents.ListFields())
    region = region_slice(parameter_values(spec.parameters), f"input {name}")
    if region is not None:
        if has_contents:
            raise InputError(f"input {name} is in shared memory; it cannot have contents too")
        if regions is None:
            raise InputError(f"input {name}: shared memory is not supported here; send the data in the request")
        return tensor_from_binary(spec.name, datatype, shape, regions.read(region, f"input {name}")), 0
    if has_contents:
        return _from_contents(spec, name, datatype, shape), 0
    if next_raw >= len(raw):
        raise InputError(f"input {name} has no data: no contents, no shared memory region, and no raw_input_contents "
                         f"entry left ({len(raw)} for {next_raw + 1} inputs)")
    return tensor_from_binary(spec.name, datatype, shape, raw[next_raw]), 1


def _from_contents(spec: Any, name: str, datatype: str, shape: tuple[int, ...]) -> Tensor:
    """An input from its typed contents: the one field its datatype names, checked for kind and range."""
    if datatype not in CONTENTS:
        raise InputError(f"input {name}: {datatype} has no typed contents field; send it in raw_input_contents")
    field, dtype = CONTENTS[datatype]
    present = [descriptor.name for descriptor, _ in spec.contents.ListFields()]
    if present != [field]:
        raise InputError(f"input {name}: a {datatype} tensor's data goes in contents.{field}, got {', '.join(present)}")
    values = getattr(spec.contents, field)
    if dtype is None:
        return tensor_from_elements(spec.name, shape, list(values))
    return tensor_from_values(spec.name, datatype, shape, np.fromiter(values, dtype=np.dtype(dtype), count=len(values)))


def encode_response(model: str, request: InferRequest, outputs: Sequence[RequestedOutput], answers: Sequence[Any],
                    regions: ClientRegions | None = None, *, version: str = MODEL_VERSION) -> Any:
    """The `ModelInferResponse`: each output a `BYTES` tensor of the answers' JSON, in
    raw_output_contents, or written to its shared memory region (then with no contents)."""
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request.id or "")
    blob = serialize_bytes(answer_elements(answers))
    for output in outputs:
        tensor = response.outputs.add(name=output.name, datatype="BYTES", shape=[len(answers)])
        if output.region is None:
            response.raw_output_contents.append(blob)
            continue
        where = f"output {brief(output.name, 64)}"
        if regions is None:
            raise InputError(f"{where}: shared memory is not supported here")
        regions.write(output.region, blob, where)
        tensor.parameters["shared_memory_region"].string_param = output.region.region
        tensor.parameters["shared_memory_byte_size"].int64_param = len(blob)
        if output.region.offset:
            tensor.parameters["shared_memory_offset"].int64_param = output.region.offset
    return response
