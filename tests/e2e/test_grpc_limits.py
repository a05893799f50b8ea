"""Hostile input over gRPC, the cases of the HTTP hardening tests (test_v2_limits.py,
test_hostile_input.py): messages over the body limit, item counts refused as a whole from the shape,
shapes of too many dimensions, bytes that are not a message, long names echoed back. Each gets the
protocol's error quickly, logs no traceback, holds the server's memory bounded and leaves it serving.
And calls without a key that stay open (health Watch streams, calls whose message never comes), on
one connection and many, in one process and a split host: bounded, so that probes and keyed calls
always answer (`router.grpc.streams`, `router.grpc.arrival`)."""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2

from tests.conftest import HANG_S, RouterProcess, metric_value, serve
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


# -- calls without a key that stay open: health Watch streams, messages that never come ---------------------------

KEY = "grpc-limits-key-0123456789"
#: grpc's concurrent-RPC limit (MAX_CONNECTIONS) is 32: a quarter, 8, for long streams without a key on the
#: server, 4 a connection, and 8 calls waiting for their message. Before these bounds, 32 such streams on one
#: connection or on several refused every other call.
BOUNDED = {"MODEL_ROUTER_API_KEYS": KEY, "MODEL_ROUTER_MAX_CONNECTIONS": "32",
           "MODEL_ROUTER_GRPC_KEYLESS_STREAMS_PER_CONNECTION": "4", "MODEL_ROUTER_BODY_TIMEOUT_S": "2"}
PER_CONNECTION, TOTAL, AWAITED = 4, 8, 8


def own_connection(address: str) -> grpc.Channel:
    """A channel on a connection of its own (channels to one address share one by default)."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def open_watches(channels: list[grpc.Channel], each: int) -> tuple[list[Any], list[grpc.RpcError]]:
    """`each` Watch streams without a key on every channel: the ones served (their first answer read), and the
    refusals."""
    served, refused = [], []
    for channel in channels:
        for _ in range(each):
            call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=120)
            try:
                assert next(call).status == health_pb2.HealthCheckResponse.SERVING
                served.append(call)
            except grpc.RpcError as error:
                refused.append(error)
    return served, refused


def until_served(channel: grpc.Channel, count: int) -> None:
    """Open `count` Watch streams on `channel` until all are served (the server counts a cancelled one out once it
    has seen the cancellation), within HANG_S; then close them."""
    deadline = time.monotonic() + HANG_S
    while True:
        served, _ = open_watches([channel], count)
        for call in served:
            call.cancel()
        if len(served) == count:
            return
        assert time.monotonic() < deadline, f"{len(served)} of {count} Watch streams served after {HANG_S} s"
        time.sleep(0.05)


def stalled_calls(channel: grpc.Channel, count: int) -> tuple[list[grpc.Future], threading.Event]:
    """`count` ServerLive calls whose message never comes (sent as the stream it is on the wire), and the event that
    ends them."""
    stop = threading.Event()

    def never() -> Iterator[bytes]:
        stop.wait()
        yield from ()

    call = channel.stream_unary(SERVICE + "ServerLive")
    return [call.future(never(), timeout=120) for _ in range(count)], stop


def until_ended(calls: list[grpc.Future], count: int) -> None:
    """Wait (within HANG_S) until `count` of the stalled calls have been ended for room: the server has taken them
    all, so none arrives after what the test sends next."""
    deadline = time.monotonic() + HANG_S
    while sum(call.done() for call in calls) < count:
        assert time.monotonic() < deadline, f"{sum(call.done() for call in calls)} of {len(calls)} ended, not {count}"
        time.sleep(0.05)


def still_served(address: str) -> None:
    """ServerLive, health.Check and a keyed ModelInfer answer, on a connection of their own."""
    with own_connection(address) as channel:
        assert live(channel)
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=HANG_S)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        call = channel.unary_unary(SERVICE + "ModelInfer", request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                   response_deserializer=service_pb2.ModelInferResponse.FromString)
        answered = call(documents("echo", 2), metadata=(("authorization", f"Bearer {KEY}"),), timeout=HANG_S)
        assert len(answered.raw_output_contents) == 1


def refused_as(errors: list[grpc.RpcError], code: grpc.StatusCode, words: str) -> None:
    assert errors and {(e.code(), words in e.details()) for e in errors} == {(code, True)}, errors[:2]


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("grpc-bounded"), FLEET, env=BOUNDED) as process:
        yield process


def test_watch_streams_without_a_key_on_one_connection_leave_room(bounded: RouterProcess) -> None:
    """40 Watch streams on one connection: 4 served, 36 RESOURCE_EXHAUSTED; probes and keyed calls answer, on that
    connection too, and a Watch with the key is not counted."""
    with own_connection(bounded.grpc_address) as channel:
        served, refused = open_watches([channel], 40)
        try:
            assert len(served) == PER_CONNECTION
            refused_as(refused, grpc.StatusCode.RESOURCE_EXHAUSTED, "streams without an inference key on this connection (at most 4")
            still_served(bounded.grpc_address)
            assert live(channel)
            keyed = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(), metadata=(("authorization", f"Bearer {KEY}"),), timeout=120)
            assert next(keyed).status == health_pb2.HealthCheckResponse.SERVING
            keyed.cancel()
        finally:
            for call in served:
                call.cancel()
    with own_connection(bounded.grpc_address) as channel:  # the ones that ended are no longer counted
        until_served(channel, PER_CONNECTION)
    no_tracebacks(bounded)


def test_watch_streams_without_a_key_over_many_connections_leave_room(bounded: RouterProcess) -> None:
    """10 connections of 4 Watch streams: 8 served in all, the rest RESOURCE_EXHAUSTED; probes answer."""
    channels = [own_connection(bounded.grpc_address) for _ in range(10)]
    served, refused = open_watches(channels, 4)
    try:
        assert len(served) == TOTAL
        refused_as(refused, grpc.StatusCode.RESOURCE_EXHAUSTED, "streams without an inference key on this server (at most 8")
        still_served(bounded.grpc_address)
    finally:
        for call in served:
            call.cancel()
        for channel in channels:
            channel.close()


def test_calls_whose_message_never_comes_make_room_and_time_out(bounded: RouterProcess) -> None:
    """40 ServerLive calls whose message never comes: the longest-waiting ones are ended (RESOURCE_EXHAUSTED) to make
    room for new calls, probes answer, and the 8 left waiting end DEADLINE_EXCEEDED after the body timeout (2 s)."""
    with own_connection(bounded.grpc_address) as channel:
        calls, stop = stalled_calls(channel, 40)
        try:
            until_ended(calls, 40 - AWAITED)
            still_served(bounded.grpc_address)
            errors = [call.exception(timeout=HANG_S) for call in calls]
        finally:
            stop.set()
    made_room = [e for e in errors if e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED]
    timed_out = [e for e in errors if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED]
    assert len(made_room) >= 40 - AWAITED and len(made_room) + len(timed_out) == 40, errors
    refused_as(made_room, grpc.StatusCode.RESOURCE_EXHAUSTED, "ended to make room: more than 8 calls")
    refused_as(timed_out, grpc.StatusCode.DEADLINE_EXCEEDED, "did not arrive within 2 s")
    no_tracebacks(bounded)


def test_streams_on_a_server_without_keys_leave_room(tmp_path: Path) -> None:
    """Without keys every ModelStreamInfer is a stream without a key: 40 on one connection, each sent one frame,
    with the same bounds as Watch streams: 4 answered, the rest RESOURCE_EXHAUSTED; probes and ModelInfer answer."""
    stop = threading.Event()

    def one_frame() -> Iterator[Any]:
        yield documents("echo", 1)
        stop.wait()

    env = {key: value for key, value in BOUNDED.items() if key != "MODEL_ROUTER_API_KEYS"}
    with serve(tmp_path, FLEET, env=env) as open_server, own_connection(open_server.grpc_address) as channel:
        streams = channel.stream_stream(SERVICE + "ModelStreamInfer",
                                        request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                        response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
        calls = [streams(one_frame(), timeout=120) for _ in range(40)]
        answered, refused = [], []
        try:
            for call in calls:
                try:
                    answered.append(next(call))
                except grpc.RpcError as error:
                    refused.append(error)
            assert len(answered) == PER_CONNECTION and not any(a.error_message for a in answered)
            refused_as(refused, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       "streams without an inference key on this connection (at most 4")
            assert live(channel)
            assert len(infer(channel, documents("echo", 2)).raw_output_contents) == 1
        finally:
            stop.set()
            for call in calls:
                call.cancel()
        no_tracebacks(open_server)


def test_a_split_host_bounds_each_front(tmp_path: Path) -> None:
    """`--workers 2`: each front runs its own gRPC server, and bounds its own streams. 16 connections of 8 Watch
    streams and 4 stalled calls each (before: enough to fill both fronts' 32 slots): at most 8 Watch streams a
    front are served, and probes and keyed calls answer on new connections, whichever front takes them."""
    from tests.e2e.test_split_host import serve_split

    with serve_split(tmp_path, FLEET, env={**BOUNDED, "MODEL_ROUTER_GRPC_KEYLESS_STREAMS_PER_CONNECTION": "8"}) as split:
        channels = [own_connection(split.grpc_address) for _ in range(16)]
        stalled = [stalled_calls(channel, 4) for channel in channels]
        until_ended([call for calls, _ in stalled for call in calls], 16 * 4 - 2 * AWAITED)
        served, refused = open_watches(channels, 8)
        try:
            assert TOTAL <= len(served) <= 2 * TOTAL
            assert len(refused) == 16 * 8 - len(served)
            refused_as(refused, grpc.StatusCode.RESOURCE_EXHAUSTED, "streams without an inference key on this server (at most 8")
            for _ in range(6):
                still_served(split.grpc_address)
        finally:
            for call in served:
                call.cancel()
            for _, stop in stalled:
                stop.set()
            for channel in channels:
                channel.close()
        no_tracebacks(split)
