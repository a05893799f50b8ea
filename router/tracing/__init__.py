"""Request tracing: the interface the request path calls (`router.tracing.api`), the decision to
trace from the environment (`router.tracing.environment`), and the one implementation, on the
OpenTelemetry SDK (`router.tracing.otel`), the only module that imports OpenTelemetry. With
tracing off nothing here is built and the request path checks one None."""

from router.tracing.api import BatchSpan, Phases, RequestSpan, SpanRef, Tracing
from router.tracing.environment import tracing_from_environment

__all__ = ["BatchSpan", "Phases", "RequestSpan", "SpanRef", "Tracing", "tracing_from_environment"]
