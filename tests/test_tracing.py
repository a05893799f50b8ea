"""Tracing without HTTP: turning it on from the environment, the OpenTelemetry implementation on a
real SDK exporting to memory, and the runtime recording a request's phases and its batch."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, DEFAULT_ON, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode

from router.errors import ConfigError, DeadlineExceeded, ModelError, QueueFull
from router.logs import JsonFormatter, trace_id_var
from router.tracing import SpanRef, tracing_from_environment
from router.tracing.otel import BatchSampler, OtelRequestSpan, OtelTracing, trace_context
from tests.conftest import REPO
from tests.test_runtime import ask, busy, make_runtime, one_at_a_time, running, until

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """An environment without OTEL_* variables, to set some in."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    yield monkeypatch


def in_memory(sampler: Sampler = DEFAULT_ON) -> tuple[OtelTracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=BatchSampler(sampler), shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return OtelTracing(provider), exporter


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def phases_of(exporter: InMemorySpanExporter, server: ReadableSpan) -> list[ReadableSpan]:
    assert server.context is not None
    return sorted((s for s in exporter.get_finished_spans()
                   if s.parent is not None and s.parent.span_id == server.context.span_id),
                  key=lambda s: s.start_time or 0)


# -- on, off, and the environment -------------------------------------------------------------


def test_tracing_is_off_unless_an_otlp_endpoint_is_set(otel_env: pytest.MonkeyPatch) -> None:
    assert tracing_from_environment() is None
    otel_env.setenv("OTEL_TRACES_SAMPLER", "always_on")  # a sampler alone exports nothing
    assert tracing_from_environment() is None
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    for variable, value in (("OTEL_SDK_DISABLED", "true"), ("OTEL_TRACES_EXPORTER", "none")):
        otel_env.setenv(variable, value)
        assert tracing_from_environment() is None, variable
        otel_env.delenv(variable)
    tracing = tracing_from_environment()
    assert isinstance(tracing, OtelTracing)
    tracing.shutdown()


@pytest.mark.parametrize(("variable", "value"), [("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                                                 ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"),
                                                 ("OTEL_TRACES_EXPORTER", "console")])
def test_an_exporter_other_than_otlp_over_http_is_refused_naming_the_variable(
    otel_env: pytest.MonkeyPatch, variable: str, value: str,
) -> None:
    otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    otel_env.setenv(variable, value)
    with pytest.raises(ConfigError, match=f"{variable}='{value}' is not supported"):
        tracing_from_environment()


def test_the_sdk_reads_sampler_service_name_and_endpoint_from_the_environment(otel_env: pytest.MonkeyPatch) -> None:
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    otel_env.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    otel_env.setenv("OTEL_TRACES_SAMPLER_ARG", "0.01")
    tracing = tracing_from_environment()
    assert isinstance(tracing, OtelTracing)
    try:
        assert "ParentBased{root:TraceIdRatioBased{0.01}" in tracing.describe()
        assert "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:9" in tracing.describe()
        assert tracing.provider.resource.attributes["service.name"] == "model-router"  # unless the variable says
    finally:
        tracing.shutdown()
    otel_env.setenv("OTEL_SERVICE_NAME", "vision-edge")
    tracing = tracing_from_environment()
    assert isinstance(tracing, OtelTracing)
    assert tracing.provider.resource.attributes["service.name"] == "vision-edge"
    tracing.shutdown()


def test_tracing_off_imports_no_opentelemetry() -> None:
    """The request path, the app and the command import no OpenTelemetry module while tracing is off."""
    code = ("import sys, router.cli, router.http.app, router.http.server, router.serving.runtime; "
            "from router.tracing import tracing_from_environment; assert tracing_from_environment() is None; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_log_lines_carry_the_trace_id_while_it_is_set() -> None:
    record = logging.LogRecord("router.access", logging.INFO, __file__, 1, "request", None, None)
    assert "trace_id" not in json.loads(JsonFormatter().format(record))
    token = trace_id_var.set(TRACE)
    try:
        assert json.loads(JsonFormatter().format(record))["trace_id"] == TRACE
    finally:
        trace_id_var.reset(token)


# -- the OpenTelemetry implementation ---------------------------------------------------------


def test_a_client_traceparent_is_the_parent_and_the_answer_names_the_server_span() -> None:
    tracing, exporter = in_memory()
    headers = [(b"traceparent", f"00-{TRACE}-{PARENT}-01".encode()), (b"tracestate", b"vendor=abc")]
    span = tracing.start_request("POST", "/models/m/predict", headers, time.monotonic())
    span.end(200, time.monotonic(), "/models/{name:str}/predict")
    [server] = exporter.get_finished_spans()
    assert server.context is not None and server.parent is not None
    assert (f"{server.context.trace_id:032x}", f"{server.parent.span_id:016x}") == (TRACE, PARENT)
    assert server.kind is SpanKind.SERVER and server.name == "POST /models/{name}/predict"
    assert server.attributes is not None and server.attributes["http.route"] == "/models/{name}/predict"
    echoed = dict(span.response_headers())
    assert echoed[b"traceparent"] == f"00-{TRACE}-{server.context.span_id:016x}-01".encode()
    assert echoed[b"tracestate"] == b"vendor=abc"


W3C_FIELDS = frozenset({"traceparent", "tracestate", "baggage"})


@pytest.mark.parametrize(("fields", "kept"), [
    ([("traceparent", "00-x"), ("cookie", "c"), ("baggage", "a=1")], {"traceparent": ["00-x"], "baggage": ["a=1"]}),
    ([("baggage", "k=" + "v" * 8190)], {"baggage": ["k=" + "v" * 8190]}),  # 8,192: W3C's most
    ([("baggage", "k=" + "v" * 8191)], {}),
    ([("baggage", ",".join(f"m{i}=v" for i in range(64)))], {"baggage": [",".join(f"m{i}=v" for i in range(64))]}),
    ([("baggage", ",".join(f"m{i}=v" for i in range(65)))], {}),  # W3C: at most 64 members
    ([("tracestate", "v=" + "x" * 511)], {}),  # W3C: 512 characters propagated
    ([("tracestate", ",".join(f"v{i}=x" for i in range(33)))], {}),  # and 32 members
    ([("tracestate", "a=1"), ("tracestate", "b=2")], {"tracestate": ["a=1", "b=2"]}),  # several lines: one list
    ([("traceparent", "00-x"), ("traceparent", "00-y")], {}),  # one traceparent, or none
    ([("traceparent", "0" * 513)], {}),
])
def test_a_callers_trace_context_is_bounded_before_a_propagator_reads_it(
    fields: list[tuple[str, str]], kept: dict[str, list[str]],
) -> None:
    assert trace_context(fields, W3C_FIELDS) == kept


def test_what_a_propagator_says_of_a_callers_context_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Malformed baggage members under the bounds: the propagator would warn, quoting each one."""
    tracing, exporter = in_memory()
    baggage = ",".join(f"bad key {i}=" + "v" * 100 for i in range(60)).encode()
    with caplog.at_level(logging.DEBUG):
        span = tracing.start_request("POST", "/models/m/predict", [(b"traceparent", f"00-{TRACE}-{PARENT}-01".encode()),
                                                                 (b"baggage", baggage)], time.monotonic())
        span.end(200, time.monotonic())
        logging.getLogger("opentelemetry.baggage.propagation").warning("outside a caller's context: kept")
    [server] = exporter.get_finished_spans()
    assert server.parent is not None and f"{server.parent.span_id:016x}" == PARENT  # the traceparent still counts
    assert [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry")] == [
        "outside a caller's context: kept"]


def test_an_unsampled_request_records_nothing_and_says_so_downstream() -> None:
    tracing, exporter = in_memory()
    span = tracing.start_request("POST", "/models/m/predict", [(b"traceparent", f"00-{TRACE}-{PARENT}-00".encode())],
                                 time.monotonic())
    assert not span.recording and span.phases() is None and span.trace_id == TRACE
    traceparent = dict(span.response_headers())[b"traceparent"].decode()
    assert traceparent.startswith(f"00-{TRACE}-") and traceparent.endswith("-00")
    span.end(200, time.monotonic())
    assert exporter.get_finished_spans() == ()


def test_an_unsampled_request_of_no_callers_trace_has_no_trace_id_to_log_or_answer() -> None:
    """Its trace exists nowhere: no id on its log lines, no traceparent back (and no cost for them)."""
    tracing, exporter = in_memory(ParentBased(TraceIdRatioBased(0.0)))
    span = tracing.start_request("POST", "/models/m/predict", [(b"host", b"x")], time.monotonic())
    assert not span.recording and span.trace_id is None and span.response_headers() == []
    span.end(503, time.monotonic())
    assert exporter.get_finished_spans() == ()


def test_phases_are_spans_that_tile_their_request_with_explicit_times() -> None:
    tracing, exporter = in_memory()
    t0 = time.monotonic() - 1.0  # phases are made after the fact, from recorded timestamps
    span = tracing.start_request("POST", "/models/m/predict", [], t0)
    phases = span.phases()
    assert phases is not None
    phases.enter("receive", t0)
    phases.enter("admission", t0 + 0.1)
    phases.enter("queue wait", t0 + 0.3, **{"router.queue": "m"})
    phases.leave(t0 + 0.6, DeadlineExceeded("deadline passed after 600 ms in the queue"))
    span.fail(DeadlineExceeded("deadline passed after 600 ms in the queue"))
    span.end(504, t0 + 0.7)
    [server] = named(exporter, "POST")
    got = phases_of(exporter, server)
    assert [p.name for p in got] == ["receive", "admission", "queue wait"]
    assert [(p.start_time, p.end_time) for p in got] == [
        (tracing.ns(t0), tracing.ns(t0 + 0.1)), (tracing.ns(t0 + 0.1), tracing.ns(t0 + 0.3)),
        (tracing.ns(t0 + 0.3), tracing.ns(t0 + 0.6))]
    assert server.start_time == tracing.ns(t0) and server.end_time == tracing.ns(t0 + 0.7)
    assert abs((server.start_time or 0) - (time.time_ns() - 1_000_000_000)) < 100_000_000  # epoch time, a second ago
    failed = got[-1]
    assert failed.status.status_code is StatusCode.ERROR and "600 ms in the queue" in (failed.status.description or "")
    assert failed.attributes is not None and failed.attributes["error.type"] == "DeadlineExceeded"
    assert failed.attributes["router.queue"] == "m"
    assert got[0].status.status_code is StatusCode.UNSET
    assert server.status.status_code is StatusCode.ERROR and "600 ms" in (server.status.description or "")


def test_a_4xx_is_not_a_server_error_but_names_its_type_and_a_5xx_without_an_error_names_its_status() -> None:
    tracing, exporter = in_memory()
    refused = tracing.start_request("POST", "/models/m/predict", [], time.monotonic())
    refused.fail(QueueFull("queue is full"))
    refused.end(413, time.monotonic())  # the client's mistake
    bare = tracing.start_request("GET", "/x", [], time.monotonic())
    bare.end(502, time.monotonic())
    client, server = sorted(exporter.get_finished_spans(), key=lambda s: s.name, reverse=True)
    assert client.status.status_code is StatusCode.UNSET and client.attributes is not None
    assert client.attributes["error.type"] == "QueueFull" and client.attributes["http.response.status_code"] == 413
    assert server.status.status_code is StatusCode.ERROR and server.status.description == "HTTP 502"


def test_the_phases_still_open_when_the_request_ends_end_with_it_and_its_error() -> None:
    tracing, exporter = in_memory()
    span = tracing.start_request("POST", "/v2/models/m/infer", [], time.monotonic())
    main, item = span.phases(), span.phases(item=1)
    assert main is not None and item is not None
    main.enter("items", time.monotonic())
    item.enter("preprocess", time.monotonic())
    span.fail(ModelError("model 'm' failed"))
    span.end(500, time.monotonic())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["preprocess"].attributes is not None and spans["preprocess"].attributes["router.item"] == 1
    assert spans["preprocess"].status.status_code is StatusCode.ERROR
    assert spans["items"].end_time == spans["POST"].end_time


def test_without_a_time_a_phase_starts_where_the_last_one_ended() -> None:
    tracing, exporter = in_memory()
    t0 = time.monotonic()
    span = tracing.start_request("POST", "/p", [], t0)
    phases = span.phases()
    assert phases is not None
    phases.enter("postprocess", t0)
    phases.leave(t0 + 0.2)
    phases.enter("respond")
    span.end(200, t0 + 0.5)
    respond = named(exporter, "respond")[0]
    assert (respond.start_time, respond.end_time) == (tracing.ns(t0 + 0.2), tracing.ns(t0 + 0.5))


def test_a_batch_that_served_a_sampled_request_is_sampled_whatever_the_sampler() -> None:
    tracing, exporter = in_memory(ALWAYS_OFF)
    assert not tracing.start_request("POST", "/p", [], time.monotonic()).recording  # ALWAYS_OFF decides requests
    sampled = in_memory()[0].start_request("POST", "/p", [], time.monotonic())  # sampled elsewhere (a front)
    assert sampled.ref is not None
    batch = tracing.start_batch([(sampled.ref, "r1")], time.monotonic(), {"router.batch.size": 1})
    batch.end(time.monotonic(), "model 'm' failed")
    [span] = exporter.get_finished_spans()
    assert span.name == "batch" and span.parent is None and span.status.status_code is StatusCode.ERROR
    assert [(link.context.trace_id, link.context.span_id) for link in span.links] == [
        (sampled.ref.trace_id, sampled.ref.span_id)]
    assert span.links[0].attributes == {"router.request_id": "r1"}


def test_a_grpc_call_span_reads_its_parent_from_metadata_and_its_status_is_the_grpc_code() -> None:
    tracing, exporter = in_memory()
    ok = tracing.start_call("inference.GRPCInferenceService/ModelInfer",
                            [("traceparent", f"00-{TRACE}-{PARENT}-01"), ("x-request-id", "a")], time.monotonic())
    ok.end(200, time.monotonic())
    missing = tracing.start_call("inference.GRPCInferenceService/ModelInfer", [], time.monotonic())
    missing.fail(ModelError("no model named 'x'"))
    missing.end(404, time.monotonic())  # the client's: NOT_FOUND is no server error
    full = tracing.start_call("inference.GRPCInferenceService/ModelInfer", [], time.monotonic())
    full.fail(QueueFull("queue of model 'm' is full"))
    full.end(503, time.monotonic())
    first, second, third = sorted(exporter.get_finished_spans(), key=lambda s: s.start_time or 0)
    assert first.kind is SpanKind.SERVER and first.name == "inference.GRPCInferenceService/ModelInfer"
    assert first.parent is not None and (f"{first.parent.trace_id:032x}", f"{first.parent.span_id:016x}") == (TRACE, PARENT)
    assert first.attributes == {"rpc.system": "grpc", "rpc.service": "inference.GRPCInferenceService",
                                "rpc.method": "ModelInfer", "rpc.grpc.status_code": 0}
    assert dict(ok.response_headers())[b"traceparent"].startswith(f"00-{TRACE}-".encode())
    assert second.attributes is not None and second.attributes["rpc.grpc.status_code"] == 5
    assert second.status.status_code is StatusCode.UNSET
    assert third.attributes is not None and third.attributes["rpc.grpc.status_code"] == 14
    assert third.status.status_code is StatusCode.ERROR and third.status.description == "queue of model 'm' is full"


def test_a_stage_is_a_span_beside_its_path_with_paths_of_its_own_and_ends_with_the_request() -> None:
    tracing, exporter = in_memory()
    t0 = time.monotonic()
    span = tracing.start_request("POST", "/models/p/predict", [], t0)
    path = span.phases(item=2)
    assert path is not None
    stage = path.stage("step 0:m", t0 + 0.1, **{"router.step": "0:m"})
    stage.stage("step 0:m/0:n", t0 + 0.2)  # never ended by its owner
    item = stage.phases(0)
    item.enter("queue wait", t0 + 0.1)
    item.leave(t0 + 0.3)
    stage.end(t0 + 0.4)
    stage.end(t0 + 0.9)  # once only
    span.fail(ModelError("model 'n' failed"))
    span.end(500, t0 + 0.5)  # the inner stage, never ended, ends with the request and its error
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["step 0:m"].parent.span_id == spans["POST"].context.span_id  # type: ignore[union-attr]
    assert spans["step 0:m"].attributes == {"router.step": "0:m", "router.item": 2}
    assert spans["step 0:m"].end_time == tracing.ns(t0 + 0.4)
    assert spans["queue wait"].parent.span_id == spans["step 0:m"].context.span_id  # type: ignore[union-attr]
    assert item.ref == SpanRef(spans["step 0:m"].context.trace_id, spans["step 0:m"].context.span_id)  # type: ignore[union-attr]
    assert spans["step 0:m/0:n"].parent.span_id == spans["step 0:m"].context.span_id  # type: ignore[union-attr]
    assert spans["step 0:m/0:n"].end_time == tracing.ns(t0 + 0.5)
    assert spans["step 0:m/0:n"].status.status_code is StatusCode.ERROR


# -- the runtime recording a request's path -----------------------------------------------------


def traced(tracing: OtelTracing, request_id: str) -> OtelRequestSpan:
    span = tracing.start_request("POST", "/models/m/predict", [], time.monotonic())
    span.describe(**{"router.request_id": request_id})
    return span


def request_span(exporter: InMemorySpanExporter, request_id: str) -> ReadableSpan:
    return next(s for s in exporter.get_finished_spans()
                if s.attributes is not None and s.attributes.get("router.request_id") == request_id)


async def test_the_runtime_records_each_phase_and_the_batch_links_every_request_it_served(tmp_path: Path) -> None:
    tracing, exporter = in_memory()
    fleet = ("models:\n  m: {plugin: scripted, options: {fixed_ms: 5, per_item_bytes: 100, fixed_bytes: 7}, "
             "batch: {max_size: 4, max_delay_ms: 100}}\n")
    spans = {rid: traced(tracing, rid) for rid in ("a", "b", "c")}
    async with running(make_runtime(tmp_path, fleet, tracing=tracing)) as runtime:
        answers = await asyncio.gather(*(runtime.submit("m", ask(rid), request_id=rid, trace=span.phases())
                                         for rid, span in spans.items()))
    for span in spans.values():
        span.end(200, time.monotonic())
        assert span.ref is not None
    assert [a.batch_size for a in answers] == [3, 3, 3]
    [batch] = named(exporter, "batch")
    assert batch.attributes == {"router.model": "m", "router.instance": "m/0", "router.device": "cpu",
                                "router.batch.size": 3, "router.batch.memory_reserved_bytes": 7 + 3 * 100}
    assert {(link.context.span_id, link.attributes["router.request_id"]) for link in batch.links  # type: ignore[index]
            } == {(span.ref.span_id, rid) for rid, span in spans.items()}
    for rid in spans:
        phases = phases_of(exporter, request_span(exporter, rid))
        assert [p.name for p in phases] == ["admission", "preprocess", "queue wait", "execute", "postprocess"]
        execute = phases[3]
        assert execute.attributes is not None and execute.attributes["router.batch.size"] == 3
        assert batch.context is not None and [link.context.span_id for link in execute.links] == [batch.context.span_id]
        assert batch.start_time == execute.start_time and execute.end_time <= batch.end_time  # type: ignore[operator]
        for before, after in itertools.pairwise(phases):
            assert before.end_time == after.start_time


async def test_a_request_whose_deadline_passes_in_the_queue_ends_its_queue_wait_with_the_504(tmp_path: Path) -> None:
    tracing, exporter = in_memory()
    span = traced(tracing, "late")
    async with running(make_runtime(tmp_path, one_at_a_time(300, tmp_path / "batches.jsonl"), tracing=tracing)) as runtime:
        first = asyncio.create_task(runtime.submit("m", ask("busy")))
        await until(lambda: busy(runtime))
        with pytest.raises(DeadlineExceeded) as error:
            await runtime.submit("m", ask("late"), timeout_ms=50, request_id="late", trace=span.phases())
        await first
    span.fail(error.value)
    span.end(504, time.monotonic())
    phases = phases_of(exporter, request_span(exporter, "late"))
    assert [p.name for p in phases] == ["admission", "preprocess", "queue wait"]
    assert phases[-1].status.status_code is StatusCode.ERROR and "in the queue" in (phases[-1].status.description or "")
    assert named(exporter, "batch") == []  # "busy" was not sampled: its batch has no span


async def test_a_failed_batch_fails_its_span_and_the_execute_phase(tmp_path: Path) -> None:
    tracing, exporter = in_memory()
    fleet = "models:\n  m: {plugin: scripted, options: {fail: marked}, batch: {max_size: 1}}\n"
    span = traced(tracing, "fail-1")
    async with running(make_runtime(tmp_path, fleet, tracing=tracing)) as runtime:
        with pytest.raises(ModelError):
            await runtime.submit("m", ask("fail-1"), request_id="fail-1", trace=span.phases())
    span.end(500, time.monotonic())
    phases = phases_of(exporter, request_span(exporter, "fail-1"))
    assert [p.name for p in phases] == ["admission", "preprocess", "queue wait", "execute"]
    [batch] = named(exporter, "batch")
    for failed in (phases[-1], batch):
        assert failed.status.status_code is StatusCode.ERROR and "scripted failure" in (failed.status.description or "")


async def test_a_request_for_a_model_not_loaded_yet_has_a_wait_for_load_phase(tmp_path: Path) -> None:
    tracing, exporter = in_memory()
    fleet = "models:\n  m: {plugin: scripted, residency: on_demand, options: {load_ms: 100}, batch: {max_size: 1}}\n"
    span = traced(tracing, "cold")
    async with running(make_runtime(tmp_path, fleet, tracing=tracing)) as runtime:
        await runtime.submit("m", ask("cold"), request_id="cold", trace=span.phases())
    span.end(200, time.monotonic())
    phases = phases_of(exporter, request_span(exporter, "cold"))
    assert [p.name for p in phases][:3] == ["admission", "wait for load", "preprocess"]
    wait = phases[1]
    assert (wait.end_time or 0) - (wait.start_time or 0) >= 100_000_000  # the load's own 100 ms
