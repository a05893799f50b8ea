"""The V2 codec as pure functions: request bodies built by tritonclient itself (the reference for
the wire format), hand-built bad bodies, per-item payloads, outputs and the error mapping."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from litestar.exceptions import HTTPException

from router.errors import (
    DeadlineExceeded,
    ExecutionTimeout,
    InputError,
    ModelNotFound,
    PayloadTooLarge,
    QueueFull,
    UnsupportedMediaType,
)
from router.http.kserve.codec import decode_request, encode_error, encode_response
from router.inference_protocol.payloads import InputKind, Signature, select_outputs, signature, to_payloads
from router.inference_protocol.request import InferRequest, RequestedOutput, router_priority
from router.inference_protocol.submission import ItemFailed
from router.inference_protocol.tensors import Tensor, serialize_bytes
from router.sdk.images import decode_image

IMAGE = signature(("image/jpeg", "image/png", "application/octet-stream"))
JSON_MODEL = signature(("application/json",))


def triton_body(inputs: list[httpclient.InferInput], **kwargs: Any) -> tuple[bytes, str | None]:
    """A request body exactly as tritonclient sends it, and its Inference-Header-Content-Length."""
    body, json_size = httpclient.InferenceServerClient.generate_request_body(inputs, **kwargs)
    return body, None if json_size is None else str(json_size)


def tensor_input(name: str, array: np.ndarray[Any, Any], datatype: str, *, binary: bool) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def json_request(inputs: list[dict[str, Any]], **fields: Any) -> bytes:
    return json.dumps({"inputs": inputs, **fields}).encode()


def bad(body: bytes, header_length: str | None = None) -> str:
    with pytest.raises(InputError) as caught:
        decode_request(body, header_length)
    assert caught.value.status_code == 400
    return caught.value.detail


# -- JSON tensors -----------------------------------------------------------------------------------


def test_json_tensors_flat_or_nested_with_their_datatypes() -> None:
    request = decode_request(json_request([
        {"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2.5], [3, 4]]},
        {"name": "n", "datatype": "INT64", "shape": [2], "data": [-7, 2**40]},
        {"name": "b", "datatype": "BOOL", "shape": [2, 1], "data": [True, False]},
        {"name": "s", "datatype": "BYTES", "shape": [2], "data": ["héllo", ""]},
        {"name": "u", "datatype": "UINT64", "shape": [2], "data": [2**64 - 1, 0]},
    ]))
    x, n, b, s, u = request.inputs
    assert u.data.dtype == np.uint64 and u.data.tolist() == [2**64 - 1, 0]  # exact, though numpy reads it as floats
    assert x.data.dtype == np.float32 and x.data.tolist() == [[1.0, 2.5], [3.0, 4.0]]
    assert n.data.dtype == np.int64 and n.data.tolist() == [-7, 2**40]
    assert b.data.dtype == np.bool_ and b.shape == (2, 1) and b.data.tolist() == [[True], [False]]
    assert s.data.tolist() == ["héllo".encode(), b""]
    assert request.id is None and request.outputs is None and request.timeout_ms is None and request.priority is None


@pytest.mark.parametrize(("tensor", "message"), [
    ({"name": "x", "datatype": "FLOAT", "shape": [1], "data": [1]},
     ("input 'x': datatype must be one of BOOL, UINT8, UINT16, UINT32, UINT64, INT8, INT16, INT32, INT64, "
      "FP16, FP32, FP64, BF16, BYTES, got 'FLOAT'")),
    ({"name": "x", "datatype": "FP32", "shape": [-1, 2], "data": [1, 2]},
     "input 'x': shape must be a non-empty list of non-negative integers, got [-1, 2]"),
    ({"name": "x", "datatype": "FP32", "shape": [], "data": []},
     "input 'x': shape must be a non-empty list of non-negative integers, got []"),
    ({"name": "x", "datatype": "FP32", "shape": [2, 3], "data": [1, 2, 3, 4]},
     "input 'x': shape [2, 3] needs 6 elements, 'data' has 4"),
    ({"name": "x", "datatype": "FP32", "shape": [2], "data": [[1, 2], [3]]},
     "input 'x': 'data' must be a flat or evenly nested list of numbers"),
    ({"name": "x", "datatype": "FP32", "shape": [2], "data": [1, "two"]}, "input 'x': FP32 data must be numbers"),
    ({"name": "x", "datatype": "INT32", "shape": [2], "data": [1, 2.5]}, "input 'x': INT32 data must be integers"),
    ({"name": "x", "datatype": "INT32", "shape": [1], "data": [{"a": 1}]}, "input 'x': INT32 data must be integers"),
    ({"name": "x", "datatype": "UINT8", "shape": [2], "data": [1, 300]}, "input 'x': 300 is out of range for UINT8 (0..255)"),
    ({"name": "x", "datatype": "INT8", "shape": [1], "data": [-129]}, "input 'x': -129 is out of range for INT8 (-128..127)"),
    ({"name": "x", "datatype": "BOOL", "shape": [2], "data": [1, 0]}, "input 'x': BOOL data must be true or false"),
    ({"name": "x", "datatype": "BYTES", "shape": [1], "data": [3]}, "input 'x': BYTES elements must be strings, got 3"),
    ({"name": "x", "datatype": "BYTES", "shape": [2], "data": ["a"]}, "input 'x': shape [2] needs 2 elements, 'data' has 1"),
    ({"name": "x", "datatype": "FP32", "shape": [1]}, "input 'x' has no 'data' and no binary_data_size parameter"),
    ({"datatype": "FP32", "shape": [1], "data": [1]}, "inputs[0] must be an object with a string 'name'"),
    ({"name": "x", "datatype": "FP32", "shape": [1], "parameters": {"shared_memory_region": "r"}},
     "input 'x': parameter shared_memory_byte_size must be a non-negative integer, got None"),
    ({"name": "x", "datatype": "FP32", "shape": [1], "parameters": {"shared_memory_byte_size": 4}},
     "input 'x': shared_memory_byte_size needs shared_memory_region"),
    ({"name": "x", "datatype": "FP32", "shape": [1], "data": [1],
      "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4}},
     "input 'x' is in shared memory; it cannot have 'data' or binary_data_size too"),
    ({"name": "x", "datatype": "FP32", "shape": [1], "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4}},
     "input 'x': shared memory is not supported here; send the data in the request"),
])
def test_bad_json_tensors_are_clear_400s(tensor: dict[str, Any], message: str) -> None:
    assert bad(json_request([tensor])).startswith(message)


@pytest.mark.parametrize(("body", "message"), [
    (b"{not json", "the body must be the JSON inference request"),
    (b"[1, 2]", "the inference request must be a JSON object, got list"),
    (b"{}", "the request needs 'inputs': a non-empty list of tensors"),
    (json_request([{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}] * 2), "input names must be unique"),
    (json_request([{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}], id=7), "'id' must be a string, got 7"),
])
def test_bad_request_documents_are_clear_400s(body: bytes, message: str) -> None:
    assert bad(body).startswith(message)


def test_base64_bytes_in_json_mode() -> None:
    tensor = {"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["/9j/AA=="],
              "parameters": {"content_type": "base64"}}
    assert decode_request(json_request([tensor])).inputs[0].data.tolist() == [b"\xff\xd8\xff\x00"]
    tensor["data"] = ["not base64!"]
    assert "content_type base64, but an element is not base64" in bad(json_request([tensor]))


# -- the binary tensor data extension ----------------------------------------------------------------


@pytest.mark.parametrize("datatype", ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
                                      "FP16", "FP32", "FP64"])
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_tritonclient_tensors_decode_to_the_same_array_in_binary_and_json(datatype: str, data: st.DataObject) -> None:
    dtype = np.dtype(httpclient.triton_to_np_dtype(datatype))
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4))
    elements = hnp.from_dtype(dtype, allow_nan=False, allow_infinity=False) if dtype.kind == "f" else None
    array = data.draw(hnp.arrays(dtype, shape, elements=elements))
    for binary in (True, False):
        body, header_length = triton_body([tensor_input("t", array, datatype, binary=binary)])
        assert (header_length is not None) == binary
        tensor = decode_request(body, header_length).inputs[0]
        assert tensor.datatype == datatype and tensor.shape == array.shape
        np.testing.assert_array_equal(tensor.data, array)


def test_binary_bytes_and_json_inputs_mixed_in_one_request() -> None:
    images = np.array([b"\x00\x01jpeg", b"png\xff"], dtype=np.object_)
    numbers = np.arange(4, dtype=np.int32).reshape(2, 2)
    body, header_length = triton_body([tensor_input("IMAGE", images, "BYTES", binary=True),
                                       tensor_input("n", numbers, "INT32", binary=False),
                                       tensor_input("f", numbers.astype(np.float32), "FP32", binary=True)])
    assert header_length is not None and int(header_length) < len(body)
    image, n, f = decode_request(body, header_length).inputs
    assert image.data.tolist() == [b"\x00\x01jpeg", b"png\xff"]
    assert n.data.tolist() == f.data.tolist() == [[0, 1], [2, 3]]


def test_bf16_binary_data_becomes_float32() -> None:
    values = np.array([1.5, -2.0, 0.0], dtype=np.float32)
    raw = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    header = json.dumps({"inputs": [{"name": "x", "datatype": "BF16", "shape": [3],
                                     "parameters": {"binary_data_size": len(raw)}}]}).encode()
    tensor = decode_request(header + raw, str(len(header))).inputs[0]
    assert tensor.data.dtype == np.float32 and tensor.data.tolist() == [1.5, -2.0, 0.0]


def binary_body(size: int, payload: bytes, *, datatype: str = "FP32", shape: list[int] | None = None) -> tuple[bytes, str]:
    header = json.dumps({"inputs": [{"name": "x", "datatype": datatype, "shape": shape or [2],
                                     "parameters": {"binary_data_size": size}}]}).encode()
    return header + payload, str(len(header))


@pytest.mark.parametrize(("case", "message"), [
    (binary_body(8, b"\0" * 8)[0:1] + ("abc",), "Inference-Header-Content-Length must be a number of bytes in decimal digits, got 'abc'"),
    (binary_body(8, b"\0" * 8)[0:1] + ("0",), "Inference-Header-Content-Length is 0, but the body has"),
    (binary_body(8, b"\0" * 8)[0:1] + ("100000",), "Inference-Header-Content-Length is 100000, but the body has"),
    (binary_body(8, b"\0" * 8)[0:1] + ("5",), "the first 5 bytes (Inference-Header-Content-Length) must be the JSON"),
    (binary_body(12, b"\0" * 8), "input 'x': binary_data_size 12 runs past the end of the body (8 bytes of binary data left)"),
    (binary_body(4, b"\0" * 4), "input 'x': shape [2] of FP32 needs 8 bytes, the binary data has 4"),
    (binary_body(8, b"\0" * 12), "4 bytes of binary data follow the inputs' binary_data_size total of 8"),
    (binary_body(-1, b""), "input 'x': binary_data_size must be a non-negative integer, got -1"),
    (binary_body(6, struct.pack("<I", 9) + b"ab", datatype="BYTES", shape=[1]),
     "input 'x': truncated BYTES data: an element of 9 bytes runs past the end"),
    (binary_body(6, serialize_bytes([b"a"]) + b"\0", datatype="BYTES", shape=[1]),
     "input 'x': truncated BYTES data: a length prefix is cut off at byte 5"),
    (binary_body(10, serialize_bytes([b"a", b"b"]), datatype="BYTES", shape=[3]),
     "input 'x': shape [3] needs 3 elements, the binary data has 2"),
])
def test_bad_binary_requests_are_clear_400s(case: tuple[bytes, str], message: str) -> None:
    assert bad(*case).startswith(message)


def test_data_and_binary_data_size_together_are_refused() -> None:
    header = json.dumps({"inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [1],
                                     "parameters": {"binary_data_size": 1}}]}).encode()
    assert bad(header + b"\x01", str(len(header))) == "input 'x' has both 'data' and binary_data_size; send one"


# -- parameters: id, outputs, timeout, priority ------------------------------------------------------------


def test_id_timeout_priority_and_requested_outputs_from_tritonclient() -> None:
    tensor = tensor_input("IMAGE", np.array([b"x"], dtype=np.object_), "BYTES", binary=True)
    outputs = [httpclient.InferRequestedOutput("OUTPUT", binary_data=False)]
    body, header_length = triton_body([tensor], outputs=outputs, request_id="req-7", priority=2, timeout=1_500_000)
    request = decode_request(body, header_length)
    assert request.id == "req-7" and request.priority == 2 and request.timeout_ms == 1500.0
    assert request.outputs == (RequestedOutput("OUTPUT", binary=False),)
    assert select_outputs(request, IMAGE) == (RequestedOutput("OUTPUT", binary=False),)


def test_without_requested_outputs_tritonclient_asks_for_all_of_them_in_binary() -> None:
    tensor = tensor_input("IMAGE", np.array([b"x"], dtype=np.object_), "BYTES", binary=True)
    request = decode_request(*triton_body([tensor]))
    assert request.outputs is None and request.binary_output is True
    assert select_outputs(request, IMAGE) == (RequestedOutput("OUTPUT", binary=True),)


@pytest.mark.parametrize(("parameters", "outputs", "message"), [
    ({"timeout": -1}, None, "parameter 'timeout' must be a non-negative integer of microseconds, got -1"),
    ({"timeout": 1.5}, None, "parameter 'timeout' must be a non-negative integer of microseconds, got 1.5"),
    ({"priority": "high"}, None, "parameter 'priority' must be a non-negative integer, got 'high'"),
    ({"binary_data_output": "yes"}, None, "the request: parameter 'binary_data_output' must be true or false, got 'yes'"),
    ({"sequence_id": 4}, None, "parameter 'sequence_id': sequence batching is not supported"),
    ({}, [{"name": "OUTPUT", "parameters": {"classification": 3}}], "output 'OUTPUT': classification is not supported"),
    ({}, [{"name": "OUTPUT", "parameters": {"binary_data": 1}}], "output 'OUTPUT': parameter 'binary_data' must be true"),
    ({}, "OUTPUT", "'outputs' must be a list"),
])
def test_bad_parameters_are_clear_400s(parameters: dict[str, Any], outputs: Any, message: str) -> None:
    fields: dict[str, Any] = {"parameters": parameters}
    if outputs is not None:
        fields["outputs"] = outputs
    assert bad(json_request([{"name": "x", "datatype": "UINT8", "shape": [1], "data": [1]}], **fields)).startswith(message)


def test_timeout_zero_means_the_models_own_deadline() -> None:
    tensor = {"name": "x", "datatype": "UINT8", "shape": [1], "data": [1]}
    assert decode_request(json_request([tensor], parameters={"timeout": 0})).timeout_ms is None
    assert decode_request(json_request([tensor], parameters={"timeout": 250})).timeout_ms == 0.25


def test_unknown_output_names_the_available_ones() -> None:
    request = decode_request(json_request([{"name": "x", "datatype": "UINT8", "shape": [1], "data": [1]}],
                                          outputs=[{"name": "SCORES"}]))
    with pytest.raises(InputError, match="unknown output 'SCORES'; outputs: OUTPUT"):
        select_outputs(request, IMAGE)


def test_triton_priority_1_is_the_routers_highest_level() -> None:
    assert [router_priority(p, 3) for p in (None, 1, 2, 3)] == [None, 3, 2, 1]
    with pytest.raises(InputError, match=r"must be 0 \(the default\) or 1..3 \(1 is the highest\), got 4"):
        router_priority(4, 3)


# -- model signatures and per-item payloads ----------------------------------------------------------------


def test_signatures_follow_the_media_types_a_plugin_accepts() -> None:
    assert signature(("image/*",)).kind is InputKind.IMAGE
    assert signature(("application/json", "application/octet-stream")).kind is InputKind.JSON
    assert signature(("text/plain",)) == Signature(InputKind.RAW, "text/plain")
    assert IMAGE.metadata() == {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [-1]}],
                                "outputs": [{"name": "OUTPUT", "datatype": "BYTES", "shape": [-1]}]}


def request_of(*tensors: dict[str, Any]) -> InferRequest:
    return decode_request(json_request(list(tensors)))


def test_encoded_images_become_one_payload_each_in_order() -> None:
    for shape in ([2], [2, 1]):
        payloads = to_payloads(request_of({"name": "IMAGE", "datatype": "BYTES", "shape": shape, "data": ["a", "b"]}),
                               "det", IMAGE)
        assert [(p.body, p.media_type) for p in payloads] == [(b"a", "application/octet-stream"),
                                                              (b"b", "application/octet-stream")]


def test_uint8_pixels_become_lossless_images_the_decoder_reads_back() -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (2, 5, 7, 3), dtype=np.uint8)
    body, header_length = triton_body([tensor_input("IMAGE", pixels, "UINT8", binary=True)])
    payloads = to_payloads(decode_request(body, header_length), "det", IMAGE)
    assert len(payloads) == 2
    for payload, expected in zip(payloads, pixels, strict=True):
        np.testing.assert_array_equal(decode_image(payload), expected)


@pytest.mark.parametrize(("tensors", "message"), [
    ([{"name": "IMAGE", "datatype": "FP32", "shape": [1, 2, 2, 3], "data": [0] * 12}],
     "input 'IMAGE' of model 'det' must be BYTES [N] or UINT8 [N,H,W,3], got FP32 [1, 2, 2, 3]"),
    ([{"name": "IMAGE", "datatype": "UINT8", "shape": [1, 2, 2], "data": [0] * 4}],
     "input 'IMAGE' of model 'det' must be BYTES [N] or UINT8 [N,H,W,3], got UINT8 [1, 2, 2]"),
    ([{"name": "IMAGE", "datatype": "UINT8", "shape": [1, 0, 2, 3], "data": []}], "an image of shape [0, 2, 3] has no pixels"),
    ([{"name": "INPUT", "datatype": "BYTES", "shape": [1], "data": ["a"]}],
     "model 'det' takes one input named 'IMAGE', got ['INPUT']"),
    ([{"name": "IMAGE", "datatype": "BYTES", "shape": [0], "data": []}], "the batch is empty"),
    ([{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["a"]},
      {"name": "other", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]}],
     "every input must have the same batch size (first dimension); got IMAGE [1], other [2]"),
])
def test_bad_image_inputs_are_clear_400s(tensors: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(InputError) as caught:
        to_payloads(request_of(*tensors), "det", IMAGE)
    assert caught.value.detail.startswith(message)


def test_pixel_tensors_over_the_image_bound_are_refused_before_re_encoding() -> None:
    """[1, 10000, 5000, 3] is 50 megapixels: 413 from the shape, no BMP of 150 MB is written."""
    shape = (1, 10_000, 5_000, 3)
    pixels = np.broadcast_to(np.zeros(1, dtype=np.uint8), shape)  # no memory behind it
    request = InferRequest(None, (Tensor("IMAGE", "UINT8", shape, pixels),), None, False, None, None)
    with pytest.raises(PayloadTooLarge, match="images of 5000x10000 pixels are over the limit of 40000000 pixels"):
        to_payloads(request, "det", IMAGE)


@pytest.mark.parametrize(("shape", "message"), [
    ([1] * 65, "input 'x': shape has 65 dimensions; at most 64 are accepted"),
    ([2**62, 2**62], "input 'x': shape [4611686018427387904, 4611686018427387904] has more than 2**63 - 1 elements"),
    ([2**64], "input 'x': shape must be a non-empty list of non-negative integers, got [18446744073709551616]"),
])
def test_shapes_are_bounded(shape: list[int], message: str) -> None:
    assert bad(json_request([{"name": "x", "datatype": "BYTES", "shape": shape, "data": [""]}])) == message


def test_item_counts_are_refused_from_the_shape_before_the_data() -> None:
    body = json_request([{"name": "x", "datatype": "BYTES", "shape": [100_000], "data": "never looked at"}])
    with pytest.raises(PayloadTooLarge, match="input 'x' has 100000 items .* may carry at most 64"):
        decode_request(body, max_items=64)


def test_client_values_are_echoed_briefly() -> None:
    name = "n" * 10_000
    assert len(bad(json_request([{"name": name, "datatype": "NOPE", "shape": [1], "data": [""]}]))) < 250
    assert len(bad(json_request([{"name": "x", "datatype": name, "shape": [1], "data": [""]}]))) < 300
    assert len(bad(json_request([{"name": "x", "datatype": "BYTES", "shape": [1], "data": [{"a": "b" * 10_000}]}]))) < 200


def test_named_tensors_of_a_json_model_become_one_object_per_item() -> None:
    request = request_of({"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3, 4]},
                         {"name": "tag", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]})
    payloads = to_payloads(request, "toy", JSON_MODEL)
    assert [json.loads(p.body) for p in payloads] == [{"x": [1.0, 2.0], "tag": "a"}, {"x": [3.0, 4.0], "tag": "b"}]
    assert {p.media_type for p in payloads} == {"application/json"}


def test_whole_json_documents_pass_through_and_may_not_be_mixed() -> None:
    documents = request_of({"name": "JSON", "datatype": "BYTES", "shape": [2], "data": ['{"id": "a"}', '{"id": "b"}']})
    assert [p.body for p in to_payloads(documents, "echo", JSON_MODEL)] == [b'{"id": "a"}', b'{"id": "b"}']
    mixed = request_of({"name": "JSON", "datatype": "BYTES", "shape": [1], "data": ["{}"]},
                       {"name": "x", "datatype": "FP32", "shape": [1], "data": [1]})
    with pytest.raises(InputError, match="input 'JSON' holds whole JSON documents; send it alone"):
        to_payloads(mixed, "echo", JSON_MODEL)


def test_raw_models_get_bytes_with_their_media_type() -> None:
    request = request_of({"name": "INPUT", "datatype": "BYTES", "shape": [1], "data": ["hello"]})
    [payload] = to_payloads(request, "text", signature(("text/plain",)))
    assert (payload.body, payload.media_type) == (b"hello", "text/plain")


# -- responses ---------------------------------------------------------------------------------------------


ANSWERS = [{"top_k": [{"class_id": 3, "label": "é", "score": 0.5}]}, {"top_k": []}]


def test_json_response_echoes_the_id_and_holds_each_answer_as_json_text() -> None:
    request = request_of({"name": "IMAGE", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]})
    request = InferRequest("req-9", request.inputs, None, False, None, None)
    body, header_length = encode_response("cls", request, [RequestedOutput("OUTPUT", binary=False)], ANSWERS)
    assert header_length is None
    document = json.loads(body)
    assert {k: document[k] for k in ("model_name", "model_version", "id")} == {"model_name": "cls", "model_version": "1",
                                                                             "id": "req-9"}
    [output] = document["outputs"]
    assert output["name"] == "OUTPUT" and output["datatype"] == "BYTES" and output["shape"] == [2]
    assert [json.loads(text) for text in output["data"]] == ANSWERS


def test_binary_response_is_what_tritonclient_reads() -> None:
    request = request_of({"name": "IMAGE", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]})
    body, header_length = encode_response("cls", request, [RequestedOutput("OUTPUT", binary=True)], ANSWERS)
    assert header_length is not None and json.loads(body[:header_length])["outputs"][0]["parameters"]["binary_data_size"] > 0
    assert "id" not in json.loads(body[:header_length])
    result = httpclient.InferenceServerClient.parse_response_body(body, header_length=header_length)
    assert [json.loads(element) for element in result.as_numpy("OUTPUT")] == ANSWERS


# -- errors ------------------------------------------------------------------------------------------------


def test_errors_map_to_v2_bodies_and_statuses() -> None:
    assert encode_error(InputError("bad")) == (400, {"error": "bad"}, {})
    assert encode_error(UnsupportedMediaType("gif")) == (415, {"error": "gif"}, {})
    assert encode_error(ModelNotFound("no model")) == (404, {"error": "no model"}, {})
    assert encode_error(QueueFull("full", retry_after_s=2.5)) == (503, {"error": "full"}, {"Retry-After": "3"})
    assert encode_error(DeadlineExceeded("late")) == (503, {"error": "late"}, {"Retry-After": "1"})
    assert encode_error(ExecutionTimeout("overran")) == (504, {"error": "overran"}, {})
    assert encode_error(HTTPException(status_code=413, detail="too big")) == (413, {"error": "too big"}, {})
    assert encode_error(RuntimeError("bug")) is None


def test_a_failed_item_is_named_without_changing_the_error_its_batch_shares() -> None:
    shared = QueueFull("queue of model 'm' is full", retry_after_s=2.0)
    assert encode_error(ItemFailed(3, 4, shared)) == (503, {"error": "item 3 of 4: queue of model 'm' is full"},
                                                      {"Retry-After": "2"})
    assert encode_error(ItemFailed(0, 2, DeadlineExceeded("late")))[:2] == (503, {"error": "item 0 of 2: late"})
    assert shared.detail == "queue of model 'm' is full"
