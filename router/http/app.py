"""The HTTP layer (Litestar). Handlers only decode, submit, await and encode; errors map to HTTP in one place."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

import msgspec
from litestar import Litestar, MediaType, Request, Response, get, post
from litestar.datastructures import UploadFile
from litestar.enums import ScopeType
from litestar.exceptions import ClientException, HTTPException, NotFoundException
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.params import FromPath
from litestar.types import ASGIApp, HTTPScope, Message, Receive, ReceiveMessage, Scope, Send

from router import __version__
from router.errors import ClientDisconnected, InputError, ModelNotFound, RequestTimeout, RouterError, brief, clip
from router.http.admin import ADMIN_ROUTES
from router.http.answers import error_body
from router.http.auth import Access, AccessPolicy, access_guard
from router.http.kserve.routes import v2_error_response, v2_router
from router.http.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from router.http.metrics import RouterMetrics
from router.http.pipelines import PIPELINE_ROUTES, predict_pipeline
from router.http.protocol import ANSWERED, BODY_IN, SCREENED
from router.http.request import (
    QUIET_PATHS,
    TRACE,
    BodyMemory,
    access_line,
    announced_length,
    incoming_or_new,
    mark_received,
    note_error,
    number_header,
    pipelines_of,
    priority_header,
    received_at,
    request_phases,
    run_unless_disconnected,
    runtime_of,
)
from router.http.ui import ui_router
from router.http.versions import VERSION_ROUTES
from router.inference_protocol.repository import MODEL_VERSION
from router.inference_protocol.shared_memory import SharedMemoryRegistry
from router.logs import request_id_var, trace_id_var
from router.pipelines import PipelineRunner
from router.sdk.bounded_json import lone_surrogate
from router.sdk.plugin import Payload
from router.serving.facade import Serving
from router.serving.versions import split_name
from router.tracing.api import RequestSpan, Tracing, access_attributes

__all__ = ["Listener", "create_app"]

log = logging.getLogger("router.access")
#: Predict takes one file; a form of many parts is refused before they are all parsed.
MULTIPART_PART_LIMIT = 16


# -- request decoding -----------------------------------------------------------------------------


#: A multipart part Litestar reads as text, not as a file: it has no `filename` parameter.
NOT_A_FILE = ("multipart field 'file' is not a file part: its Content-Disposition needs a filename, as in "
              "form-data; name=\"file\"; filename=\"photo.jpg\" (a filename*= alone is not read)")


async def _form(request: Request[Any, Any, Any]) -> Any:
    try:
        return await request.form()
    except ClientException as exc:
        if exc.detail == "Request Entity Too Large":  # Litestar's words for its part limit
            raise InputError(f"the multipart body has more than {MULTIPART_PART_LIMIT} parts; "
                             "send the input as one field named 'file'") from None
        raise InputError(f"the multipart body is malformed: {exc.detail}") from None
    except (UnicodeDecodeError, LookupError):  # a part without a filename is decoded as text, in its charset
        raise InputError(f"{NOT_A_FILE}; a text part must be text in its charset") from None


async def _payload(request: Request[Any, Any, Any]) -> Payload:
    """A multipart field `file`, or the raw body with its content type."""
    media_type = request.headers.get("content-type", "application/octet-stream")
    if media_type.lower().startswith("multipart/form-data"):
        form = await _form(request)
        upload = form.get("file")
        if isinstance(upload, str):
            raise InputError(NOT_A_FILE)
        if not isinstance(upload, UploadFile):
            fields = ", ".join(brief(key, 40) for key in sorted(form.keys())[:8]) or "none"
            raise InputError(f"multipart body needs a file field named 'file'; got fields: {fields}")
        body = await upload.read()
        # A part without its own Content-Type (Python requests' `files={"file": f}`) is sniffed,
        # not taken for the text/plain that Litestar assumes.
        declared = any(name.lower() == "content-type" for name in upload.headers)
        payload = Payload(body, upload.content_type if declared else "application/octet-stream", upload.filename)
    else:
        payload = Payload(await request.body(), media_type)
        if _is_json(media_type) and (surrogate := lone_surrogate(payload.body)) is not None:
            raise InputError(f"the JSON body holds a lone surrogate ({surrogate}), which is not Unicode text")
    if not payload.body:
        raise InputError("the request body is empty; send an image as the body or as multipart field 'file'")
    return payload


def _is_json(media_type: str) -> bool:
    media = media_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


# -- handlers -------------------------------------------------------------------------------------


class _Answered:
    """A predict's answer as its two ASGI messages, the JSON encoded once: what Litestar's
    `Response` would send (status 200, `content-type`, `content-length`, `X-Model-Version`),
    without building one per request. Litestar passes an ASGI app a handler returns through."""

    __slots__ = ("body", "headers")

    def __init__(self, document: dict[str, Any], version: str) -> None:
        self.body = _JSON.encode(document)
        self.headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(self.body)),
                        (b"x-model-version", version.encode("latin-1"))]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})


_JSON = msgspec.json.Encoder()
#: What the OpenAPI schema says of a predict's answer (the handler returns `_Answered`).
_PREDICT_RESPONSES = {200: ResponseSpec(dict[str, Any], description="The model's answer, with its version, request "
                                        "id and timing", generate_examples=False)}


@post("/models/{name:str}/predict", status_code=200, summary="Run one input through a model",
      responses=_PREDICT_RESPONSES)
async def predict(name: FromPath[str], request: Request[Any, Any, Any]) -> ASGIApp:
    """Accepts a multipart field `file` or a raw `image/*` body. Headers: X-Timeout-Ms, X-Priority,
    X-Model-Version (a version of a model with versions), X-Route-Key (the same key, the same
    version). A pipeline's name runs the input through the pipeline (docs/pipelines.md)."""
    return await _predict(name, request.headers.get("x-model-version"), request)


@post("/models/{name:str}/versions/{version:str}/predict", status_code=200,
      summary="Run one input through one version of a model", responses=_PREDICT_RESPONSES)
async def predict_version(name: FromPath[str], version: FromPath[str], request: Request[Any, Any, Any]) -> ASGIApp:
    """As /models/{name}/predict, on the version named in the path (docs/rollouts.md)."""
    return await _predict(name, version, request)


async def _predict(name: str, version: str | None, request: Request[Any, Any, Any]) -> ASGIApp:
    pipelines = pipelines_of(request)
    versions = pipelines.versions
    is_pipeline = runtime_of(request).pipeline(name) is not None
    trace = request_phases(request.scope, "receive")
    priority = priority_header(request.headers.get("x-priority"))
    timeout_ms = number_header("X-Timeout-Ms", request.headers.get("x-timeout-ms"))
    route_key = request.headers.get("x-route-key")
    # The screen: 404, 503 and header errors before the body is read, so that under a surge a
    # refusal costs little. Served by `model-router serve`, the connection has screened the request
    # already (router.http.early), and its `Screened` goes on with the request to the commit.
    screened = request.scope["state"].get(SCREENED)
    if is_pipeline:
        if screened is None:
            screened = pipelines.screen(name, priority=priority, timeout_ms=timeout_ms, received_at=received_at(request),
                                        body_bytes=announced_length(request.headers.get("content-length")))
        return await predict_pipeline(name, request, await _payload(request), pipelines, priority, timeout_ms, trace,
                                      screened)
    if screened is None:
        try:
            screened = versions.screen(name, priority=priority, timeout_ms=timeout_ms, received_at=received_at(request),
                                       body_bytes=announced_length(request.headers.get("content-length")),
                                       version=version, route_key=route_key)
        except ModelNotFound as exc:  # the name could be a pipeline's: the 404 lists them too
            if versions.serves(name):  # a version it lacks: its own words
                raise
            raise pipelines.not_found(name, exc) from None
    payload = await _payload(request)
    request.scope["state"]["access"] = {"model": name, "input_bytes": len(payload.body)}
    answer = await run_unless_disconnected(
        request, versions.submit(name, payload, priority=priority, timeout_ms=timeout_ms,
                                 request_id=request_id_var.get(), received_at=received_at(request), trace=trace,
                                 screened=screened, version=version, route_key=route_key)
    )
    if trace is not None:
        trace.enter("respond")  # from the runtime's answer
    served_name, served_version = split_name(answer.model)
    request.scope["state"]["access"].update(
        version=served_version or MODEL_VERSION,
        queue_wait_ms=round(answer.queue_wait_s * 1000, 3), batch_size=answer.batch_size,
        execution_ms=round(answer.execution_s * 1000, 3), memory_delta_bytes=answer.memory_delta_bytes,
        **answer.input_info,
    )
    return _Answered(
        {
            "model": served_name,
            "version": served_version or MODEL_VERSION,
            "request_id": answer.request_id,
            "result": answer.output,
            "timing": {
                "queue_ms": round(answer.queue_wait_s * 1000, 3),
                "execution_ms": round(answer.execution_s * 1000, 3),
                "batch_size": answer.batch_size,
            },
        },
        served_version or MODEL_VERSION,
    )


@get("/models", summary="All models with state, queue, batching, memory and counters; and the pipelines")
async def list_models(request: Request[Any, Any, Any]) -> dict[str, Any]:
    runtime, pipelines = runtime_of(request), pipelines_of(request)
    return {"models": [model.as_dict() for model in runtime.models()],
            "pipelines": [info.as_dict() for info in pipelines.infos()],
            "routes": [_route(name, request) for name in runtime.routes()]}


@get("/models/{name:str}", summary="One model's state, queue, batching, memory and counters (or a pipeline's)")
async def show_model(name: FromPath[str], request: Request[Any, Any, Any]) -> dict[str, Any]:
    pipelines = pipelines_of(request)
    if runtime_of(request).pipeline(name) is not None:
        return pipelines.info(name).as_dict()
    if pipelines.versions.serves(name):
        return _route(name, request)
    return pipelines.known_model(name).as_dict()


def _route(name: str, request: Request[Any, Any, Any]) -> dict[str, Any]:
    """A model with versions: its route, this front's figures by version, each version's snapshot, its rollout."""
    runtime, versions = runtime_of(request), pipelines_of(request).versions
    described = versions.describe(name)
    return {**described, "kind": "versions", "rollout": runtime.rollout(name),
            "models": {v: runtime.model(d).as_dict() for v, d in described["deployments"].items()}}


@get("/health/live", summary="The process is up", opt={"access": Access.HEALTH})
async def live() -> dict[str, str]:
    return {"status": "live"}


@get("/health/ready", summary="200 once every required model is loaded and warmed; 503 before and while draining",
     opt={"access": Access.HEALTH})
async def ready(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
    runtime = runtime_of(request)
    body = {
        "ready": runtime.ready,
        "draining": runtime.draining,
        "models": {model.name: model.state for model in runtime.models()},
        "pipelines": {info.name: info.state for info in pipelines_of(request).infos()},
        "devices": {device.name: "ok" if device.available else device.error for device in runtime.devices()},
    }
    return Response(body, status_code=200 if runtime.ready else 503)


@get("/metrics", media_type=METRICS_CONTENT_TYPE, summary="Prometheus metrics", opt={"access": Access.METRICS})
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    metrics: RouterMetrics = request.app.state.metrics
    return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)


# -- errors, request ids, access log ----------------------------------------------------------------


def _error_response(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    """Every error as JSON with `detail`; status and headers from the error class. Under /v2
    (an unknown V2 route, a wrong method) the V2 shape `{"error": ...}`."""
    note_error(request.scope, exc)
    if request.scope.get("path", "").startswith("/v2"):
        return v2_error_response(request, exc)
    if isinstance(exc, RouterError):
        status, detail, headers = exc.status_code, exc.detail, exc.headers
    elif isinstance(exc, HTTPException):
        status, detail, headers = exc.status_code, exc.detail, dict(exc.headers or {})
        if isinstance(exc, NotFoundException) and detail == "Not Found":
            detail = f"no route {request.scope.get('method')} {clip(request.scope.get('path', ''), 120)}"
    else:
        log.exception("unhandled error")
        status, detail, headers = 500, "internal server error", {}
    return Response(error_body(detail, request_id_var.get()), status_code=status,
                    headers=headers, media_type=MediaType.JSON)


def request_id_middleware(app: ASGIApp, *, body_timeout_s: float, memory: BodyMemory | None = None,
                          tracing: Tracing | None = None) -> ASGIApp:
    """Around every HTTP request, routed or not (404, 405): an X-Request-ID on the response (the
    caller's, if sane), one access log line, the body's read deadline, and 499 for a client that
    went away before its answer. With `tracing`, the request's server span (the caller's
    `traceparent` its parent, echoed in the answer) and its trace id on the request's log lines."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await app(scope, receive, send)
            return
        incoming = b""
        for name, value in scope["headers"]:  # the last one, as a dict of them would keep
            if name == b"x-request-id":
                incoming = value
        request_id = incoming_or_new(incoming.decode("latin-1"))
        token = request_id_var.set(request_id)
        mark_received(scope)
        trace = _start_trace(tracing, scope) if tracing is not None else None
        trace_token = trace_id_var.set(trace.trace_id) if trace is not None and trace.trace_id else None
        started = time.perf_counter()
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                message["headers"] = headers if trace is None else headers + trace.response_headers()
            await send(message)

        if memory is not None:
            memory.in_flight += 1
        try:
            await app(scope, _read_body_by(scope, receive, body_timeout_s, memory), send_with_id)
        finally:
            if memory is not None:
                memory.in_flight -= 1
            _access_line(scope, status, time.perf_counter() - started)
            if trace is not None:
                _end_trace(scope, trace, status, request_id)
            if trace_token is not None:
                trace_id_var.reset(trace_token)
            request_id_var.reset(token)

    return middleware


def _start_trace(tracing: Tracing, scope: HTTPScope) -> RequestSpan | None:
    """The request's server span in the scope state, from its arrival; none for the polled paths."""
    if scope["path"] in QUIET_PATHS:
        return None
    headers = scope["headers"]  # a list from uvicorn; ASGI allows any iterable
    trace = tracing.start_request(scope["method"], scope["path"], headers if isinstance(headers, list) else list(headers),
                                  scope["state"]["received_at"])
    scope["state"][TRACE] = trace
    return trace


def _end_trace(scope: Scope, trace: RequestSpan, status: int, request_id: str) -> None:
    """End the server span now, with what the handler recorded for the access line as attributes."""
    if trace.recording:
        trace.describe(**access_attributes(scope["state"].get("access"), request_id))
    trace.end(status or 499, time.monotonic(), scope.get("path_template"))


def _read_body_by(scope: Scope, receive: Receive, timeout_s: float, memory: BodyMemory | None) -> Receive:
    """`receive`, but the body must arrive within `timeout_s` (408 after that), and a client that
    disconnects while sending it answers 499 (ClientDisconnected) instead of an error. Once the
    body is in, `receive` is passed through: the disconnect watcher waits on it. A body the
    connection has whole already (`BODY_IN`) is read without a timer."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    reading = True
    state = scope.get("state", {})

    async def timed_receive() -> ReceiveMessage:
        nonlocal reading
        if not reading:
            return await receive()
        if BODY_IN in state:
            message = await receive()
        else:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s") from None
        if message["type"] == "http.disconnect":
            raise ClientDisconnected("the client disconnected while sending the request body")
        if message["type"] == "http.request":
            if memory is not None:
                memory.received(len(message["body"]))
            reading = message.get("more_body", False)
        return message

    return timed_receive


def _access_line(scope: Scope, status: int, seconds: float) -> None:
    """The request's line, with the status the client saw: the connection's, if it answered the
    request while the app held it (`router.http.protocol`)."""
    state = scope.get("state", {})
    access_line(str(scope.get("method")), scope.get("path", ""), state.get(ANSWERED, status), seconds,
                state.get("access"))


# -- the app --------------------------------------------------------------------------------------


class Listener(Protocol):
    """Another endpoint of this process (the gRPC server), started and stopped by the app's lifespan
    so that every process that serves the app serves it too."""

    async def start(self) -> None: ...
    async def stop(self) -> None: ...


def create_app(
    runtime: Serving,
    *,
    max_body_bytes: int = 20 * 1024 * 1024,
    drain_timeout_s: float = 30.0,
    access_policy: AccessPolicy | None = None,
    bound_metrics: RouterMetrics | None = None,
    body_timeout_s: float = 60.0,
    max_items: int = 1024,
    trim_memory: bool = True,
    shared_memory: SharedMemoryRegistry | None = None,
    listeners: Sequence[Listener] = (),
    tracing: Tracing | None = None,
    pipelines: PipelineRunner | None = None,
) -> Litestar:
    """The Litestar app around `Serving` (over any core). The runtime starts in the lifespan
    and loads models in the background, then the `listeners` start; they stop after the drain. The
    app owns `shared_memory` (the V2 regions its clients register; by default a fresh registry) and
    closes it at shutdown. `bound_metrics`: a registry already bound to the runtime, with collectors
    of its own (the cluster's); by default a fresh one bound here. `tracing`: spans for requests
    (the runtime makes the batches'), exported until the lifespan ends. `pipelines`: the runner of
    the runtime's pipelines, shared with the other listeners that serve them (gRPC); by default a
    fresh one. Its figures go to the app's metrics either way."""
    memory = BodyMemory() if trim_memory else None
    policy = access_policy or AccessPolicy()
    regions = shared_memory if shared_memory is not None else SharedMemoryRegistry()

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        await runtime.start()
        trimmer = asyncio.create_task(memory.trim_after_bursts(), name="trim-memory") if memory else None
        started: list[Listener] = []
        try:
            for listener in listeners:
                await listener.start()
                started.append(listener)
            yield
        finally:
            if trimmer is not None:
                trimmer.cancel()
            if not runtime.draining:
                await runtime.drain(drain_timeout_s)
            for listener in reversed(started):
                await listener.stop()
            await runtime.stop()
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)  # exports what is pending, off the loop
            regions.close()

    app = Litestar(
        route_handlers=[predict, predict_version, list_models, show_model, live, ready, metrics, *ADMIN_ROUTES, *VERSION_ROUTES, *PIPELINE_ROUTES, v2_router,
                        ui_router],
        lifespan=[lifespan],
        exception_handlers={Exception: _error_response},
        # Without keys every route is open: no guard (Litestar copies the route handler for each guard call).
        guards=[access_guard] if policy.enabled else [],
        request_max_body_size=max_body_bytes,
        multipart_form_part_limit=MULTIPART_PART_LIMIT,
        openapi_config=OpenAPIConfig(title="model-router", version=__version__, path="/schema"),
        logging_config=None,
    )
    # Around Litestar's router rather than its route handlers, so that unrouted requests (404,
    # 405) get a request id and an access line too.
    app.asgi_handler = request_id_middleware(app.asgi_handler, body_timeout_s=body_timeout_s, memory=memory,
                                             tracing=tracing)
    app.state.runtime = runtime
    app.state.tracing = tracing
    app.state.pipelines = pipelines if pipelines is not None else PipelineRunner(runtime)
    app.state.max_items = max_items
    app.state.shared_memory = regions
    router_metrics = bound_metrics
    if router_metrics is None:
        router_metrics = RouterMetrics()
        router_metrics.bind(runtime)
    app.state.pipelines.add_telemetry(router_metrics)
    app.state.pipelines.versions.tallies.sinks.append(router_metrics)
    app.state.metrics = router_metrics
    app.state.access_policy = policy
    return app
