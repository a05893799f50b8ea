"""Whether to trace, and how, as OpenTelemetry's own environment variables say."""

from __future__ import annotations

import os

from router.errors import ConfigError
from router.tracing.api import ENDPOINT_VARIABLES, Tracing

__all__ = ["tracing_from_environment"]

PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


def tracing_from_environment() -> Tracing | None:
    """Tracing as the OTEL_* variables ask, or None: on once an OTLP endpoint is set, unless
    OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none. The sampler, resource, headers, batching
    and propagators are read by the OpenTelemetry SDK itself. ConfigError for what cannot be
    served: an exporter or protocol other than OTLP over HTTP, or the `tracing` extra missing."""
    env = os.environ
    if not any(env.get(name, "").strip() for name in ENDPOINT_VARIABLES):
        return None
    exporter = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or exporter == "none":
        return None
    if exporter != "otlp":
        raise ConfigError(f"environment: OTEL_TRACES_EXPORTER={exporter!r} is not supported; accepted: otlp, none")
    for name in PROTOCOL_VARIABLES:
        protocol = env.get(name, "").strip().lower()
        if protocol and protocol != "http/protobuf":
            raise ConfigError(f"environment: {name}={protocol!r} is not supported; accepted: http/protobuf "
                              "(OTLP over HTTP)")
        if protocol:
            break
    try:
        from router.tracing.otel import OtelTracing
    except ImportError as exc:
        raise ConfigError(f"environment: {next(n for n in ENDPOINT_VARIABLES if env.get(n))} is set, but tracing "
                          f"needs the OpenTelemetry SDK, the tracing extra: pip install -e '.[tracing]' in a checkout, "
                          f"or pip install --find-links dist 'vision-model-router[tracing]' from built wheels ({exc})") from None
    return OtelTracing.from_environment()
