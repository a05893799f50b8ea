"""One RPC around its handler: the client's key checked against the access policy, a request id, the
time it arrived and its deadline, errors mapped to gRPC status codes from the one table
(`router.errors.grpc_status`), and one structured access line.

Metadata the router reads: `authorization` (`Bearer <key>`, as the HTTP header; two values are
UNAUTHENTICATED, as two headers are 401 over HTTP), `x-request-id`,
`x-priority` (the router's priority level, as the native X-Priority header; the request's
`priority` parameter, Triton's, wins), `traceparent` and `tracestate` (W3C trace context). The
request id comes back in trailing metadata. With tracing on, each call but the polled ones is a
server span (`Tracing.start_call`), the child of the caller's `traceparent`, which comes back
naming it in the initial and trailing metadata, and its trace id is on the call's log lines.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from router.access import Access, AccessPolicy
from router.errors import InputError, RouterError, brief, grpc_status
from router.grpc.protos import grpc_service_pb2 as pb
from router.grpc.streams import OpenStreams
from router.inference_protocol.submission import ItemFailed
from router.logs import incoming_or_new, request_id_var, trace_id_var
from router.tracing.api import RequestSpan, Tracing, access_attributes

__all__ = ["SERVICE", "SERVICE_NAME", "Call", "Refusal", "call_of", "check_access", "end_span", "hold_stream", "parse",
           "peer_host", "refusal_of", "run_call", "serving", "start_span", "trace_metadata"]

log = logging.getLogger("router.access")
errors_log = logging.getLogger("router.grpc")
SERVICE: Final = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
SERVICE_NAME: Final = SERVICE.full_name
#: Polled calls: not worth an access line or a span each, as the HTTP health routes.
QUIET: Final = frozenset({"ServerLive", "ServerReady", "Check", "Watch"})
_PEER: Final = re.compile(r"^ipv4:(?P<v4>[^:]+):\d+$|^ipv6:\[(?P<v6>[^\]]+)\]:\d+$")
_INTEGER: Final = re.compile(r"^[+-]?\d{1,6}$")


@dataclass
class Call:
    """What one RPC carries besides its message."""

    method: str
    request_id: str
    received_at: float  # time.monotonic(), the clock of the router's deadlines
    deadline_ms: float | None  # the client's deadline, as time left when the call arrived
    peer: str | None  # the client's address; None for a Unix socket
    metadata: Mapping[str, str]  # one value a key (the last); `authorization` keeps every value
    authorization: tuple[str, ...] = ()
    access: dict[str, Any] = field(default_factory=dict)  # what the handler adds to the access line
    trace: RequestSpan | None = None  # its server span, while tracing is on

    @property
    def priority(self) -> int | None:
        """The `x-priority` metadata: the router's priority level."""
        raw = self.metadata.get("x-priority")
        if raw is None:
            return None
        if not _INTEGER.match(raw.strip()):
            raise InputError(f"metadata x-priority must be an integer, got {brief(raw, 40)}")
        return int(raw.strip())

    def timeout_ms(self, requested_ms: float | None) -> float | None:
        """The request's own timeout, cut to the client's deadline."""
        if self.deadline_ms is None:
            return requested_ms
        return self.deadline_ms if requested_ms is None else min(requested_ms, self.deadline_ms)


def peer_host(peer: str | None) -> str | None:
    """The host of grpc's peer string ('ipv4:127.0.0.1:5000', 'ipv6:[::1]:5000'); None for a Unix socket."""
    if not peer or peer.startswith("unix"):
        return None
    match = _PEER.match(peer)
    return (match.group("v4") or match.group("v6")) if match else peer


def call_of(context: aio.ServicerContext[Any, Any], method: str) -> Call:
    pairs = [(k, v) for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)]
    metadata = dict(pairs)
    remaining = context.time_remaining()
    return Call(method, incoming_or_new(metadata.get("x-request-id")), time.monotonic(),
                None if remaining is None else max(0.0, remaining * 1000.0), peer_host(context.peer()), metadata,
                tuple(v for k, v in pairs if k == "authorization"))


def start_span(tracing: Tracing | None, call: Call) -> RequestSpan | None:
    """The call's server span from its arrival (the child of its metadata's `traceparent`); none
    while tracing is off, and none for the polled calls."""
    if tracing is None or call.method in QUIET:
        return None
    return tracing.start_call(f"{SERVICE_NAME}/{call.method}", tuple(call.metadata.items()), call.received_at)


def trace_metadata(call: Call) -> tuple[tuple[str, str], ...]:
    """`traceparent` (and `tracestate`) naming the call's span, for its metadata; none without one."""
    if call.trace is None:
        return ()
    return tuple((name.decode("latin-1"), value.decode("latin-1")) for name, value in call.trace.response_headers())


def end_span(call: Call, status: int, error: BaseException | None = None) -> None:
    """End the call's span now, with its access line's fields as attributes and the error it answered with."""
    span = call.trace
    if span is None:
        return
    if error is not None:
        span.fail(error)
    if span.recording:
        span.describe(**access_attributes(call.access, call.request_id))
    span.end(status, time.monotonic())


@contextmanager
def serving(call: Call) -> Iterator[None]:
    """While the call is served: its request id, and its trace id, on every log line."""
    token = request_id_var.set(call.request_id)
    trace_id = call.trace.trace_id if call.trace is not None else None
    trace_token = trace_id_var.set(trace_id) if trace_id else None
    try:
        yield
    finally:
        if trace_token is not None:
            trace_id_var.reset(trace_token)
        request_id_var.reset(token)


@dataclass(frozen=True)
class Refusal:
    """An error as gRPC answers it."""

    code: grpc.StatusCode
    details: str
    trailing: tuple[tuple[str, str], ...]
    status: int  # the router's status for the same error (the access line's `status`)


def refusal_of(exc: BaseException) -> Refusal | None:
    """A known error as its gRPC status; None for an unexpected one."""
    error = exc.error if isinstance(exc, ItemFailed) else exc
    if not isinstance(error, RouterError):
        return None
    code, trailing = grpc_status(error)
    return Refusal(grpc.StatusCode[code], str(exc) if isinstance(exc, ItemFailed) else error.detail,
                   tuple(trailing.items()), error.status_code)


Handler = Callable[[Any, Call], Awaitable[Any]]


async def check_access(policy: AccessPolicy, access: Access, call: Call, context: aio.ServicerContext[Any, Any]) -> None:
    """End the call (UNAUTHENTICATED, PERMISSION_DENIED) unless its key grants `access`: for the
    streaming calls, which answer no error of their own before their first message."""
    try:
        policy.check(access, call.authorization)
    except RouterError as exc:
        code, trailing = grpc_status(exc)
        await context.abort(grpc.StatusCode[code], exc.detail, tuple(trailing.items()))


async def hold_stream(streams: OpenStreams, policy: AccessPolicy, call: Call,
                      context: aio.ServicerContext[Any, Any]) -> str | None:
    """Count a long stream without an inference key against `streams`' bounds, or end it with
    RESOURCE_EXHAUSTED over them; the connection it was counted on (for `streams.closed`), None for
    a keyed one, which is not counted."""
    if policy.holds_key(call.authorization):
        return None
    connection = context.peer()
    refusal = streams.open(connection)
    if refusal is None:
        return connection
    if (refused := streams.refused.due(time.monotonic())) is not None:
        errors_log.warning("%d gRPC stream(s) without a key refused: %d open, at most %d (%d a connection)",
                           refused, streams.count, streams.total, streams.per_connection,
                           extra={"open_keyless_streams": streams.count, "refused_streams": refused})
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
    return None  # abort raises: not reached


def parse(message_type: Any, raw: bytes) -> Any:
    """A request message from its bytes: parsed here rather than by grpc, so that bytes that are not
    the message are INVALID_ARGUMENT with protobuf's reason, not grpc's INTERNAL."""
    try:
        return message_type.FromString(raw)
    except DecodeError as exc:
        raise InputError(f"the request is not a valid {message_type.DESCRIPTOR.name} message: {exc}") from None


async def run_call(handler: Handler, message_type: Any, raw: bytes, context: aio.ServicerContext[Any, Any], *,
                   method: str, access: Access, policy: AccessPolicy, tracing: Tracing | None = None) -> Any:
    """Run one unary RPC: check access, parse the message, run the handler, answer an error with its status."""
    call = call_of(context, method)
    call.trace = start_span(tracing, call)
    started = time.perf_counter()
    status, code, error = 200, "OK", None
    with serving(call):
        try:
            policy.check(access, call.authorization)
            response = await handler(parse(message_type, raw), call)
            if traced := trace_metadata(call):
                await context.send_initial_metadata(traced)
            context.set_trailing_metadata((("x-request-id", call.request_id), *traced))
            return response
        except Exception as exc:  # noqa: BLE001  # the call's fault boundary: every error is answered with a status
            refusal, error = refusal_of(exc), exc
            if refusal is None:
                errors_log.error("unhandled error in %s", method, exc_info=exc)
                refusal = Refusal(grpc.StatusCode.INTERNAL, "internal server error", (), 500)
            status, code = refusal.status, refusal.code.name
            await context.abort(refusal.code, refusal.details,
                                (*refusal.trailing, ("x-request-id", call.request_id), *trace_metadata(call)))
        except BaseException as exc:  # cancelled: the client went away or its deadline passed
            status, code, error = 499, "CANCELLED", exc
            raise
        finally:
            access_line(call, status, code, time.perf_counter() - started)
            end_span(call, status, error)


def access_line(call: Call, status: int, code: str, seconds: float) -> None:
    """One `request` line, in the fields of the HTTP access lines (`router.http.request`)."""
    if call.method in QUIET and status == 200:
        return
    line = {"method": "gRPC", "path": call.method, "status": status, "grpc_status": code,
            "duration_ms": round(seconds * 1000, 3), **call.access, "request_id": call.request_id}
    log.info("request", extra=line)
