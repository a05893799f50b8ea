"""Refusing a predict request from its request line and headers, in the connection itself.

Under a surge most requests are refused (503 with Retry-After). Through the app a refusal costs
0.3 to 0.45 ms of CPU here (an ASGI task, Litestar's routing, guard and exception handling, the
response objects), and on a busy host that CPU comes out of the batches running beside it. The
connection (`router.http.protocol`) asks `EarlyRefusals` once a request's headers are complete:
for `POST /models/<name>/predict` it runs the same checks as the predict handler, in the same
order (key, X-Priority, X-Timeout-Ms, then the serving core's `screen`, or the pipeline runner's
for a pipeline's name), and when they refuse it
returns the whole response, which the connection writes while it discards the body as it comes.
A request the checks admit goes on to the app with its `Screened` (the request's terms, deadline
and the figures read), which the handler hands on to the commit: the request is screened once. Anything else, or a request whose key is not accepted (the app answers 401/403 in its
own words), goes on to the app unchanged. With tracing on, a refusal is a server span too, the
child of the request's `traceparent`, echoed in the answer.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence

import msgspec

from router.errors import ModelNotFound, RouterError
from router.http.answers import error_body
from router.http.auth import Access, AccessPolicy
from router.http.protocol import EarlyAnswer
from router.http.request import access_line, announced_length, incoming_or_new, number_header, priority_header
from router.pipelines import PipelineRunner
from router.serving.facade import Serving
from router.serving.rules import Screened
from router.tracing.api import Tracing

__all__ = ["EarlyRefusals"]

log = logging.getLogger("router.http.early")
#: The predict route, its model name in plain path characters (a percent-encoded name, a query,
#: or an absolute URI goes to the app, which decodes them).
PREDICT = re.compile(rb"^/models/([A-Za-z0-9._~:@!$&'()*+,;=-]+)/predict$")
#: The headers the checks read; a request that repeats one of them goes to the app.
READ = (b"authorization", b"x-priority", b"x-timeout-ms", b"content-length", b"x-request-id", b"x-model-version",
        b"x-route-key")
ROUTE = "/models/{name}/predict"


class EarlyRefusals:
    """The connection's screen: `(method, url, headers) -> EarlyAnswer | Screened | None`."""

    def __init__(self, runtime: Serving, policy: AccessPolicy, tracing: Tracing | None = None,
                 pipelines: PipelineRunner | None = None) -> None:
        self.runtime = runtime
        self.policy = policy
        self.tracing = tracing
        self.pipelines = pipelines

    def __call__(self, method: bytes, url: bytes, headers: Sequence[tuple[bytes, bytes]]) -> EarlyAnswer | Screened | None:
        if method != b"POST":
            return None
        match = PREDICT.match(url)
        if match is None:
            return None
        started = time.monotonic()
        fields: dict[bytes, str] = {}
        for name, value in headers:  # uvicorn gives the names in lower case
            if name in READ:
                if name in fields:
                    return None
                fields[name] = value.decode("latin-1")
        if self.policy.enabled:
            try:
                self.policy.check(Access.PREDICT, fields.get(b"authorization"))
            except RouterError:
                return None
        model = match.group(1).decode("ascii")
        pipelines = self.pipelines
        try:
            priority = priority_header(fields.get(b"x-priority"))
            timeout_ms = number_header("X-Timeout-Ms", fields.get(b"x-timeout-ms"))
            body_bytes = announced_length(fields.get(b"content-length"))
            if pipelines is not None and self.runtime.pipeline(model) is not None:
                return pipelines.screen(model, priority=priority, timeout_ms=timeout_ms, received_at=started,
                                        body_bytes=body_bytes)
            if pipelines is not None:
                return pipelines.versions.screen(model, priority=priority, timeout_ms=timeout_ms, received_at=started,
                                                 body_bytes=body_bytes, version=fields.get(b"x-model-version"),
                                                 route_key=fields.get(b"x-route-key"))
            return self.runtime.screen(model, priority=priority, timeout_ms=timeout_ms, received_at=started,
                                       body_bytes=body_bytes)
        except ModelNotFound as exc:  # the name could be a pipeline's: the 404 lists them too
            error = pipelines.not_found(model, exc) if pipelines is not None and not pipelines.versions.serves(model) \
                else exc
            return self._refusal(error, url.decode("ascii"), started, fields.get(b"x-request-id"), headers)
        except RouterError as exc:
            return self._refusal(exc, url.decode("ascii"), started, fields.get(b"x-request-id"), headers)

    def _refusal(self, exc: RouterError, path: str, started: float, incoming_id: str | None,
                 request_headers: Sequence[tuple[bytes, bytes]]) -> EarlyAnswer:
        """The app's answer to `exc` on this route: its status, headers and JSON body."""
        rid = incoming_or_new(incoming_id)
        body = msgspec.json.encode(error_body(exc.detail, rid))
        headers = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in exc.headers.items()]
        headers += [(b"content-type", b"application/json"), (b"x-request-id", rid.encode("latin-1"))]
        fields: dict[str, str] = {"refused": "before the app"}
        if self.tracing is not None:
            trace = self.tracing.start_request("POST", path, request_headers, started)
            trace.describe(**{"router.request_id": rid, "router.refused": "before the app"})
            trace.fail(exc)
            trace.end(exc.status_code, time.monotonic(), ROUTE)
            headers += trace.response_headers()
            if trace.trace_id:
                fields["trace_id"] = trace.trace_id
        access_line("POST", path, exc.status_code, time.monotonic() - started, fields, rid)
        return EarlyAnswer(exc.status_code, tuple(headers), body)
