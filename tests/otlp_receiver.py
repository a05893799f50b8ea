"""A real OTLP/HTTP trace receiver for tests: an HTTP server on a loopback port that decodes each
`ExportTraceServiceRequest` with opentelemetry-proto and keeps the spans as plain values."""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

__all__ = ["ReceivedLink", "ReceivedSpan", "Receiver", "receiver"]

SERVER = 2  # Span.SpanKind.SPAN_KIND_SERVER
STATUS_ERROR = 2  # Status.StatusCode.STATUS_CODE_ERROR


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


@dataclass(frozen=True)
class ReceivedLink:
    trace_id: str
    span_id: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, ids in hex, times in epoch nanoseconds."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int
    status_message: str
    links: tuple[ReceivedLink, ...]
    resource: dict[str, Any]

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass
class Receiver:
    url: str
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, body: bytes) -> None:
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        with self.lock:
            self.requests += 1
            for resource_spans in export.resource_spans:
                resource = _attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(ReceivedSpan(
                            span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), span.name, span.kind,
                            span.start_time_unix_nano, span.end_time_unix_nano, _attributes(span.attributes),
                            span.status.code, span.status.message,
                            tuple(ReceivedLink(link.trace_id.hex(), link.span_id.hex(), _attributes(link.attributes))
                                  for link in span.links),
                            resource,
                        ))

    def wait_for(self, found: Callable[[list[ReceivedSpan]], Any], timeout_s: float = 10.0) -> Any:
        """`found(spans)` once it is truthy (spans arrive in batches, every 50 ms in these tests)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                spans = list(self.spans)
            result = found(spans)
            if result or time.monotonic() > deadline:
                assert result, f"not received within {timeout_s} s; {len(spans)} spans: {[s.name for s in spans]}"
                return result
            time.sleep(0.05)


def _handler(into: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            encoding = (self.headers.get("content-encoding") or "").lower()
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            into.add(body)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def receiver() -> Iterator[Receiver]:
    """A receiver on a free loopback port, for the length of the block."""
    into = Receiver("")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(into))
    into.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield into
    finally:
        server.shutdown()
        server.server_close()


def text_tree(spans: list[ReceivedSpan], root: ReceivedSpan) -> str:
    """One request's trace as text: its server span, each span under it (phases, a pipeline's
    stages and their items' phases, nested) with its times from the request's start, and the
    batch span each execute phase links to."""
    by_id = {span.span_id: span for span in spans}

    def row(span: ReceivedSpan, prefix: str, name: str) -> str:
        start, end = (span.start_ns - root.start_ns) / 1e6, (span.end_ns - root.start_ns) / 1e6
        status = f"  ERROR: {span.status_message}" if span.status_code == STATUS_ERROR else ""
        return f"{prefix + name:<44}{start:9.3f} → {end:9.3f} ms  {end - start:9.3f} ms{status}"

    lines = [row(root, "", root.name), f"    trace {root.trace_id}, parent {root.parent_id or '(none: a root)'}"]
    shown_batches: set[str] = set()

    def walk(parent: ReceivedSpan, indent: str) -> None:
        below = sorted((s for s in spans if s.parent_id == parent.span_id), key=lambda s: s.start_ns)
        for index, span in enumerate(below):
            last = index == len(below) - 1
            item = span.attributes.get("router.item")
            lines.append(row(span, indent + ("└─ " if last else "├─ "), span.name if item is None else f"{span.name} #{item}"))
            deeper = indent + ("   " if last else "│  ")
            for link in span.links:
                batch = by_id.get(link.span_id)
                if batch is None:
                    continue
                if batch.span_id in shown_batches:
                    lines.append(f"{deeper}  ⇢ {batch.name} (linked, as above)")
                    continue
                shown_batches.add(batch.span_id)
                shown = ", ".join(f"{k.removeprefix('router.')}={v}" for k, v in sorted(batch.attributes.items()))
                served = ", ".join(str(other.attributes.get("router.request_id")) for other in batch.links)
                lines.extend([row(batch, f"{deeper}  ⇢ ", f"{batch.name} (linked)"), f"{deeper}      {shown}",
                              f"{deeper}      served: {served}"])
            walk(span, deeper)

    walk(root, "")
    return "\n".join(lines)
