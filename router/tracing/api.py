"""What the request path calls to trace a request: plain values and a few small protocols.

A request's trace is its server span (`RequestSpan`, started by the front that received the
request: an HTTP request, a gRPC call or a stream's frame) and the phases of its path (`Phases`):
receive (routing, header checks, the body), admission, wait for load, preprocess, queue wait,
execute, postprocess, respond. A path may have stages (`StageSpan`, a pipeline's steps), spans
with paths of their own (each item the step ran). A phase is a span built when it ends, from timestamps
the path records anyway (`time.monotonic`, one clock for every process on a Linux host, so a
timestamp taken where the batch ran means the same in the front). What travels with a request to
where batches run is a `SpanRef`, a value, never a live span: the batch span (`BatchSpan`) links
to every request it served from their refs, and each request's execute phase links back to it.

Tracing is on when the environment says so, the OpenTelemetry way
(`router.tracing.environment.tracing_from_environment`); off, nothing here is built and the
request path checks one None.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

__all__ = ["ENDPOINT_VARIABLES", "AttributeValue", "BatchSpan", "Phases", "RequestSpan", "SpanRef", "StageSpan",
           "Tracing", "access_attributes", "within_phase"]

T = TypeVar("T")
AttributeValue = str | bool | int | float
Headers = Sequence[tuple[bytes, bytes]]  # ASGI's: lower-case names, as uvicorn gives them
Metadata = Sequence[tuple[str, str]]  # gRPC's: lower-case keys
#: Variables whose presence turns export on (OpenTelemetry's own convention).
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


@dataclass(frozen=True, slots=True)
class SpanRef:
    """A recorded span's identity as a value (W3C ids): what crosses to where the batch runs."""

    trace_id: int
    span_id: int

    def to_bytes(self) -> bytes:
        """Its identity in 24 bytes (W3C trace and span ids), for a message between processes."""
        return self.trace_id.to_bytes(16, "big") + self.span_id.to_bytes(8, "big")

    @classmethod
    def from_bytes(cls, data: bytes) -> SpanRef:
        return cls(int.from_bytes(data[:16], "big"), int.from_bytes(data[16:24], "big"))


class Phases(Protocol):
    """One request's path (or one item's, in a request of many), phase after phase."""

    @property
    def ref(self) -> SpanRef: ...  # the request span the phases belong to: what its batch links to

    def enter(self, phase: str, at: float | None = None, *, link: SpanRef | None = None,
              **attributes: AttributeValue) -> None:
        """End the open phase at `at`, if one is open, and open `phase` from `at`. Without `at`:
        now if a phase is open, else where the last one ended (so that what follows the runtime's
        part starts at its end)."""

    def leave(self, at: float, error: BaseException | None = None) -> None:
        """End the open phase at `at`, failed with `error` if given; none is open after."""

    def stage(self, name: str, at: float, **attributes: AttributeValue) -> StageSpan:
        """A span from `at` beside this path's phases, under the same span: one stage of this path
        (a pipeline's step), with this path's item. Ended by its `end`, else with the request."""


class StageSpan(Protocol):
    """One stage of a request's path (a pipeline's step): a span with paths of phases of its own
    (one per item it ran) and stages under it (the steps of a pipeline run as a step)."""

    @property
    def ref(self) -> SpanRef: ...  # what the batches of its items link to

    def phases(self, item: int | None = None) -> Phases:
        """A new path of phases under this span."""

    def stage(self, name: str, at: float, **attributes: AttributeValue) -> StageSpan:
        """A stage under this one, from `at`."""

    def describe(self, **attributes: AttributeValue) -> None: ...

    def end(self, at: float, error: BaseException | None = None) -> None:
        """End the span at `at` (once: a second call does nothing), failed with `error` if given."""


async def within_phase(trace: Phases, phase: str, clock: Callable[[], float], work: Awaitable[T]) -> T:
    """Await `work` with `phase` open from now; whatever phase is open when it ends is left then,
    with the error `work` raised, if any."""
    trace.enter(phase, clock())
    try:
        result = await work
    except BaseException as exc:
        trace.leave(clock(), exc)
        raise
    trace.leave(clock())
    return result


class RequestSpan(Protocol):
    """The server span of one request, from its arrival until its answer is written."""

    @property
    def trace_id(self) -> str | None: ...  # 32 hex digits, for log lines; None: its trace exists nowhere
    @property
    def recording(self) -> bool: ...  # sampled: its phases are recorded and exported

    def phases(self, item: int | None = None) -> Phases | None:
        """A new path of phases under this span (None when not recording); ended with the span."""

    def describe(self, **attributes: AttributeValue) -> None:
        """Add attributes to the span (the model, the request id)."""

    def fail(self, error: BaseException) -> None:
        """The error the request is answered with: the reason in the span's status."""

    def end(self, status: int, at: float, route: str | None = None) -> None:
        """End the span at `at` with the HTTP `status` (5xx: error), named after `route` if known;
        a gRPC call's with the router's status of its answer (its gRPC code: `router.errors.grpc_code`)."""

    def response_headers(self) -> list[tuple[bytes, bytes]]:
        """`traceparent` (and `tracestate`) of this span, for the answer; none when `trace_id` is None."""


class BatchSpan(Protocol):
    """The span of one device batch, linked to every request it served."""

    @property
    def ref(self) -> SpanRef: ...

    def end(self, at: float, error: str | None = None) -> None: ...


class Tracing(Protocol):
    """Makes the spans; one per process, from the environment."""

    def start_request(self, method: str, path: str, headers: Headers, at: float) -> RequestSpan:
        """A server span from `at`, the child of the `traceparent` in `headers` if there is one."""

    def start_call(self, method: str, metadata: Metadata, at: float) -> RequestSpan:
        """A gRPC call's server span from `at` (`method`: `package.Service/Method`), the child of the
        `traceparent` in `metadata` if there is one; `response_headers` are then its metadata."""

    def start_batch(self, requests: Sequence[tuple[SpanRef, str]], at: float,
                    attributes: Mapping[str, AttributeValue]) -> BatchSpan:
        """A batch span from `at`, linked to each (request span, request id) it serves."""

    def describe(self) -> str:
        """Where spans go and how they are sampled, for the start-up log."""

    def shutdown(self) -> None:
        """Export what is pending and stop (at the end of the app's lifespan)."""


def access_attributes(fields: Mapping[str, object] | None, request_id: str) -> dict[str, AttributeValue]:
    """What a front's access line records of a request (its plain values), as a server span's attributes."""
    attributes: dict[str, AttributeValue] = {f"router.{key}": value for key, value in (fields or {}).items()
                                             if isinstance(value, (str, bool, int, float))}
    attributes["router.request_id"] = request_id
    return attributes
