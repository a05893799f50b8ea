"""Hostile trace context against a real server with tracing on and keys set: 60 KB `baggage`,
`tracestate` and `traceparent` headers, 8 KB of malformed baggage members, over HTTP and gRPC
metadata, without a key. Each request is answered (401 / UNAUTHENTICATED) and adds its access line
to the log and nothing more: no propagator's warning quoting the header (before: one 60,230-character
line per request). With a key, the request is served and a valid `traceparent` beside the hostile
field still makes the server span its child."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.conftest import RouterProcess, serve
from tests.otlp_receiver import SERVER, Receiver, receiver

pytestmark = pytest.mark.e2e

FLEET = """
models:
  echo:
    plugin: scripted
    batch: {max_size: 8, max_delay_ms: 2}
"""
KEY = "k-trace-bounds-0123456789"
REQUESTS = 100
#: What one refused request may add to the log: its access line (about 300 bytes) and a margin, far
#: under one quoted header. No line may be longer than this either.
PER_REQUEST_BYTES = 600
LONGEST_LINE = 1_000
#: Over W3C's bounds (baggage 8,192 bytes; tracestate 512 characters) and OpenTelemetry's (traceparent 512).
HOSTILE = {
    "baggage": "k=" + "v" * 60_000,
    "tracestate": "vendor=" + "v" * 60_000,
    "traceparent": "00-" + "0" * 60_000,
    # Under the bounds, but every member malformed: the propagator would warn about each one.
    "malformed baggage": ",".join(f"bad key {i}=" + "v" * 100 for i in range(60)),
}


@pytest.fixture(scope="module")
def otlp() -> Iterator[Receiver]:
    with receiver() as into:
        yield into


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, otlp: Receiver) -> Iterator[RouterProcess]:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url, "OTEL_BSP_SCHEDULE_DELAY": "50", "MODEL_ROUTER_LOG_FORMAT": "json",
           "MODEL_ROUTER_API_KEYS": KEY}
    with serve(tmp_path_factory.mktemp("trace-bounds"), FLEET, env=env) as process:
        yield process


def header_of(kind: str) -> tuple[str, str]:
    return kind.removeprefix("malformed "), HOSTILE[kind]


def log_added(server: RouterProcess, send: Callable[[str], None], ids: list[str]) -> list[str]:
    """The lines the log gained while `send` sent a request for each id (once the last one's access
    line is written: the writer writes in order)."""
    before = server.log_path.stat().st_size
    for request_id in ids:
        send(request_id)
    assert server.access_lines(ids[-1]), server.log()[-2000:]
    with open(server.log_path, "rb") as log:
        log.seek(before)
        return log.read().decode("utf-8", "replace").splitlines()


def assert_bounded(lines: list[str], ids: list[str]) -> None:
    size = sum(len(line) + 1 for line in lines)
    assert size < PER_REQUEST_BYTES * len(ids), (size, max(lines, key=len)[:300])
    assert max(map(len, lines)) <= LONGEST_LINE, max(lines, key=len)[:300]
    records = [json.loads(line) for line in lines]
    assert [r["request_id"] for r in records if r["message"] == "request"] == ids  # one access line each
    assert not [r for r in records if r["message"] != "request"], [r for r in records if r["message"] != "request"][:2]


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_trace_headers_without_a_key_add_only_access_lines(server: RouterProcess, kind: str) -> None:
    name, value = header_of(kind)
    ids = [f"http-{name}-{kind[:3]}-{i}" for i in range(REQUESTS)]
    valid = {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"}  # so tracestate is read
    with httpx.Client(base_url=server.url, timeout=30) as client:
        def send(request_id: str) -> None:
            answer = client.post("/models/echo/predict", json={"id": request_id},
                                 headers={**valid, name: value, "x-request-id": request_id})
            assert answer.status_code == 401, answer.text
        lines = log_added(server, send, ids)
    assert_bounded(lines, ids)


def test_hostile_trace_metadata_without_a_key_adds_only_access_lines(server: RouterProcess) -> None:
    """gRPC metadata, as large as the transport takes (8 KB of metadata in all, gRPC's default):
    a 6 KB tracestate (over W3C's 512 characters), and 6.8 KB of malformed baggage members."""
    ids = [f"grpc-{i}" for i in range(REQUESTS)]
    fields = [("tracestate", "vendor=" + "v" * 6_000), ("baggage", HOSTILE["malformed baggage"])]
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        def send(request_id: str) -> None:
            metadata = (fields[int(request_id.split("-")[1]) % 2], ("x-request-id", request_id))
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelInfer(infer_message(request_id), metadata=metadata, timeout=30)
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED, refused.value
        lines = log_added(server, send, ids)
    assert_bounded(lines, ids)


def infer_message(request_id: str) -> service_pb2.ModelInferRequest:
    document = json.dumps({"id": request_id}).encode()
    return service_pb2.ModelInferRequest(
        model_name="echo", inputs=[service_pb2.ModelInferRequest.InferInputTensor(name="JSON", datatype="BYTES",
                                                                                   shape=[1])],
        raw_input_contents=[len(document).to_bytes(4, "little") + document])


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_valid_traceparent_beside_a_hostile_field_still_propagates(
    server: RouterProcess, otlp: Receiver, kind: str,
) -> None:
    name, value = header_of(kind)
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    request_id = f"keyed-{kind.replace(' ', '-')}"
    headers = {"traceparent": f"00-{client_trace}-{client_span}-01", name: value, "x-request-id": request_id,
               "authorization": f"Bearer {KEY}"}
    if name == "traceparent":  # the hostile traceparent instead: refused whole, the request served as a root
        headers["traceparent"] = value
    answer = httpx.post(f"{server.url}/models/echo/predict", json={"id": request_id}, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    span = otlp.wait_for(lambda got: next((s for s in got if s.kind == SERVER
                                           and s.attributes.get("router.request_id") == request_id), None))
    if name == "traceparent":
        assert span.trace_id != client_trace and span.parent_id == ""  # a root: the hostile value was dropped
    else:
        assert (span.trace_id, span.parent_id) == (client_trace, client_span)
        assert answer.headers["traceparent"] == f"00-{client_trace}-{span.span_id}-01"
    assert "v" * 1000 not in answer.headers.get("tracestate", "")  # never echoed back


def test_a_grpc_traceparent_beside_over_long_fields_still_propagates(server: RouterProcess, otlp: Receiver) -> None:
    """Beside it: a 4 KB tracestate and baggage of 100 members (W3C: at most 64), both dropped."""
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    metadata = (("traceparent", f"00-{client_trace}-{client_span}-01"), ("tracestate", "vendor=" + "v" * 4_000),
                ("baggage", ",".join(f"m{i}=v" for i in range(100))),
                ("x-request-id", "grpc-keyed"), ("authorization", f"Bearer {KEY}"))
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answer, call = stub.ModelInfer.with_call(infer_message("grpc-keyed"), metadata=metadata, timeout=30)
    assert json.loads(answer.raw_output_contents[0][4:])["id"] == "grpc-keyed"
    span = otlp.wait_for(lambda got: next((s for s in got if s.kind == SERVER
                                           and s.attributes.get("router.request_id") == "grpc-keyed"), None))
    assert (span.trace_id, span.parent_id) == (client_trace, client_span)
    assert dict(call.trailing_metadata())["traceparent"] == f"00-{client_trace}-{span.span_id}-01"


def test_no_line_of_the_whole_log_is_long(server: RouterProcess, tmp_path: Path) -> None:
    """After everything above (run last in this module): the log as a whole holds no long line."""
    assert max(map(len, server.log().splitlines())) <= LONGEST_LINE
