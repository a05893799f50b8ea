"""Hostile input over gRPC, the cases of the HTTP hardening tests (test_v2_limits.py,
test_hostile_input.py): messages over the body limit, item counts refused as a whole from the shape,
shapes of too many dimensions, bytes that are not a message, long names echoed back. Each gets the
protocol's error quickly, logs no traceback, holds the server's memory bounded and leaves it serving."""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2

from tests.conftest import RouterProcess, metric_value, serve
from tests.e2e.test_v2_limits import FLEET, no_tracebacks  # the same models as the HTTP cases

pytestmark = pytest.mark.e2e

LIMIT = 1024 * 1024
SERVICE = "/inference.GRPCInferenceService/"
Tensor = service_pb2.ModelInferRequest.InferInputTensor


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("grpc-limits"), FLEET, memory_limit=8 * 1024**3,
               env={"MODEL_ROUTER_MAX_BODY_BYTES": str(LIMIT)}) as process:
        yield process


@pytest.fixture(scope="module")
def channel(server: RouterProcess) -> Iterator[grpc.Channel]:
    # The client may send more than the server takes: the server's limit is under test.
    with grpc.insecure_channel(server.grpc_address, options=[("grpc.max_send_message_length", -1)]) as opened:
        yield opened


def infer(channel: grpc.Channel, request: Any) -> Any:
    call = channel.unary_unary(SERVICE + "ModelInfer", request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                               response_deserializer=service_pb2.ModelInferResponse.FromString)
    return call(request, timeout=30)


def refusal(channel: grpc.Channel, request: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        infer(channel, request)
    return caught.value


def documents(model: str, count: int, item: bytes = b'{"id": "x"}') -> Any:
    """`count` BYTES items for the input `JSON`, in raw contents as tritonclient sends them."""
    return service_pb2.ModelInferRequest(model_name=model, inputs=[Tensor(name="JSON", datatype="BYTES", shape=[count])],
                                         raw_input_contents=[(struct.pack("<I", len(item)) + item) * count])


def live(channel: grpc.Channel) -> bool:
    call = channel.unary_unary(SERVICE + "ServerLive", request_serializer=service_pb2.ServerLiveRequest.SerializeToString,
                               response_deserializer=service_pb2.ServerLiveResponse.FromString)
    return bool(call(service_pb2.ServerLiveRequest(), timeout=10).live)  # a hang, not a slow machine, reaches 10 s


@pytest.mark.parametrize(("model", "limit"), [("echo", 64), ("wide", 1024)])
def test_a_hundred_thousand_items_are_refused_at_once(server: RouterProcess, channel: grpc.Channel, model: str,
                                                      limit: int) -> None:
    """Over the model's queue size (echo) or MODEL_ROUTER_MAX_ITEMS (wide): RESOURCE_EXHAUSTED from the
    shape, with liveness answered throughout and no queue slot or counter touched."""
    before = httpx.get(server.url + "/metrics").text
    answered: list[bool] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            answered.append(live(channel))
            stop.wait(0.01)

    def until_probed(count: int) -> None:
        while len(answered) < count:
            assert prober.is_alive(), f"liveness stopped answering after {answered}"
            stop.wait(0.01)

    prober = threading.Thread(target=probe)
    prober.start()
    until_probed(3)  # probing before, during and after
    try:
        for _ in range(3):
            error = refusal(channel, documents(model, 100_000, b""))
            assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error.details() == (f"input 'JSON' has 100000 items (its first dimension); "
                                       f"a request to this model may carry at most {limit}")
        until_probed(len(answered) + 3)
    finally:
        stop.set()
        prober.join()
    after = httpx.get(server.url + "/metrics").text
    assert set(answered) == {True}
    for outcome in ("rejected_full", "bad_input", "ok"):
        labels = {"model": model, "outcome": outcome}
        assert metric_value(after, "model_router_requests_total", **labels) - \
            metric_value(before, "model_router_requests_total", **labels) <= 1
    assert len(infer(channel, documents(model, 3)).raw_output_contents) == 1
    no_tracebacks(server)


def test_a_request_the_queue_can_never_hold_is_refused_and_one_that_fits_runs_whole(channel: grpc.Channel) -> None:
    error = refusal(channel, documents("small", 5))
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 4" in error.details()
    answered = infer(channel, documents("small", 4))
    assert list(answered.outputs[0].shape) == [4]


def test_messages_over_the_body_limit_are_refused_with_bounded_memory(server: RouterProcess, channel: grpc.Channel) -> None:
    big = documents("echo", 1, b"x" * (2 * LIMIT))
    start_rss = server.rss()
    for _ in range(20):
        error = refusal(channel, big)
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert server.rss() - start_rss < 100 * 1024 * 1024
    assert len(infer(channel, documents("echo", 2)).raw_output_contents) == 1


@pytest.mark.parametrize(("tensor", "code", "details"), [
    (Tensor(name="JSON", datatype="BYTES", shape=[1] * 65), grpc.StatusCode.INVALID_ARGUMENT,
     "input 'JSON': shape has 65 dimensions; at most 64 are accepted"),
    (Tensor(name="JSON", datatype="BYTES", shape=[2**62, 2**62]), grpc.StatusCode.INVALID_ARGUMENT,
     "input 'JSON': shape [4611686018427387904, 4611686018427387904] has more than 2**63 - 1 elements"),
    (Tensor(name="JSON", datatype="BYTES", shape=[-3]), grpc.StatusCode.INVALID_ARGUMENT,
     "input 'JSON': shape must be a non-empty list of non-negative integers, got [-3]"),
    (Tensor(name="JSON", datatype="NOPE", shape=[1]), grpc.StatusCode.INVALID_ARGUMENT,
     ("input 'JSON': datatype must be one of BOOL, UINT8, UINT16, UINT32, UINT64, INT8, INT16, INT32, INT64, FP16, "
      "FP32, FP64, BF16, BYTES, got 'NOPE'")),
])
def test_bad_shapes_and_datatypes_are_invalid_arguments(server: RouterProcess, channel: grpc.Channel, tensor: Any,
                                                        code: grpc.StatusCode, details: str) -> None:
    error = refusal(channel, service_pb2.ModelInferRequest(model_name="echo", inputs=[tensor], raw_input_contents=[b""]))
    assert (error.code(), error.details()) == (code, details)
    no_tracebacks(server)


def test_bytes_that_are_not_a_message_are_invalid_arguments(server: RouterProcess, channel: grpc.Channel) -> None:
    raw = channel.unary_unary(SERVICE + "ModelInfer")  # bytes in, bytes out: no serializer
    for garbage in (b"\xff\xff\xff\xff", b"\x0a\x80\x80\x80\x80\x10", b"\x2a\x05\x0a\x03ab"):
        with pytest.raises(grpc.RpcError) as caught:
            raw(garbage, timeout=10)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith("the request is not a valid ModelInferRequest message")
    stream = channel.stream_stream(SERVICE + "ModelStreamInfer",
                                   response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
    answers = list(stream(iter([b"\xff\xff", documents("echo", 1).SerializeToString()]), timeout=10))
    assert answers[0].error_message.startswith("the request is not a valid ModelInferRequest message")
    assert answers[1].error_message == "" and len(answers[1].infer_response.raw_output_contents) == 1
    no_tracebacks(server)


def test_long_names_are_truncated_in_echoes(channel: grpc.Channel) -> None:
    name = "n" * 10_000
    unknown_model = refusal(channel, documents(name, 1))
    assert unknown_model.code() is grpc.StatusCode.NOT_FOUND and len(unknown_model.details()) < 400
    request = documents("echo", 1)
    request.inputs[0].name = name
    assert len(refusal(channel, request).details()) < 400
    request.inputs[0].name, request.inputs[0].datatype = "JSON", name
    assert len(refusal(channel, request).details()) < 400
