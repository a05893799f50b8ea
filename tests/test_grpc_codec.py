"""The gRPC codec as pure functions: requests built by tritonclient.grpc itself (the reference for the
wire format) decode to the same tensors as the HTTP codec decodes tritonclient.http's bodies; typed
contents, raw contents and their errors; responses tritonclient reads; the error table's gRPC codes."""

from __future__ import annotations

import json
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tritonclient.grpc import service_pb2
from tritonclient.grpc._utils import _get_inference_request

from router.errors import (
    Conflict,
    DeadlineExceeded,
    ExecutionTimeout,
    Forbidden,
    InputError,
    ModelNotFound,
    PayloadTooLarge,
    QueueFull,
    ShuttingDown,
    Unauthorized,
    Unimplemented,
    grpc_status,
)
from router.grpc.calls import Call, peer_host, refusal_of
from router.grpc.codec import decode_request, encode_response, parameter_values
from router.grpc.protos import grpc_service_pb2 as pb
from router.http.kserve import codec as http_codec
from router.inference_protocol.request import RequestedOutput
from router.inference_protocol.submission import ItemFailed


def request_of(inputs: list[Any], **options: Any) -> Any:
    """A ModelInferRequest exactly as tritonclient.grpc sends it, parsed by our module."""
    fields = {"model_version": "", "request_id": "", "outputs": None, "sequence_id": 0, "sequence_start": False,
              "sequence_end": False, "priority": 0, "timeout": None, "parameters": None, **options}
    built = _get_inference_request("m", inputs, **fields)
    return pb.ModelInferRequest.FromString(built.SerializeToString())


def grpc_input(name: str, array: np.ndarray[Any, Any], datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def bad(message: Any, **options: Any) -> str:
    with pytest.raises(InputError) as caught:
        decode_request(message, **options)
    return caught.value.detail


@pytest.mark.parametrize("datatype", ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
                                      "FP16", "FP32", "FP64", "BYTES"])
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_tritonclient_tensors_decode_as_over_http(datatype: str, data: st.DataObject) -> None:
    """The same array through tritonclient.grpc and tritonclient.http decodes to the same tensor."""
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4))
    if datatype == "BYTES":
        array = np.array(data.draw(st.lists(st.binary(max_size=8), min_size=int(np.prod(shape)),
                                            max_size=int(np.prod(shape)))), dtype=np.object_).reshape(shape)
    else:
        dtype = np.dtype(grpcclient.triton_to_np_dtype(datatype))
        elements = hnp.from_dtype(dtype, allow_nan=False, allow_infinity=False) if dtype.kind == "f" else None
        array = data.draw(hnp.arrays(dtype, shape, elements=elements))
    [over_grpc] = decode_request(request_of([grpc_input("t", array, datatype)])).inputs
    tensor = httpclient.InferInput("t", list(shape), datatype)
    tensor.set_data_from_numpy(array)
    body, length = httpclient.InferenceServerClient.generate_request_body([tensor])
    [over_http] = http_codec.decode_request(body, str(length)).inputs
    assert over_grpc.datatype == over_http.datatype == datatype and over_grpc.shape == over_http.shape == array.shape
    np.testing.assert_array_equal(over_grpc.data, over_http.data)


def test_id_priority_timeout_and_outputs_from_tritonclient() -> None:
    request = decode_request(request_of([grpc_input("IMAGE", np.array([b"x"], dtype=np.object_), "BYTES")],
                                        request_id="frame-3", priority=2, timeout=1_500_000,
                                        outputs=[grpcclient.InferRequestedOutput("OUTPUT")]))
    assert (request.id, request.priority, request.timeout_ms) == ("frame-3", 2, 1500.0)
    assert request.outputs == (RequestedOutput("OUTPUT", binary=False),)
    sequenced = request_of([grpc_input("x", np.zeros(1, np.float32), "FP32")], sequence_id=4)
    assert bad(sequenced) == "parameter 'sequence_id': sequence batching is not supported"


def typed(name: str, datatype: str, shape: list[int], **contents: Any) -> Any:
    return pb.ModelInferRequest(model_name="m", inputs=[pb.ModelInferRequest.InferInputTensor(
        name=name, datatype=datatype, shape=shape, contents=pb.InferTensorContents(**contents))])


def test_typed_contents_are_read_from_the_field_their_datatype_names() -> None:
    request = decode_request(typed("x", "UINT8", [2, 2], uint_contents=[0, 1, 254, 255]))
    assert request.inputs[0].data.dtype == np.uint8 and request.inputs[0].data.tolist() == [[0, 1], [254, 255]]
    [flags] = decode_request(typed("b", "BOOL", [2], bool_contents=[True, False])).inputs
    assert flags.data.tolist() == [True, False]
    [texts] = decode_request(typed("JSON", "BYTES", [2], bytes_contents=[b"{}", b"[]"])).inputs
    assert texts.data.tolist() == [b"{}", b"[]"]


@pytest.mark.parametrize(("message", "words"), [
    (typed("x", "UINT8", [2], uint_contents=[1, 300]), "input 'x': 300 is out of range for UINT8 (0..255)"),
    (typed("x", "FP32", [3], fp32_contents=[1, 2]), "input 'x': shape [3] needs 3 elements, the data has 2"),
    (typed("x", "FP32", [1], int_contents=[1]), "input 'x': a FP32 tensor's data goes in contents.fp32_contents, got int_contents"),
    (typed("x", "FP16", [1], fp32_contents=[1]), "input 'x': FP16 has no typed contents field; send it in raw_input_contents"),
    (typed("x", "FLOAT", [1], fp32_contents=[1]), "input 'x': datatype must be one of BOOL"),
    (typed("x", "FP32", [1] * 65, fp32_contents=[1]), "input 'x': shape has 65 dimensions; at most 64 are accepted"),
    (typed("x", "FP32", [-1], fp32_contents=[1]), "input 'x': shape must be a non-empty list of non-negative integers"),
    (typed("x", "FP32", [2**62, 2**62], fp32_contents=[1]), "input 'x': shape [4611686018427387904, 4611686018427387904] has more"),
    (pb.ModelInferRequest(model_name="m"), "the request needs 'inputs': a non-empty list of tensors"),
    (pb.ModelInferRequest(inputs=[pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[1])]),
     "input 'x' has no data: no contents, no shared memory region, and no raw_input_contents entry left (0 for 1 inputs)"),
    (pb.ModelInferRequest(inputs=[pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[1])],
                          raw_input_contents=[b"\0" * 4, b"\0" * 4]),
     "the request has 2 raw_input_contents entries, but 1 inputs take their data from them"),
    (pb.ModelInferRequest(inputs=[pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[2])],
                          raw_input_contents=[b"\0" * 4]),
     "input 'x': shape [2] of FP32 needs 8 bytes, the binary data has 4"),
    (pb.ModelInferRequest(inputs=[pb.ModelInferRequest.InferInputTensor(name="x", datatype="BYTES", shape=[1])],
                          raw_input_contents=[b"\x09\0\0\0ab"]),
     "input 'x': truncated BYTES data: an element of 9 bytes runs past the end"),
])
def test_bad_tensors_are_clear_invalid_arguments(message: Any, words: str) -> None:
    assert bad(message).startswith(words)


def test_item_counts_are_refused_from_the_shape_before_the_data() -> None:
    message = pb.ModelInferRequest(inputs=[pb.ModelInferRequest.InferInputTensor(name="x", datatype="BYTES",
                                                                                 shape=[100_000])])
    with pytest.raises(PayloadTooLarge, match="input 'x' has 100000 items .* may carry at most 64"):
        decode_request(message, max_items=64)


def test_shared_memory_needs_a_registry_and_excludes_contents() -> None:
    tensor = grpcclient.InferInput("x", [1], "FP32")
    tensor.set_shared_memory("region", 4)
    assert bad(request_of([tensor])) == "input 'x': shared memory is not supported here; send the data in the request"
    message = request_of([tensor])
    message.inputs[0].contents.fp32_contents.append(1.0)
    assert bad(message) == "input 'x' is in shared memory; it cannot have contents too"


def test_parameters_become_plain_values() -> None:
    message = pb.ModelInferRequest()
    message.parameters["a"].bool_param = True
    message.parameters["b"].int64_param = -3
    message.parameters["c"].string_param = "s"
    message.parameters["d"].double_param = 0.5
    message.parameters["e"].uint64_param = 2**64 - 1
    message.parameters["f"].CopyFrom(pb.InferParameter())
    assert parameter_values(message.parameters) == {"a": True, "b": -3, "c": "s", "d": 0.5, "e": 2**64 - 1, "f": None}


def test_the_response_is_what_tritonclient_reads() -> None:
    answers = [{"top_k": [{"label": "é", "score": 0.5}]}, {"top_k": []}]
    request = decode_request(request_of([grpc_input("IMAGE", np.array([b"a", b"b"], dtype=np.object_), "BYTES")],
                                        request_id="r-1"))
    ours = encode_response("cls", request, [RequestedOutput("OUTPUT", binary=False)], answers)
    result = grpcclient.InferResult(service_pb2.ModelInferResponse.FromString(ours.SerializeToString()))
    assert [json.loads(element) for element in result.as_numpy("OUTPUT")] == answers
    assert (result.get_response().id, result.get_response().model_version) == ("r-1", "1")
    http_body, length = http_codec.encode_response("cls", request, [RequestedOutput("OUTPUT", binary=True)], answers)
    assert http_body[length:] == ours.raw_output_contents[0]  # the same bytes over both protocols


# -- errors and calls --------------------------------------------------------------------------------------------


def test_errors_map_to_grpc_codes_from_the_one_table() -> None:
    assert grpc_status(InputError("bad")) == ("INVALID_ARGUMENT", {})
    assert grpc_status(PayloadTooLarge("big")) == ("RESOURCE_EXHAUSTED", {})
    assert grpc_status(ModelNotFound("no")) == ("NOT_FOUND", {})
    assert grpc_status(Unauthorized("key")) == ("UNAUTHENTICATED", {})
    assert grpc_status(Forbidden("admin")) == ("PERMISSION_DENIED", {})
    assert grpc_status(DeadlineExceeded("late")) == ("DEADLINE_EXCEEDED", {})  # not V2's 503 over HTTP
    assert grpc_status(ExecutionTimeout("overran")) == ("DEADLINE_EXCEEDED", {})
    assert grpc_status(Unimplemented("cuda")) == ("UNIMPLEMENTED", {})
    assert grpc_status(QueueFull("full", retry_after_s=2.5)) == (
        "UNAVAILABLE", {"retry-after": "3", "grpc-retry-pushback-ms": "2500"})
    assert grpc_status(ShuttingDown("bye")) == ("UNAVAILABLE", {"retry-after": "1", "grpc-retry-pushback-ms": "1000"})
    # A change refused because a pipeline depends on it: not retryable until that is changed.
    assert grpc_status(Conflict("model 'm' is used by pipeline(s) p")) == ("FAILED_PRECONDITION", {})


def test_a_failed_item_is_named_and_keeps_its_code() -> None:
    refusal = refusal_of(ItemFailed(1, 3, QueueFull("queue of model 'm' is full", retry_after_s=1.0)))
    assert refusal is not None and refusal.code is grpc.StatusCode.UNAVAILABLE
    assert refusal.details == "item 1 of 3: queue of model 'm' is full" and dict(refusal.trailing)["retry-after"] == "1"
    assert refusal_of(RuntimeError("bug")) is None


def test_peers_and_deadlines() -> None:
    assert [peer_host(p) for p in ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/tmp/s", None)] == [
        "127.0.0.1", "::1", None, None]
    call = Call("ModelInfer", "rid", 0.0, 300.0, "127.0.0.1", {"x-priority": "2"})
    assert (call.timeout_ms(None), call.timeout_ms(100.0), call.timeout_ms(5000.0)) == (300.0, 100.0, 300.0)
    assert call.priority == 2
    assert Call("ModelInfer", "rid", 0.0, None, None, {}).timeout_ms(50.0) == 50.0
    with pytest.raises(InputError, match="metadata x-priority must be an integer, got 'high'"):
        _ = Call("ModelInfer", "rid", 0.0, None, None, {"x-priority": "high"}).priority
