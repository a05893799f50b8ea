"""What tracing costs, for `make bench`: the no-op model (the scripted plugin, no work at all, so
the router's own work is all there is), closed loop at saturation, on four servers side by side:

- `before`: the router as it was before tracing existed (its package from git, `BASE_COMMIT`);
- `off`: this router, tracing off (no OTEL_EXPORTER_OTLP_ENDPOINT);
- `1%`: tracing on, OTEL_TRACES_SAMPLER=parentbased_traceidratio at 0.01;
- `100%`: tracing on, every request sampled.

The traced servers export OTLP over HTTP to a receiver in this process, which decodes and counts
the spans (the SDK's defaults otherwise: a batch span processor exporting every 5 s, its queue
raised so that none is dropped). All four
servers run at once and are measured in turns, each round in another order, so that other work
on the machine falls on all of them alike; the figures are medians of each round's ratio.

    python -m benchmarks.tracing [--seconds 8] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import psutil

from benchmarks.systems import Server, launch, serve_router
from benchmarks.workloads import REPO, Workload
from tests.otlp_receiver import Receiver, receiver

__all__ = ["BASE_COMMIT", "tracing_overhead"]

#: The last commit without tracing: the `before` server runs its router package.
BASE_COMMIT = "39349539030b760e5ad0e2b2e225bae045d455fd"
NOOP = Workload("noop", "scripted", {"stdlib_json": True}, max_batch=8, max_delay_ms=0, content_type="application/json",
                body=b'{"id": "bench"}', queue_size=256)
CONCURRENCY = 32
SAMPLERS = {"1%": {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"},
            "100%": {"OTEL_TRACES_SAMPLER": "parentbased_always_on"}}
SERVER_KIND = 2  # OTLP's SPAN_KIND_SERVER
#: Spans the traced servers may hold for export: the SDK's 2048 drops some at 100% on a busy
#: machine, and a dropped span is one not paid for.
QUEUE = 65536


def _untraced_environment() -> None:
    """Whatever the harness was started with, the servers decide tracing only from what is set here."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            del os.environ[name]


def _base_tree(scratch: Path) -> Path | None:
    """The router package as of BASE_COMMIT, extracted with `git archive` (None without git or the commit)."""
    tree = scratch / "before-tracing"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    try:
        archive = subprocess.run(["git", "archive", BASE_COMMIT, "router"], cwd=REPO, capture_output=True, check=True,
                                 timeout=60)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return tree


@contextmanager
def _serve_before(tree: Path, scratch: Path) -> Iterator[Server]:
    """The old router package: run from its own directory, which `python -m` puts first on the path."""
    from benchmarks.systems import free_port

    port = free_port()
    config = scratch / f"fleet-noop-before-{port}.yaml"
    config.write_text(NOOP.fleet_yaml(scratch), encoding="utf-8")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MODEL_ROUTER_HOST": "127.0.0.1", "MODEL_ROUTER_PORT": str(port),
           "MODEL_ROUTER_CONFIG": str(config), "PYTHONPATH": str(tree)}
    with launch("router", [sys.executable, "-m", "router", "serve"], env, port, "/models", "/health/ready",
                scratch / f"router-before-{port}.log", 120, cwd=tree) as server:
        yield server


def _servers(stack: ExitStack, otlp: Receiver, scratch: Path) -> dict[str, Server]:
    servers: dict[str, Server] = {}
    tree = _base_tree(scratch)
    if tree is not None:
        servers["before"] = stack.enter_context(_serve_before(tree, scratch))
    servers["off"] = stack.enter_context(serve_router(NOOP.fleet_yaml(scratch), scratch))
    for label, sampler in SAMPLERS.items():
        servers[label] = stack.enter_context(serve_router(
            NOOP.fleet_yaml(scratch), scratch,
            env_extra={"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url, "OTEL_SERVICE_NAME": f"router-{label}",
                       "OTEL_BSP_MAX_QUEUE_SIZE": str(QUEUE), **sampler}))
    return servers


def _cpu_seconds(pid: int) -> float:
    process = psutil.Process(pid)
    total = 0.0
    for each in [process, *process.children(recursive=True)]:
        times = each.cpu_times()
        total += times.user + times.system
    return total


def _ratios(values: dict[str, list[float]], over: str) -> dict[str, float]:
    """Median over rounds of each contender's figure ÷ `over`'s in the same round."""
    return {label: round(statistics.median(a / b for a, b in zip(figures, values[over], strict=True) if b), 3)
            for label, figures in values.items() if label != over}


def span_costs(requests: int = 4000, batch: int = 8) -> dict[str, float]:
    """CPU microseconds per request of the tracing code alone, in this process: what the router does
    for an unsampled request (sampling decision, trace id, `traceparent` out) and for a sampled one
    (its server span, eight phases, its share of a batch span, encoded as the OTLP exporter does)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import DEFAULT_ON, ParentBased, TraceIdRatioBased

    from router.tracing.otel import BatchSampler, OtelTracing

    class Encoding(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            encode_spans(spans).SerializeToString()
            return SpanExportResult.SUCCESS

    headers = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"), (b"content-length", b"15")]
    costs: dict[str, float] = {}
    for label, sampler in (("unsampled", ParentBased(TraceIdRatioBased(0.0))), ("sampled", DEFAULT_ON)):
        provider = TracerProvider(sampler=BatchSampler(sampler), shutdown_on_exit=False)
        provider.add_span_processor(BatchSpanProcessor(Encoding(), max_queue_size=1 << 20))
        tracing = OtelTracing(provider)
        started = time.process_time()  # every thread of the process: the processor's exporting one too
        for first in range(0, requests, batch):
            spans = [_one_request(tracing, headers) for _ in range(min(batch, requests - first))]
            refs = [(span.ref, "r") for span in spans if span.recording]
            if refs:
                tracing.start_batch(refs, time.monotonic(), {"router.batch.size": len(refs)}).end(time.monotonic())
        provider.force_flush()
        costs[label] = round((time.process_time() - started) * 1e6 / requests, 1)
        provider.shutdown()
    return costs


def _one_request(tracing: Any, headers: list[tuple[bytes, bytes]]) -> Any:
    """What the middleware, the handler and the runtime do for one traced request."""
    span = tracing.start_request("POST", "/models/noop/predict", headers, time.monotonic())
    phases = span.phases()
    if phases is not None:
        for phase in ("receive", "admission", "preprocess", "queue wait", "execute", "postprocess"):
            phases.enter(phase, time.monotonic())
        phases.leave(time.monotonic())
        phases.enter("respond")
        span.describe(**{"router.request_id": "r", "router.model": "noop", "router.batch_size": 8})
    span.response_headers()
    span.end(200, time.monotonic(), "/models/{name:str}/predict")
    return span


def tracing_overhead(scratch: Path, seconds: float, rounds: int, warm_s: float = 2.0) -> dict[str, Any]:
    """Throughput and the server's CPU per request for each contender, round by round, with their ratios."""
    from benchmarks.run import closed  # the harness's load generator (run.py imports this module in turn)

    _untraced_environment()
    scratch.mkdir(parents=True, exist_ok=True)
    target = f"/models/noop/predict={NOOP.content_type}:{NOOP.body.decode()}"
    rps: dict[str, list[float]] = {}
    cpu_ms: dict[str, list[float]] = {}
    answered: dict[str, int] = {}
    with receiver() as otlp, ExitStack() as stack:
        servers = _servers(stack, otlp, scratch)
        for label, server in servers.items():
            warm = closed(server, target, 2, warm_s)  # first requests pay for lazy imports
            answered[label] = warm["statuses"].get("200", 0)
        labels = list(servers)
        for round_ in range(rounds):
            for label in labels[round_ % len(labels):] + labels[:round_ % len(labels)]:
                before = _cpu_seconds(servers[label].process.pid)
                report = closed(servers[label], target, CONCURRENCY, seconds)
                spent = _cpu_seconds(servers[label].process.pid) - before
                ok = report["statuses"].get("200", 0)
                rps.setdefault(label, []).append(report["throughput_rps"])
                cpu_ms.setdefault(label, []).append(round(1000 * spent / max(1, ok), 4))
                answered[label] = answered.get(label, 0) + ok
                print(f"[tracing] round {round_} {label}: {report['throughput_rps']} rps, "
                      f"{cpu_ms[label][-1]} ms CPU per request, {report['statuses']}", flush=True)
        received = _exported(otlp, answered["100%"])
        spans = len(otlp.spans)
    return {"workload": "no-op model (the scripted plugin, batches of up to 8, no delay)", "concurrency": CONCURRENCY,
            "seconds": seconds, "rounds": rounds, "base_commit": BASE_COMMIT if "before" in rps else None,
            "rps": rps, "cpu_ms_per_request": cpu_ms,
            "median_rps": {k: round(statistics.median(v), 1) for k, v in rps.items()},
            "median_cpu_ms_per_request": {k: round(statistics.median(v), 4) for k, v in cpu_ms.items()},
            "rps_ratio_to_off": _ratios(rps, "off"), "cpu_ratio_to_off": _ratios(cpu_ms, "off"),
            "cpu_off_over_before": _ratios(cpu_ms, "before").get("off") if "before" in cpu_ms else None,
            "answered": answered, "requests_traced": received, "spans_received": spans,
            "span_cost_us_per_request": span_costs()}


def _exported(otlp: Receiver, expected: int, quiet_s: float = 6.0) -> dict[str, int]:
    """Server spans received by contender, once the 100% server's `expected` are in or nothing has
    come for `quiet_s` (longer than the SDK's 5 s export delay): a span dropped by a full queue never comes."""
    last, still_since = -1, time.monotonic()
    while True:
        with otlp.lock:
            counts = _requests_traced(otlp.spans)
        total = sum(counts.values())
        if total != last:
            last, still_since = total, time.monotonic()
        if counts.get("100%", 0) >= expected or time.monotonic() - still_since > quiet_s:
            return counts
        time.sleep(0.5)


def _requests_traced(spans: list[Any]) -> dict[str, int]:
    """Server spans received, by contender (each exports under its own service name)."""
    counts: dict[str, int] = {}
    for span in spans:
        if span.kind == SERVER_KIND:
            label = str(span.resource.get("service.name", "")).removeprefix("router-")
            counts[label] = counts.get(label, 0) + 1
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--scratch", type=Path, default=REPO / "benchmarks" / "results" / "scratch-tracing")
    args = parser.parse_args(argv)
    print(json.dumps(tracing_overhead(args.scratch, args.seconds, args.rounds), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
