"""Tracing against a real server exporting OTLP over HTTP to a real receiver in the test: each
request's server span and its phases, the batch span linked to every request it served, a
client's `traceparent` as the parent, errors (504, 503) as error spans with their reason, and
trace ids on the log lines. Timestamps are checked against the test's own clock and against the
batches the scripted plugin records (time.monotonic, one clock for the host)."""

from __future__ import annotations

import itertools
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

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

    spans = otlp.wait_for(lambda got: got if all(server_span(got, r) for r in ids)
                          and len([s for s in got if s.name == "batch"]) >= len(batches) else None)
    by_id = {rid: server_span(spans, rid) for rid in ids}
    for rid, span in by_id.items():
        assert span is not None
        check_request_trace(spans, span, sent[rid], next(b for b in batches if rid in b["ids"]))  # type: ignore[operator]
    check_batches(spans, batches, by_id)  # type: ignore[arg-type]

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
    assert [p.name for p in children(otlp.spans, span)] == ["receive"]  # refused while it was read


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
    assert "OTEL_EXPORTER_OTLP_ENDPOINT is set" in done.stderr and "pip install 'model-router[tracing]'" in done.stderr


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
