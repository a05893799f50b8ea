"""Tracing against a real server exporting OTLP over HTTP to a real receiver in the test: each
request's server span and its phases, the batch span linked to every request it served, a
client's `traceparent` as the parent, errors (504, 503) as error spans with their reason, and
trace ids on the log lines. Timestamps are checked against the test's own clock and against the
batches the scripted plugin records (time.monotonic, one clock for the host)."""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import ultralytics
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import serialize_byte_tensor

from tests.conftest import REPO, RouterProcess, read_records, serve
from tests.otlp_receiver import SERVER, STATUS_ERROR, ReceivedSpan, Receiver, receiver

pytestmark = pytest.mark.e2e

FLEET = """
models:
  batched:
    plugin: scripted
    options: {{fixed_ms: 40, per_item_ms: 1, per_item_bytes: 1000, fixed_bytes: 500, record: "{record}"}}
    batch: {{max_size: 8, max_delay_ms: 500}}
  slow:
    plugin: scripted
    options: {{hang_on: hang, hang_ms: 1500}}
    batch: {{max_size: 1, max_delay_ms: 0}}
    execution: {{timeout_ms: 200}}
    warmup: {{enabled: false}}
  gone:
    plugin: scripted
    warmup: {{enabled: false}}
"""
PHASES = ["receive", "admission", "preprocess", "queue wait", "execute", "postprocess", "respond"]
CONCURRENT = 6
#: How much the client's latency may exceed the server span's: connecting, the client's own work,
#: the kernel, and the server's loop reading the request before its app sees it, on a shared
#: 2-core machine (1.2 s seen under load). The spans themselves must add up to within 1 us.
CLIENT_MARGIN_NS = 5_000_000_000
#: Converting one host's monotonic clock into epoch time in two processes: the offsets agree to
#: well within this unless the wall clock is stepped between.
CLOCK_NS = 2_000_000


@pytest.fixture(scope="module")
def otlp() -> Iterator[Receiver]:
    with receiver() as into:
        yield into


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("records") / "batches.jsonl"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, otlp: Receiver, record: Path) -> Iterator[RouterProcess]:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url, "OTEL_BSP_SCHEDULE_DELAY": "50",
           "OTEL_SERVICE_NAME": "router-under-test", "MODEL_ROUTER_LOG_FORMAT": "json"}
    with serve(tmp_path_factory.mktemp("traced"), FLEET.format(record=record), env=env) as process:
        yield process


def to_ns(monotonic_s: float) -> int:
    """A monotonic timestamp of this host as epoch nanoseconds, as the server converts it."""
    return int(monotonic_s * 1e9) + time.time_ns() - time.monotonic_ns()


@dataclass
class Sent:
    request_id: str
    status: int
    headers: httpx.Headers
    body: dict[str, Any]
    latency_ns: int


def send(server: RouterProcess, model: str, request_id: str, headers: dict[str, str] | None = None) -> Sent:
    started = time.monotonic_ns()
    answer = httpx.post(f"{server.url}/models/{model}/predict", content=json.dumps({"id": request_id}),
                        headers={"content-type": "application/json", "x-request-id": request_id, **(headers or {})},
                        timeout=30)
    return Sent(request_id, answer.status_code, answer.headers, answer.json(), time.monotonic_ns() - started)


def parse_traceparent(header: str) -> tuple[str, str, bool]:
    """(trace id, span id, sampled) of a W3C traceparent (the other flag bits say how ids were made)."""
    version, trace_id, span_id, flags = header.split("-")
    assert version == "00"
    return trace_id, span_id, bool(int(flags, 16) & 1)


def server_span(spans: list[ReceivedSpan], request_id: str) -> ReceivedSpan | None:
    return next((s for s in spans if s.kind == SERVER and s.attributes.get("router.request_id") == request_id), None)


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return sorted((s for s in spans if s.parent_id == parent.span_id and s.trace_id == parent.trace_id),
                  key=lambda s: s.start_ns)


def test_concurrent_requests_each_have_their_phases_and_their_batch_links_them_all(
    server: RouterProcess, otlp: Receiver, record: Path,
) -> None:
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    ids = [f"batch-{i}" for i in range(CONCURRENT)]
    sent: dict[str, Sent] = {}

    together = threading.Barrier(CONCURRENT)  # sent at once: they ride the batch the first one opens (500 ms)

    def one(request_id: str) -> None:
        extra = {"traceparent": f"00-{client_trace}-{client_span}-01"} if request_id == ids[0] else {}
        together.wait(10)
        sent[request_id] = send(server, "batched", request_id, extra)

    threads = [threading.Thread(target=one, args=(rid,)) for rid in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(sent) == ids and all(s.status == 200 for s in sent.values()), sent
    batches = [b for b in read_records(record) if set(b["ids"]) & set(ids)]  # type: ignore[arg-type]
    assert sum(len(b["ids"]) for b in batches) == CONCURRENT  # type: ignore[arg-type, misc]
    assert max(len(b["ids"]) for b in batches) > 1  # type: ignore[arg-type]

    spans = wait_for_traces(otlp, ids, batches)
    by_id = check_traces(spans, sent, batches)

    # The client's traceparent is the parent, and the answer names the server span.
    first = by_id[ids[0]]
    assert first is not None and (first.trace_id, first.parent_id) == (client_trace, client_span)
    assert parse_traceparent(sent[ids[0]].headers["traceparent"]) == (client_trace, first.span_id, True)
    for rid in ids[1:]:
        span = by_id[rid]
        assert span is not None and span.parent_id == "" and span.trace_id != client_trace
        assert parse_traceparent(sent[rid].headers["traceparent"]) == (span.trace_id, span.span_id, True)
    assert first.resource["service.name"] == "router-under-test"  # OTEL_SERVICE_NAME, read by the SDK

    # A log line leads to its trace.
    for rid in ids:
        line = server.access_lines(rid)[0]
        span = by_id[rid]
        assert span is not None and line["trace_id"] == span.trace_id


def wait_for_traces(otlp: Any, ids: list[str], batches: list[dict[str, Any]]) -> list[ReceivedSpan]:
    """The spans received once every request's server span and every batch's span have arrived."""
    return otlp.wait_for(lambda got: got if all(server_span(got, r) for r in ids)  # type: ignore[no-any-return]
                         and len([s for s in got if s.name == "batch"]) >= len(batches) else None)


def check_traces(spans: list[ReceivedSpan], sent: dict[str, Sent], batches: list[dict[str, Any]]) -> dict[str, ReceivedSpan]:
    """Each sent request's trace against the batch it rode, then the batches' spans; the server
    spans by request id."""
    by_id: dict[str, ReceivedSpan] = {}
    for rid, request in sent.items():
        span = server_span(spans, rid)
        assert span is not None, rid
        check_request_trace(spans, span, request, next(b for b in batches if rid in b["ids"]))
        by_id[rid] = span
    check_batches(spans, batches, dict(by_id))
    return by_id


def check_request_trace(spans: list[ReceivedSpan], span: ReceivedSpan, sent: Sent, batch: dict[str, Any]) -> None:
    """The phases tile the server span; the server span lies within the client's latency; the
    queue wait is the one the answer reports; execute holds the plugin's own run of the batch."""
    assert span.name == "POST /models/{name}/predict"
    assert span.attributes["http.response.status_code"] == 200 and span.attributes["router.model"] == "batched"
    assert span.attributes["router.batch_size"] == len(batch["ids"])
    phases = children(spans, span)
    assert [p.name for p in phases] == PHASES
    assert phases[0].start_ns == span.start_ns and phases[-1].end_ns == span.end_ns
    for before, after in itertools.pairwise(phases):
        assert before.end_ns == after.start_ns, (before.name, after.name)
    assert abs(sum(p.duration_ns for p in phases) - span.duration_ns) <= 1_000
    assert all(p.status_code != STATUS_ERROR for p in [span, *phases])
    assert 0 < span.duration_ns <= sent.latency_ns + CLOCK_NS
    assert sent.latency_ns - span.duration_ns <= CLIENT_MARGIN_NS

    named = {p.name: p for p in phases}
    timing = sent.body["timing"]
    assert abs(named["queue wait"].duration_ns / 1e6 - timing["queue_ms"]) <= 0.002
    execute = named["execute"]
    assert execute.duration_ns / 1e6 >= timing["execution_ms"] - 0.002
    assert execute.start_ns <= to_ns(batch["start"]) + CLOCK_NS and to_ns(batch["end"]) <= execute.end_ns + CLOCK_NS
    assert execute.attributes["router.batch.size"] == len(batch["ids"])
    assert len(execute.links) == 1  # to its batch span
    batch_span = next(s for s in spans if s.span_id == execute.links[0].span_id)
    assert batch_span.name == "batch" and any(link.span_id == span.span_id for link in batch_span.links)


def check_batches(spans: list[ReceivedSpan], batches: list[dict[str, Any]], by_id: dict[str, ReceivedSpan | None]) -> None:
    """One batch span per batch the plugin ran, linked to exactly the requests in it, with its size,
    instance, device and the memory reserved for it (the plugin's estimate: 500 + 1000 per item)."""
    batch_spans = [s for s in spans if s.name == "batch" and s.links
                   and {link.attributes["router.request_id"] for link in s.links} <= set(by_id)]
    assert len(batch_spans) == len(batches)
    for batch in batches:
        ids = set(batch["ids"])
        found = next(s for s in batch_spans if {link.attributes["router.request_id"] for link in s.links} == ids)
        linked = {(link.trace_id, link.span_id) for link in found.links}
        assert linked == {(by_id[r].trace_id, by_id[r].span_id) for r in ids}  # type: ignore[union-attr]
        assert found.attributes["router.batch.size"] == len(ids)
        assert found.attributes["router.instance"] == "batched/0" and found.attributes["router.device"] == "cpu"
        assert found.attributes["router.batch.memory_reserved_bytes"] == 500 + 1000 * len(ids)
        assert found.start_ns <= to_ns(batch["start"]) + CLOCK_NS and to_ns(batch["end"]) <= found.end_ns + CLOCK_NS
        assert found.parent_id == "" and found.status_code != STATUS_ERROR


def test_a_504_is_an_error_span_with_its_reason(server: RouterProcess, otlp: Receiver) -> None:
    answer = send(server, "slow", "hang")  # the batch overruns its 200 ms execution timeout
    assert answer.status == 504, answer.body
    span = otlp.wait_for(lambda got: server_span(got, "hang"))
    assert span.status_code == STATUS_ERROR and "exceeded its timeout" in span.status_message
    assert span.attributes["error.type"] == "ExecutionTimeout" and span.attributes["http.response.status_code"] == 504
    phases = children(otlp.spans, span)
    assert [p.name for p in phases] == PHASES[:5]
    execute = phases[-1]
    assert execute.name == "execute" and execute.status_code == STATUS_ERROR
    assert "exceeded its timeout" in execute.status_message
    assert parse_traceparent(answer.headers["traceparent"]) == (span.trace_id, span.span_id, True)
    batch = next(s for s in otlp.spans if s.span_id == execute.links[0].span_id)
    assert batch.status_code == STATUS_ERROR and "exceeded its timeout" in batch.status_message


def test_a_503_is_an_error_span_with_its_reason_whoever_answers_it(server: RouterProcess, otlp: Receiver) -> None:
    unloaded = httpx.post(f"{server.url}/models/gone/unload", timeout=30)
    assert unloaded.status_code == 200, unloaded.text
    refused = send(server, "gone", "refused-early")  # answered by the connection, from the headers
    assert refused.status == 503, refused.body
    span = otlp.wait_for(lambda got: server_span(got, "refused-early"))
    assert span.status_code == STATUS_ERROR and "was unloaded by an operator" in span.status_message
    assert span.attributes["error.type"] == "ModelUnavailable" and span.attributes["router.refused"] == "before the app"
    assert parse_traceparent(refused.headers["traceparent"]) == (span.trace_id, span.span_id, True)
    assert server.access_lines("refused-early")[0]["trace_id"] == span.trace_id

    # The V2 route refuses in the app (after its own checks): the same reason on its span.
    v2 = httpx.post(f"{server.url}/v2/models/gone/infer", headers={"x-request-id": "refused-v2"}, timeout=30,
                    json={"inputs": [{"name": "INPUT", "shape": [1], "datatype": "BYTES", "data": ['{"id": "x"}']}]})
    assert v2.status_code == 503, v2.text
    span = otlp.wait_for(lambda got: server_span(got, "refused-v2"))
    assert span.name == "POST /v2/models/{name}/infer"
    assert span.status_code == STATUS_ERROR and "was unloaded by an operator" in span.status_message
    # Screened once, when its terms (items, priority, timeout) are decoded: refused before any item is queued.
    assert [p.name for p in children(otlp.spans, span)] == ["receive", "decode"]


def test_without_opentelemetry_installed_the_router_serves_untraced_and_refuses_an_endpoint(tmp_path: Path) -> None:
    """The `tracing` extra is optional: absent, the router serves as ever; asked to export, it
    refuses to start and names the extra."""
    blocked = tmp_path / "blocked" / "opentelemetry"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text('raise ImportError("OpenTelemetry is not installed here (the test hides it)")\n')
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(blocked.parent), os.environ.get("PYTHONPATH")])),
           "MODEL_ROUTER_LOG_FORMAT": "json"}
    fleet = "models:\n  plain: {plugin: scripted, warmup: {enabled: false}}\n"
    with serve(tmp_path, fleet, env=env) as server:
        answer = send(server, "plain", "untraced")
        assert answer.status == 200 and "traceparent" not in answer.headers
        assert "trace_id" not in server.access_lines("untraced")[0]
    done = subprocess.run([sys.executable, "-m", "router", "serve", "--config", str(tmp_path / "fleet.yaml")], cwd=REPO,
                          env={**os.environ, **env, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "OTEL_EXPORTER_OTLP_ENDPOINT is set" in done.stderr and "pip install -e '.[tracing]'" in done.stderr


def test_a_v2_request_of_many_items_has_a_path_per_item_under_its_span(server: RouterProcess, otlp: Receiver) -> None:
    items = [json.dumps({"id": f"v2-{i}"}) for i in range(3)]
    answer = httpx.post(f"{server.url}/v2/models/batched/infer", headers={"x-request-id": "v2-many"}, timeout=30,
                        json={"inputs": [{"name": "JSON", "shape": [3], "datatype": "BYTES", "data": items}]})
    assert answer.status_code == 200, answer.text
    span = otlp.wait_for(lambda got: server_span(got, "v2-many"))
    phases = children(otlp.wait_for(lambda got: got if len(children(got, span)) >= 4 + 3 * 5 else None), span)
    main = [p for p in phases if "router.item" not in p.attributes]
    assert [p.name for p in main] == ["receive", "decode", "items", "respond"]
    assert main[0].start_ns == span.start_ns and main[-1].end_ns == span.end_ns
    assert all(a.end_ns == b.start_ns for a, b in itertools.pairwise(main))
    items_phase = main[2]
    for index in range(3):
        path = [p for p in phases if p.attributes.get("router.item") == index]
        assert [p.name for p in path] == PHASES[1:-1]  # admission .. postprocess, side by side under "items"
        assert items_phase.start_ns <= path[0].start_ns and path[-1].end_ns <= items_phase.end_ns
        execute = next(p for p in path if p.name == "execute")
        batch = next(s for s in otlp.spans if s.span_id == execute.links[0].span_id)
        assert f"v2-many.{index}" in {link.attributes["router.request_id"] for link in batch.links}
        assert all(link.span_id == span.span_id for link in batch.links if link.attributes["router.request_id"]
                   .startswith("v2-many"))


# -- gRPC: a call (and each frame of a stream) is a server span with V2's phases ----------------------


GRPC_PHASES = ["receive", "decode", *PHASES[1:-1], "respond"]
MODEL_INFER = "inference.GRPCInferenceService/ModelInfer"


def infer_message(model: str, *request_ids: str) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest of JSON documents (the scripted model's input), one item per id."""
    documents = np.array([json.dumps({"id": rid}).encode() for rid in request_ids], dtype=np.object_)
    return service_pb2.ModelInferRequest(
        model_name=model, inputs=[service_pb2.ModelInferRequest.InferInputTensor(
            name="JSON", datatype="BYTES", shape=[len(request_ids)])],
        raw_input_contents=[serialize_byte_tensor(documents).item()])


def test_a_grpc_call_is_a_server_span_with_the_phases_of_v2_and_echoes_the_traceparent(
    server: RouterProcess, otlp: Receiver,
) -> None:
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    metadata = (("traceparent", f"00-{client_trace}-{client_span}-01"), ("x-request-id", "grpc-1"))
    started = time.monotonic_ns()
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answer, call = stub.ModelInfer.with_call(infer_message("batched", "grpc-1"), metadata=metadata, timeout=30)
        latency_ns = time.monotonic_ns() - started
        with pytest.raises(grpc.RpcError) as refused:  # the queue's deadline passes: an error span with its reason
            stub.ModelInfer(infer_message("slow", "hang"), metadata=(("x-request-id", "grpc-504"),), timeout=30)
    assert json.loads(answer.raw_output_contents[0][4:])["id"] == "grpc-1"
    span = otlp.wait_for(lambda got: server_span(got, "grpc-1"))
    assert (span.name, span.trace_id, span.parent_id) == (MODEL_INFER, client_trace, client_span)
    assert span.attributes["rpc.system"] == "grpc" and span.attributes["rpc.method"] == "ModelInfer"
    assert span.attributes["rpc.grpc.status_code"] == 0 and span.attributes["router.model"] == "batched"
    assert 0 < span.duration_ns <= latency_ns + CLOCK_NS
    phases = children(otlp.wait_for(lambda got: got if len(children(got, span)) >= len(GRPC_PHASES) else None), span)
    assert [p.name for p in phases] == GRPC_PHASES
    assert phases[0].start_ns == span.start_ns and phases[-1].end_ns == span.end_ns
    assert all(a.end_ns == b.start_ns for a, b in itertools.pairwise(phases))
    execute = next(p for p in phases if p.name == "execute")
    batch = otlp.wait_for(lambda got: next((s for s in got if s.span_id == execute.links[0].span_id), None))
    assert {(link.span_id, link.attributes["router.request_id"]) for link in batch.links} >= {(span.span_id, "grpc-1")}
    echoed = f"00-{client_trace}-{span.span_id}-01"
    assert dict(call.initial_metadata())["traceparent"] == echoed
    assert dict(call.trailing_metadata())["traceparent"] == echoed
    assert server.access_lines("grpc-1")[0]["trace_id"] == client_trace

    assert refused.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    failed = otlp.wait_for(lambda got: server_span(got, "grpc-504"))
    assert failed.status_code == STATUS_ERROR and "exceeded its timeout" in failed.status_message
    assert failed.attributes["rpc.grpc.status_code"] == 4 and failed.attributes["error.type"] == "ExecutionTimeout"
    assert parse_traceparent(dict(refused.value.trailing_metadata())["traceparent"]) == (
        failed.trace_id, failed.span_id, True)
    assert server.access_lines("grpc-504")[0]["trace_id"] == failed.trace_id


def test_each_frame_of_a_stream_is_a_server_span_named_in_its_answer(server: RouterProcess, otlp: Receiver) -> None:
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    triton = grpcclient.InferenceServerClient(server.grpc_address)
    triton.start_stream(callback=lambda result, error: got.put((result, error)),
                        headers={"traceparent": f"00-{client_trace}-{client_span}-01", "x-request-id": "stream"})
    for index in range(2):
        tensor = grpcclient.InferInput("JSON", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([json.dumps({"id": f"frame-{index}"}).encode()], dtype=np.object_))
        triton.async_stream_infer("batched", [tensor], request_id=f"frame-{index}")
    triton.stop_stream()
    results = [got.get(timeout=30) for _ in range(2)]
    assert all(error is None for _, error in results), results
    for index, (result, _) in enumerate(results):
        span = otlp.wait_for(lambda got, index=index: server_span(got, f"stream.{index}"))
        assert (span.name, span.trace_id, span.parent_id) == (
            "inference.GRPCInferenceService/ModelStreamInfer", client_trace, client_span)
        named = result.get_response().parameters["traceparent"].string_param
        assert named == f"00-{client_trace}-{span.span_id}-01"
        phases = children(otlp.wait_for(lambda got, span=span: got if len(children(got, span)) >= len(GRPC_PHASES)
                                        else None), span)
        assert [p.name for p in phases] == GRPC_PHASES
        assert server.access_lines(f"stream.{index}")[0]["trace_id"] == client_trace


# -- a pipeline: a stage per step, each crop's phases linked to the batch it rode ------------------------


PHOTOS = Path(ultralytics.__file__).parent / "assets"
PIPELINE_STEPS = ["step 0:yolov8n", "step 1:crop", "step 2:resnet18"]
ITEM_PHASES = PHASES[1:-1]  # admission .. postprocess


@pytest.fixture(scope="module")
def pipeline_server(tmp_path_factory: pytest.TempPathFactory, otlp: Receiver) -> Iterator[RouterProcess]:
    """config/fleet.yaml (detect-classify) on the demo store, every limit at 60 s, and batch windows
    wide enough (1 s, for a busy machine) that the detections of requests sent together, and then their
    crops, share batches."""
    text = (REPO / "config" / "fleet.yaml").read_text(encoding="utf-8")
    text = text.replace("model_store: ../model_store", f"model_store: {REPO / 'model_store'}")
    text = re.sub(r"max_delay_ms: \d+", "max_delay_ms: 1000", re.sub(r"timeout_ms: \d+", "timeout_ms: 60000", text))
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url, "OTEL_BSP_SCHEDULE_DELAY": "50", "MODEL_ROUTER_LOG_FORMAT": "json"}
    with serve(tmp_path_factory.mktemp("pipeline"), text, env=env, timeout=180) as process:
        yield process


def test_a_pipeline_request_has_a_stage_per_step_and_its_crops_ride_batches_with_other_requests(
    pipeline_server: RouterProcess, otlp: Receiver,
) -> None:
    ids = [f"dc-{i}" for i in range(3)]
    together = threading.Barrier(len(ids))
    answers: dict[str, httpx.Response] = {}

    def one(index: int) -> None:
        together.wait(10)
        answers[ids[index]] = httpx.post(
            f"{pipeline_server.url}/models/detect-classify/predict", timeout=120,
            content=(PHOTOS / ("bus.jpg", "zidane.jpg")[index % 2]).read_bytes(),
            headers={"content-type": "image/jpeg", "x-request-id": ids[index]})

    threads = [threading.Thread(target=one, args=(index,)) for index in range(len(ids))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    assert all(answers[rid].status_code == 200 for rid in ids), {rid: a.text[:200] for rid, a in answers.items()}
    crops = {rid: len(answers[rid].json()["result"]["detections"]) for rid in ids}
    assert all(crops.values()), crops

    def complete(got: list[ReceivedSpan]) -> list[ReceivedSpan] | None:
        """Every request's span and phases, each crop's execute phase and the batch span it links to."""
        spans = [server_span(got, rid) for rid in ids]
        if not all(spans):
            return None
        executes = [p for s in spans for p in descendants(got, s) if p.name == "execute"]  # type: ignore[arg-type]
        linked = {link.span_id for p in executes for link in p.links}
        found = {s.span_id for s in got}
        return got if len(executes) == sum(crops.values()) + len(ids) and linked <= found else None

    spans = otlp.wait_for(complete, timeout_s=30)
    classifier_batches: dict[str, set[str]] = {}  # batch span id: the requests whose crops rode it
    for rid in ids:
        span = server_span(spans, rid)
        assert span is not None and span.name == "POST /models/{name}/predict"
        under = children(spans, span)
        assert [p.name for p in under if not p.name.startswith("step ")] == ["receive", "pipeline", "respond"]
        stages = {p.name: p for p in under if p.name.startswith("step ")}
        assert sorted(stages) == PIPELINE_STEPS  # one span per step
        pipeline = next(p for p in under if p.name == "pipeline")
        assert all(pipeline.start_ns <= s.start_ns and s.end_ns <= pipeline.end_ns for s in stages.values())
        steps = {s["step"]: s for s in answers[rid].json()["timing"]["steps"]}
        for name, stage in stages.items():
            key = name.removeprefix("step ")
            assert stage.attributes["router.step"] == key and stage.attributes["router.items"] == steps[key]["items"]
        assert steps["2:resnet18"]["items"] == crops[rid] and children(spans, stages["step 1:crop"]) == []
        for stage_name, model in (("step 0:yolov8n", "yolov8n"), ("step 2:resnet18", "resnet18")):
            stage = stages[stage_name]
            items = children(spans, stage)
            count = 1 if model == "yolov8n" else crops[rid]
            assert len(items) == count * len(ITEM_PHASES)
            for item in range(count):
                path = [p for p in items if p.attributes["router.item"] == item]
                assert [p.name for p in path] == ITEM_PHASES
                assert all(a.end_ns == b.start_ns for a, b in itertools.pairwise(path))
                assert stage.start_ns <= path[0].start_ns and path[-1].end_ns <= stage.end_ns
                [link] = next(p for p in path if p.name == "execute").links
                batch = next(s for s in spans if s.span_id == link.span_id)
                assert batch.name == "batch" and batch.attributes["router.model"] == model
                assert any(bl.span_id == stage.span_id for bl in batch.links)  # the batch links back to the stage
                if model == "resnet18":
                    riders = {str(bl.attributes["router.request_id"]).split(".")[0] for bl in batch.links}
                    classifier_batches.setdefault(batch.span_id, set()).update(riders & set(ids))
    shared = [riders for riders in classifier_batches.values() if len(riders) > 1]
    assert shared, classifier_batches  # crops of different requests rode one classifier batch
    for batch_id, riders in classifier_batches.items():  # and each rider's crop in it links to that batch
        batch = next(s for s in spans if s.span_id == batch_id)
        assert {str(link.attributes["router.request_id"]).split(".")[0] for link in batch.links} & set(ids) == riders


def descendants(spans: list[ReceivedSpan], root: ReceivedSpan) -> list[ReceivedSpan]:
    below = children(spans, root)
    return below + [d for child in below for d in descendants(spans, child)]
