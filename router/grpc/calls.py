"""One RPC around its handler: the client's key checked against the access policy, a request id, the
time it arrived and its deadline, errors mapped to gRPC status codes from the one table
(`router.errors.grpc_status`), and one structured access line.

Metadata the router reads: `authorization` (`Bearer <key>`, as the HTTP header), `x-request-id`,
`x-priority` (the router's priority level, as the native X-Priority header; the request's
`priority` parameter, Triton's, wins). The request id comes back in trailing metadata.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from router.access import Access, AccessPolicy
from router.errors import InputError, RouterError, brief, grpc_status
from router.inference_protocol.submission import ItemFailed
from router.logs import incoming_or_new, request_id_var

__all__ = ["Call", "Refusal", "call_of", "check_access", "parse", "peer_host", "refusal_of", "run_call"]

log = logging.getLogger("router.access")
errors_log = logging.getLogger("router.grpc")
#: Polled calls: not worth an access line each, as the HTTP health routes.
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
    metadata: Mapping[str, str]
    access: dict[str, Any] = field(default_factory=dict)  # what the handler adds to the access line

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
    metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    remaining = context.time_remaining()
    return Call(method, incoming_or_new(metadata.get("x-request-id")), time.monotonic(),
                None if remaining is None else max(0.0, remaining * 1000.0), peer_host(context.peer()), metadata)


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
        policy.check(access, call.metadata.get("authorization"))
    except RouterError as exc:
        code, trailing = grpc_status(exc)
        await context.abort(grpc.StatusCode[code], exc.detail, tuple(trailing.items()))


def parse(message_type: Any, raw: bytes) -> Any:
    """A request message from its bytes: parsed here rather than by grpc, so that bytes that are not
    the message are INVALID_ARGUMENT with protobuf's reason, not grpc's INTERNAL."""
    try:
        return message_type.FromString(raw)
    except DecodeError as exc:
        raise InputError(f"the request is not a valid {message_type.DESCRIPTOR.name} message: {exc}") from None


async def run_call(handler: Handler, message_type: Any, raw: bytes, context: aio.ServicerContext[Any, Any], *,
                   method: str, access: Access, policy: AccessPolicy) -> Any:
    """Run one unary RPC: check access, parse the message, run the handler, answer an error with its status."""
    call = call_of(context, method)
    token = request_id_var.set(call.request_id)
    started = time.perf_counter()
    status, code = 200, "OK"
    try:
        policy.check(access, call.metadata.get("authorization"))
        response = await handler(parse(message_type, raw), call)
        context.set_trailing_metadata((("x-request-id", call.request_id),))
        return response
    except Exception as exc:  # noqa: BLE001  # the call's fault boundary: every error is answered with a status
        refusal = refusal_of(exc)
        if refusal is None:
            errors_log.error("unhandled error in %s", method, exc_info=exc)
            refusal = Refusal(grpc.StatusCode.INTERNAL, "internal server error", (), 500)
        status, code = refusal.status, refusal.code.name
        await context.abort(refusal.code, refusal.details, (*refusal.trailing, ("x-request-id", call.request_id)))
    except BaseException:  # cancelled: the client went away or its deadline passed
        status, code = 499, "CANCELLED"
        raise
    finally:
        access_line(call, status, code, time.perf_counter() - started)
        request_id_var.reset(token)


def access_line(call: Call, status: int, code: str, seconds: float) -> None:
    """One `request` line, in the fields of the HTTP access lines (`router.http.access`)."""
    if call.method in QUIET and status == 200:
        return
    line = {"method": "gRPC", "path": call.method, "status": status, "grpc_status": code,
            "duration_ms": round(seconds * 1000, 3), **call.access, "request_id": call.request_id}
    log.info("request", extra=line)
