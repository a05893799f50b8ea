"""Open Inference Protocol (KServe V2 REST, Triton's HTTP API) on the router's queues, batching and budget.

Handlers only decode, submit, await and encode; the V2 codec is `router.http.kserve.codec`. Errors on
these routes answer in the V2 shape `{"error": "..."}` through this router's own exception
handler (`encode_error` holds the mapping); the native routes keep `{"detail": ...}`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
import zlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Protocol

from litestar import MediaType, Request, Response, Router, get, post

from router import __version__
from router.errors import InputError, ModelNotFound, PayloadTooLarge, RouterError, UnsupportedMediaType, brief
from router.http.auth import Access
from router.http.disconnect import run_unless_disconnected
from router.http.kserve.bounded_json import loads_bounded
from router.http.kserve.codec import (
    HEADER_LENGTH,
    MODEL_VERSION,
    InferRequest,
    ItemFailed,
    RequestedOutput,
    decode_request,
    encode_error,
    encode_response,
    router_priority,
    select_outputs,
    signature,
    to_payloads,
)
from router.http.request_state import pipelines_of, received_at, runtime_of
from router.logs import request_id_var
from router.pipelines import PipelineAnswer, PipelineRunner
from router.sdk.plugin import Payload
from router.serving.facade import ServingFacade
from router.serving.runtime import Answer
from router.serving.snapshots import ModelInfo

#: One item's answer: a model's or a pipeline's (both carry `output`).
Answered = Answer | PipelineAnswer

__all__ = ["v2_error_response", "v2_router"]

log = logging.getLogger("router.http.kserve.routes")
EXTENSIONS: Final = ["binary_tensor_data", "model_repository"]
DEFAULT_BODY_LIMIT: Final = 20 * 1024 * 1024
DEFAULT_MAX_ITEMS: Final = 1024
#: Triton's model states, from the router's.
_TRITON_STATES: Final = {
    "ready": "READY", "degraded": "READY", "pending": "LOADING", "loading": "LOADING", "draining": "UNLOADING",
    "unloading": "UNLOADING", "unloaded": "UNAVAILABLE", "failed": "UNAVAILABLE",
}


def _model(request: Request[Any, Any, Any], name: str, version: str | None) -> ModelInfo:
    """The model (for a pipeline, the model its requests enter by) of a V2 route."""
    pipelines = pipelines_of(request)
    model = runtime_of(request).model(pipelines.plan(name).entry if pipelines.serves(name) else name)
    if version is not None and version != MODEL_VERSION:
        raise ModelNotFound(f"model {name!r} has no version {brief(version, 40)}; versions: {MODEL_VERSION}")
    return model


def _status(ok: bool) -> Response[bytes]:
    """Triton's health answers: an empty body, 200 when true and 400 when not."""
    return Response(b"", status_code=200 if ok else 400, media_type=MediaType.TEXT)


# -- server and model metadata --------------------------------------------------------------------


@get("/", summary="V2 server metadata")
async def server_metadata() -> dict[str, Any]:
    return {"name": "model-router", "version": __version__, "extensions": EXTENSIONS}


@get("/health/live", summary="V2 liveness: 200 while the process is up", opt={"access": Access.HEALTH})
async def server_live() -> Response[bytes]:
    return _status(True)


@get("/health/ready", summary="V2 readiness: 200 once every required model serves, 400 before and while draining",
     opt={"access": Access.HEALTH})
async def server_ready(request: Request[Any, Any, Any]) -> Response[bytes]:
    return _status(runtime_of(request).ready)


@get(["/models/{name:str}", "/models/{name:str}/versions/{version:str}"], summary="V2 model metadata")
async def model_metadata(name: str, request: Request[Any, Any, Any], version: str | None = None) -> dict[str, Any]:
    model = _model(request, name, version)
    pipeline = pipelines_of(request).serves(name)  # a pipeline is a model to V2 clients, as Triton's ensembles
    return {
        "name": name,
        "versions": [MODEL_VERSION],
        "platform": "ensemble" if pipeline else f"model-router/{model.plugin['name']}",
        **signature(model.accepts).metadata(),
    }


@get(["/models/{name:str}/ready", "/models/{name:str}/versions/{version:str}/ready"], summary="V2 model readiness")
async def model_ready(name: str, request: Request[Any, Any, Any], version: str | None = None) -> Response[bytes]:
    model = _model(request, name, version)
    pipelines = pipelines_of(request)
    return _status(pipelines.info(name).serving if pipelines.serves(name) else model.serving)


# -- inference ------------------------------------------------------------------------------------


@post(["/models/{name:str}/infer", "/models/{name:str}/versions/{version:str}/infer"], status_code=200,
      summary="V2 inference: each item of the batch goes through the model's queue and batcher")
async def infer(name: str, request: Request[Any, Any, Any], version: str | None = None) -> Response[bytes]:
    """JSON tensors or Triton's binary tensor data extension. Parameters: `timeout` (us), `priority` (1 highest).
    A request is admitted or refused as a whole: its item count against the model's queue before any item is queued."""
    model = _model(request, name, version)  # 404 before reading the body
    target = _target(request, name)
    target.precheck(name, received_at=received_at(request))  # draining, not serving, full: before the body
    body = _decompress(await request.body(), request.headers.get("content-encoding"), _body_limit(request))
    work = _decode_and_run(request, target, name, model, body)  # a client gone mid-decode stops it before submitting
    decoded, outputs, answers = await run_unless_disconnected(request.receive, work)
    content, header_length = encode_response(name, decoded, outputs, [answer.output for answer in answers])
    if header_length is None:
        return Response(content, media_type=MediaType.JSON)
    return Response(content, media_type="application/octet-stream", headers={HEADER_LENGTH: str(header_length)})


class _Target(Protocol):
    """What V2 inference runs items through: the serving façade for a model, the pipeline runner for a pipeline."""

    def precheck(self, name: str, *, priority: int | None = None, timeout_ms: float | None = None,
                 received_at: float | None = None, items: int = 1, body_bytes: int | None = None) -> None: ...


def _target(request: Request[Any, Any, Any], name: str) -> _Target:
    pipelines = pipelines_of(request)
    return pipelines if pipelines.serves(name) else runtime_of(request)


def _run_one(target: _Target, name: str) -> Callable[..., Awaitable[Answered]]:
    """The submit of one item: the façade's `submit`, or the pipeline runner's `run`."""
    if isinstance(target, PipelineRunner):
        return functools.partial(target.run, name)
    facade: ServingFacade = target  # type: ignore[assignment]  # the other kind of target
    return functools.partial(facade.submit, name)


async def _decode_and_run(
    request: Request[Any, Any, Any], target: _Target, name: str, model: ModelInfo, body: bytes
) -> tuple[InferRequest, Sequence[RequestedOutput], list[Answered]]:
    """Decode (off the event loop), check the whole request against the queue, then submit every item."""
    max_items = min(_max_items(request), model.queue_capacity)
    decoded = await asyncio.to_thread(decode_request, body, request.headers.get(HEADER_LENGTH), max_items=max_items)
    priority = router_priority(decoded.priority, model.priority_levels)
    items = decoded.inputs[0].shape[0]
    target.precheck(name, priority=priority, timeout_ms=decoded.timeout_ms, received_at=received_at(request),
                    items=items)
    sig = signature(model.accepts)
    outputs = select_outputs(decoded, sig)
    payloads = await asyncio.to_thread(to_payloads, decoded, name, sig)
    request.scope["state"]["access"] = {"model": name, "input_bytes": len(body), "items": len(payloads)}
    answers = await _submit_all(_run_one(target, name), payloads, priority, decoded.timeout_ms, received_at(request))
    return decoded, outputs, answers


async def _submit_all(
    submit: Callable[..., Awaitable[Answered]], payloads: Sequence[Payload], priority: int | None,
    timeout_ms: float | None, arrived: float | None,
) -> list[Answered]:
    """Submit every item at once so they share the queue and the batcher; answers in item order.

    The first failure (in item order) answers the request, and the remaining items are cancelled."""
    base = request_id_var.get() or uuid.uuid4().hex
    ids = [base] if len(payloads) == 1 else [f"{base}.{i}" for i in range(len(payloads))]
    tasks = [
        asyncio.ensure_future(submit(p, priority=priority, timeout_ms=timeout_ms, request_id=rid, received_at=arrived))
        for p, rid in zip(payloads, ids, strict=True)
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((i for i, t in enumerate(tasks) if t.done() and not t.cancelled() and t.exception()), None)
    finally:
        for task in tasks:
            task.cancel()  # a no-op for finished ones
        await asyncio.gather(*tasks, return_exceptions=True)
    if failed is not None:
        error = tasks[failed].exception()
        assert error is not None
        if len(tasks) > 1 and isinstance(error, RouterError):
            raise ItemFailed(failed, len(tasks), error) from error  # not by editing it: a batch shares its error
        raise error
    return [task.result() for task in tasks]


def _body_limit(request: Request[Any, Any, Any]) -> int:
    limit = getattr(request.app, "request_max_body_size", None)
    return int(limit) if limit else DEFAULT_BODY_LIMIT


def _max_items(request: Request[Any, Any, Any]) -> int:
    """The configured cap on items in one request (MODEL_ROUTER_MAX_ITEMS)."""
    return int(getattr(request.app.state, "max_items", DEFAULT_MAX_ITEMS))


def _decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """A gzip or deflate request body (tritonclient's request_compression_algorithm), inflated up to `limit`."""
    name = (encoding or "identity").strip().lower()
    if name == "identity":
        return body
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}.get(name)
    if wbits is None:
        raise UnsupportedMediaType(f"Content-Encoding {brief(encoding, 40)} is not supported; accepted: gzip, deflate, identity")
    inflater = zlib.decompressobj(wbits)
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InputError(f"the {name} request body is corrupt: {exc}") from None
    if len(data) > limit:
        raise PayloadTooLarge(f"the {name} request body inflates to more than {limit} bytes")
    if not inflater.eof:
        raise InputError(f"the {name} request body is truncated")
    return data


# -- the repository extension ---------------------------------------------------------------------


@post("/repository/index", status_code=200, summary="V2 repository index: every model and its state")
async def repository_index(request: Request[Any, Any, Any]) -> list[dict[str, str]]:
    ready_only = _ready_flag(await request.body())
    entries = []
    listed = [(m.name, _TRITON_STATES[m.state], m.error) for m in runtime_of(request).models()]
    listed += [(p.name, "READY" if p.serving else "UNAVAILABLE", p.error) for p in pipelines_of(request).infos()]
    for name, state, error in listed:
        if ready_only and state != "READY":
            continue
        entries.append({"name": name, "version": MODEL_VERSION, "state": state, "reason": error or ""})
    return entries


def _ready_flag(body: bytes) -> bool:
    if not body.strip():
        return False
    parsed = loads_bounded(body, "the repository index request", expected='JSON like {"ready": true}')
    ready = parsed.get("ready", False) if isinstance(parsed, dict) else None
    if not isinstance(ready, bool):
        raise InputError(f"the repository index request must be JSON like {{\"ready\": true}}, got {brief(body, 80)}")
    return ready


@post("/repository/models/{name:str}/load", status_code=200, summary="V2 model load: load now, keep resident",
      opt={"access": Access.ADMIN})
async def repository_load(name: str, request: Request[Any, Any, Any]) -> Response[bytes]:
    await runtime_of(request).load_model(name)
    return Response(b"", status_code=200, media_type=MediaType.TEXT)


@post("/repository/models/{name:str}/unload", status_code=200, summary="V2 model unload: unload now, keep out",
      opt={"access": Access.ADMIN})
async def repository_unload(name: str, request: Request[Any, Any, Any]) -> Response[bytes]:
    await runtime_of(request).unload_model(name)
    return Response(b"", status_code=200, media_type=MediaType.TEXT)


# -- errors and the router ------------------------------------------------------------------------


def v2_error_response(request: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, str]]:
    """Every error on a V2 route as `{"error": ...}`, with the status and headers `encode_error` maps."""
    mapped = encode_error(exc)
    if mapped is None:
        log.error("unhandled error", exc_info=exc)
        mapped = (500, {"error": "internal server error"}, {})
    status, body, headers = mapped
    return Response(body, status_code=status, headers=headers, media_type=MediaType.JSON)


v2_router = Router(
    path="/v2",
    route_handlers=[server_metadata, server_live, server_ready, model_metadata, model_ready, infer,
                    repository_index, repository_load, repository_unload],
    exception_handlers={Exception: v2_error_response},
    tags=["Open Inference Protocol (V2)"],
)
