"""The tracing interface (`router.tracing.api`) on the OpenTelemetry SDK: the one module of the
router that imports OpenTelemetry.

Everything is configured the OpenTelemetry way, by the SDK reading its own OTEL_* variables: the
OTLP/HTTP exporter (endpoint, headers, timeout, compression, certificates), the batch span
processor (OTEL_BSP_*), the sampler (OTEL_TRACES_SAMPLER, _ARG), the resource (OTEL_SERVICE_NAME,
OTEL_RESOURCE_ATTRIBUTES) and the propagators (OTEL_PROPAGATORS). The router adds one rule to the
sampler: a batch that served a sampled request is sampled too.

A caller's trace context is bounded before a propagator reads it (`trace_context`): a field longer
than W3C allows is dropped whole, as if it was not sent, and what the propagators log about a
caller's malformed context while they read it is dropped too (W3C: a vendor ignores what it cannot
parse). A client could otherwise have every request write its 60 KB `baggage` into the log.
"""

from __future__ import annotations

import contextvars
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState
from opentelemetry.util.types import Attributes

from router import __version__
from router.errors import grpc_code
from router.tracing.api import ENDPOINT_VARIABLES, AttributeValue, Headers, Metadata, SpanRef

__all__ = ["BatchSampler", "OtelTracing", "trace_context"]

#: Litestar's path template with its converters (`/models/{name:str}/predict`) as OpenTelemetry's route.
_CONVERTER = re.compile(r"\{(\w+):\w+\}")
#: gRPC's status codes by name, as numbers (`rpc.grpc.status_code`), and those that are a server's error.
GRPC_CODE_NUMBERS: Final = {name: number for number, name in enumerate((
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
    "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"))}
SERVER_ERROR_CODES: Final = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE",
                                       "DATA_LOSS"})


#: The most a caller's trace context field may hold, in characters (latin-1: one a byte), and in
#: list-members: W3C Trace Context (one traceparent of at most 512 characters, as OpenTelemetry's;
#: tracestate: 512 characters propagated, 32 members) and W3C Baggage (8,192 bytes, 64 members).
#: A longer field is dropped whole; so is any other propagator's (OTEL_PROPAGATORS: b3, jaeger)
#: over `OTHER_FIELD_CHARS`.
FIELD_BOUNDS: Final = {"traceparent": (512, 1), "tracestate": (512, 32), "baggage": (8192, 64)}
OTHER_FIELD_CHARS: Final = 512
#: The loggers the standard propagators warn on while they read a caller's context.
PROPAGATION_LOGGERS: Final = ("opentelemetry.baggage", "opentelemetry.baggage.propagation", "opentelemetry.trace.span",
                              "opentelemetry.trace.propagation.tracecontext", "opentelemetry.propagators.composite",
                              "opentelemetry.propagate")
_reading_caller: contextvars.ContextVar[bool] = contextvars.ContextVar("reading_caller_context", default=False)


def trace_context(fields: Iterable[tuple[str, str]], wanted: frozenset[str]) -> dict[str, list[str]]:
    """The `wanted` fields (what the propagators read) of a caller's headers or metadata, each
    within `FIELD_BOUNDS` (several values of one field counted as one list, joined by `, `), or
    left out."""
    found: dict[str, list[str]] = {}
    for name, value in fields:
        if name in wanted:
            found.setdefault(name, []).append(value)
    bounded = {}
    for name, values in found.items():
        chars, members = FIELD_BOUNDS.get(name, (OTHER_FIELD_CHARS, None))
        if sum(map(len, values)) + 2 * (len(values) - 1) > chars:
            continue
        if members is not None and sum(value.count(",") + 1 for value in values) > members:
            continue
        bounded[name] = values
    return bounded


class _CallerContextWarnings(logging.Filter):
    """Drops what a propagator logs while it reads a caller's context (the caller's text, quoted)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _reading_caller.get()


_QUIET = _CallerContextWarnings()


def _extract(carrier: dict[str, list[str]]) -> Context:
    """The caller's context from its bounded fields; nothing ambient, nothing logged about it."""
    reading = _reading_caller.set(True)
    try:
        return propagate.extract(carrier, context=Context())
    finally:
        _reading_caller.reset(reading)


class BatchSampler(Sampler):
    """The configured sampler, except for a root span linked to a sampled span (a batch that served
    a sampled request): that one is sampled, so a sampled request never misses its batch."""

    def __init__(self, configured: Sampler) -> None:
        self.configured = configured

    def should_sample(
        self, parent_context: Context | None, trace_id: int, name: str, kind: SpanKind | None = None,
        attributes: Attributes = None, links: Sequence[Link] | None = None, trace_state: TraceState | None = None,
    ) -> SamplingResult:
        parent = trace.get_current_span(parent_context).get_span_context()
        if not parent.is_valid and links and any(link.context.trace_flags.sampled for link in links):
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
        return self.configured.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"BatchSampler{{{self.configured.get_description()}}}"


def _resource() -> Resource:
    """The SDK's resource from the environment, named model-router unless OTEL_SERVICE_NAME says otherwise."""
    resource = Resource({SERVICE_VERSION: __version__}).merge(Resource.create())
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "model-router"}))
    return resource


def _reason(error: BaseException) -> str:
    detail = getattr(error, "detail", None)
    return str(detail) if detail else f"{type(error).__name__}: {error}".rstrip(": ")


def _mark_failed(span: trace.Span, error: BaseException) -> None:
    span.set_status(Status(StatusCode.ERROR, _reason(error)))
    span.set_attribute("error.type", type(error).__name__)


def _linked(ref: SpanRef) -> SpanContext:
    return SpanContext(ref.trace_id, ref.span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))


class OtelTracing:
    """Spans on one TracerProvider. Times are `time.monotonic()` seconds, turned into epoch nanoseconds."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("model-router", __version__)
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        self._fields = frozenset(propagate.get_global_textmap().fields)  # what OTEL_PROPAGATORS read
        self._header_names = frozenset(name.encode("latin-1") for name in self._fields)
        for name in PROPAGATION_LOGGERS:
            if _QUIET not in logging.getLogger(name).filters:
                logging.getLogger(name).addFilter(_QUIET)

    @classmethod
    def from_environment(cls) -> OtelTracing:
        """OTLP over HTTP behind a batch span processor, each configured by the SDK from OTEL_*."""
        configured = TracerProvider(shutdown_on_exit=False).sampler  # OTEL_TRACES_SAMPLER(_ARG), as the SDK reads it
        provider = TracerProvider(sampler=BatchSampler(configured), resource=_resource(), shutdown_on_exit=False)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        return cls(provider)

    def ns(self, at: float) -> int:
        """A monotonic timestamp as epoch nanoseconds."""
        return int(at * 1e9) + self._offset_ns

    def start_request(self, method: str, path: str, headers: Headers, at: float) -> OtelRequestSpan:
        fields = ((name.decode("latin-1"), value.decode("latin-1")) for name, value in headers
                  if name in self._header_names)
        parent = _extract(trace_context(fields, self._fields))
        span = self.tracer.start_span(method, context=parent, kind=SpanKind.SERVER, start_time=self.ns(at),
                                      attributes={"http.request.method": method, "url.path": path})
        return OtelRequestSpan(self, span, method, trace.get_current_span(parent).get_span_context().is_valid)

    def start_call(self, method: str, metadata: Metadata, at: float) -> OtelCallSpan:
        parent = _extract(trace_context(metadata, self._fields))
        service, _, name = method.rpartition("/")
        span = self.tracer.start_span(method, context=parent, kind=SpanKind.SERVER, start_time=self.ns(at),
                                      attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name})
        return OtelCallSpan(self, span, method, trace.get_current_span(parent).get_span_context().is_valid)

    def start_batch(self, requests: Sequence[tuple[SpanRef, str]], at: float,
                    attributes: Mapping[str, AttributeValue]) -> OtelBatchSpan:
        links = [Link(_linked(ref), {"router.request_id": request_id}) for ref, request_id in requests]
        span = self.tracer.start_span("batch", context=Context(), start_time=self.ns(at), attributes=attributes,
                                      links=links)  # a root, always
        return OtelBatchSpan(self, span)

    def describe(self) -> str:
        where = next((f"{name}={os.environ[name]}" for name in ENDPOINT_VARIABLES if os.environ.get(name)), "-")
        return f"on: OTLP over HTTP ({where}), sampler {self.provider.sampler.get_description()}"

    def shutdown(self) -> None:
        self.provider.shutdown()


class OtelPhases:
    """A request's path: the open phase is a name and a start; its span is made when it ends."""

    __slots__ = ("_ended", "_item", "_open", "_owner", "_parent", "_tracing", "ref")

    def __init__(self, owner: OtelRequestSpan, parent: Context, ref: SpanRef, item: int | None) -> None:
        self._owner, self._tracing, self._parent, self.ref, self._item = owner, owner._tracing, parent, ref, item
        self._open: tuple[str, float, SpanRef | None, dict[str, AttributeValue]] | None = None
        self._ended = time.monotonic()

    def enter(self, phase: str, at: float | None = None, *, link: SpanRef | None = None,
              **attributes: AttributeValue) -> None:
        if at is None:
            at = time.monotonic() if self._open is not None else self._ended
        if self._open is not None:
            self._close(at, None)
        self._open = (phase, at, link, attributes)

    def leave(self, at: float, error: BaseException | None = None) -> None:
        if self._open is not None:
            self._close(at, error)

    def stage(self, name: str, at: float, **attributes: AttributeValue) -> OtelStageSpan:
        if self._item is not None:
            attributes["router.item"] = self._item
        return self._owner._stage(self._parent, name, at, attributes)

    def _close(self, at: float, error: BaseException | None) -> None:
        assert self._open is not None
        phase, start, link, attributes = self._open
        self._open, self._ended = None, at
        if self._item is not None:
            attributes["router.item"] = self._item
        tracing = self._tracing
        span = tracing.tracer.start_span(phase, context=self._parent, start_time=tracing.ns(start),
                                         attributes=attributes, links=(Link(_linked(link)),) if link else ())
        if error is not None:
            _mark_failed(span, error)
        span.end(end_time=tracing.ns(max(at, start)))


class OtelRequestSpan:
    """The server span of one request and the phase paths under it. Unsampled, it costs what it must:
    the sampling decision, and a trace id and `traceparent` only for a caller that sent its own."""

    __slots__ = ("_error", "_method", "_paths", "_span", "_stages", "_tracing", "recording", "ref", "trace_id")

    def __init__(self, tracing: OtelTracing, span: trace.Span, method: str, joined: bool) -> None:
        self._tracing, self._span, self._method = tracing, span, method
        context = span.get_span_context()
        self.recording = span.is_recording()
        self.trace_id = f"{context.trace_id:032x}" if self.recording or joined else None
        self.ref = SpanRef(context.trace_id, context.span_id) if self.recording else None
        self._paths: list[OtelPhases] = []
        self._stages: list[OtelStageSpan] = []
        self._error: BaseException | None = None

    def phases(self, item: int | None = None) -> OtelPhases | None:
        if self.ref is None:
            return None
        return self._path(trace.set_span_in_context(self._span), self.ref, item)

    def _path(self, parent: Context, ref: SpanRef, item: int | None) -> OtelPhases:
        path = OtelPhases(self, parent, ref, item)
        self._paths.append(path)
        return path

    def _stage(self, parent: Context, name: str, at: float, attributes: dict[str, AttributeValue]) -> OtelStageSpan:
        span = self._tracing.tracer.start_span(name, context=parent, start_time=self._tracing.ns(at),
                                               attributes=attributes)
        stage = OtelStageSpan(self, span)
        self._stages.append(stage)
        return stage

    def describe(self, **attributes: AttributeValue) -> None:
        if self.recording:
            self._span.set_attributes(attributes)

    def fail(self, error: BaseException) -> None:
        self._error = error

    def end(self, status: int, at: float, route: str | None = None) -> None:
        self._end_parts(at)
        span = self._span
        if self.recording:
            if route:
                route = _CONVERTER.sub(r"{\1}", route)
                span.update_name(f"{self._method} {route}")
                span.set_attribute("http.route", route)
            span.set_attribute("http.response.status_code", status)
            if status >= 400:
                span.set_attribute("error.type", type(self._error).__name__ if self._error else str(status))
            if status >= 500:  # a server span's error, as OpenTelemetry's HTTP conventions say
                span.set_status(Status(StatusCode.ERROR, _reason(self._error) if self._error else f"HTTP {status}"))
        span.end(end_time=self._tracing.ns(at))

    def _end_parts(self, at: float) -> None:
        """What is still open ends with the request: a phase (respond; or the one that failed), a stage."""
        for path in self._paths:
            path.leave(at, self._error)
        for stage in self._stages:
            stage.end(at, self._error)

    def response_headers(self) -> list[tuple[bytes, bytes]]:
        if self.trace_id is None:
            return []
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(self._span))
        return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in carrier.items()]


class OtelCallSpan(OtelRequestSpan):
    """A gRPC call's server span: its status is the gRPC code of the router's status, an error for
    the codes OpenTelemetry's RPC conventions call a server's error."""

    __slots__ = ()

    def end(self, status: int, at: float, route: str | None = None) -> None:
        self._end_parts(at)
        span = self._span
        if self.recording:
            code = grpc_code(status)
            span.set_attribute("rpc.grpc.status_code", GRPC_CODE_NUMBERS[code])
            if code != "OK":
                span.set_attribute("error.type", type(self._error).__name__ if self._error else code)
            if code in SERVER_ERROR_CODES:
                span.set_status(Status(StatusCode.ERROR, _reason(self._error) if self._error else code))
        span.end(end_time=self._tracing.ns(at))


class OtelStageSpan:
    """One stage of a request's path and the paths of phases under it."""

    __slots__ = ("_ended", "_owner", "_span", "ref")

    def __init__(self, owner: OtelRequestSpan, span: trace.Span) -> None:
        self._owner, self._span, self._ended = owner, span, False
        context = span.get_span_context()
        self.ref = SpanRef(context.trace_id, context.span_id)

    def phases(self, item: int | None = None) -> OtelPhases:
        return self._owner._path(trace.set_span_in_context(self._span), self.ref, item)

    def stage(self, name: str, at: float, **attributes: AttributeValue) -> OtelStageSpan:
        return self._owner._stage(trace.set_span_in_context(self._span), name, at, attributes)

    def describe(self, **attributes: AttributeValue) -> None:
        self._span.set_attributes(attributes)

    def end(self, at: float, error: BaseException | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        if error is not None:
            _mark_failed(self._span, error)
        self._span.end(end_time=self._owner._tracing.ns(at))


class OtelBatchSpan:
    __slots__ = ("_span", "_tracing", "ref")

    def __init__(self, tracing: OtelTracing, span: trace.Span) -> None:
        self._tracing, self._span = tracing, span
        context = span.get_span_context()
        self.ref = SpanRef(context.trace_id, context.span_id)

    def end(self, at: float, error: str | None = None) -> None:
        if error is not None:
            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end(end_time=self._tracing.ns(at))
