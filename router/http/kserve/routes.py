"""Open Inference Protocol (KServe V2 REST, Triton's HTTP API) on the router's queues, batching and budget.

Handlers only decode, submit, await and encode; the wire format is `router.http.kserve.codec`, and
what HTTP and gRPC share (tensors, payloads, repository answers, submission) is
`router.inference_protocol`. The shared-memory extension's routes are in `shared_memory_routes`. Errors on
these routes answer in the V2 shape `{"error": "..."}` through this router's own exception
handler (`encode_error` holds the mapping); the native routes keep `{"detail": ...}`.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import asdict
from functools import partial
from typing import Any, Final

from litestar import MediaType, Request, Response, Router, get, post
from litestar.params import FromPath

from router.errors import InputError, PayloadTooLarge, UnsupportedMediaType, brief
from router.http.auth import Access
from router.http.kserve.codec import HEADER_LENGTH, decode_request, encode_error, encode_response
from router.http.kserve.shared_memory_routes import SHARED_MEMORY_ROUTES, client_regions
from router.http.request import (
    note_error,
    pipelines_of,
    received_at,
    request_phases,
    request_trace,
    run_unless_disconnected,
    runtime_of,
)
from router.inference_protocol import repository
from router.inference_protocol.request import InferRequest, router_priority
from router.inference_protocol.shared_memory import ClientRegions
from router.inference_protocol.submission import Ran, is_small, item_traces, off_loop, run_request
from router.inference_protocol.targets import Target, find_target, served_version
from router.inference_protocol.targets import repository_index as repository_entries
from router.sdk.bounded_json import loads_bounded
from router.tracing.api import Phases

__all__ = ["v2_error_response", "v2_router"]

log = logging.getLogger("router.http.kserve.routes")
DEFAULT_BODY_LIMIT: Final = 20 * 1024 * 1024
DEFAULT_MAX_ITEMS: Final = 1024
#: The parameter by which an input reads its data from shared memory: such a request is decoded off the loop.
SHARED_MEMORY_KEY = b"shared_memory_region"


def _target(request: Request[Any, Any, Any], name: str) -> Target:
    """The model or pipeline `name` names, 404 for neither or a version (the path's `/versions/{version}`)
    it does not have."""
    return find_target(runtime_of(request), pipelines_of(request), name, request.path_params.get("version"))


def _status(ok: bool) -> Response[bytes]:
    """Triton's health answers: an empty body, 200 when true and 400 when not."""
    return Response(b"", status_code=200 if ok else 400, media_type=MediaType.TEXT)


# -- server and model metadata --------------------------------------------------------------------


@get("/", summary="V2 server metadata")
async def server_metadata() -> dict[str, Any]:
    return repository.server_metadata()


@get("/health/live", summary="V2 liveness: 200 while the process is up", opt={"access": Access.HEALTH})
async def server_live() -> Response[bytes]:
    return _status(True)


@get("/health/ready", summary="V2 readiness: 200 once every required model serves, 400 before and while draining",
     opt={"access": Access.HEALTH})
async def server_ready(request: Request[Any, Any, Any]) -> Response[bytes]:
    runtime = runtime_of(request)
    if not runtime.ready:
        runtime.models()  # a split host's engine away or hung: its 503 with Retry-After, as on every route
    return _status(runtime.ready)


@get(["/models/{name:str}", "/models/{name:str}/versions/{version:str}"], summary="V2 model metadata")
async def model_metadata(name: FromPath[str], request: Request[Any, Any, Any]) -> dict[str, Any]:
    return _target(request, name).metadata()  # a pipeline is a model to V2 clients, as Triton's ensembles


@get(["/models/{name:str}/ready", "/models/{name:str}/versions/{version:str}/ready"], summary="V2 model readiness")
async def model_ready(name: FromPath[str], request: Request[Any, Any, Any]) -> Response[bytes]:
    return _status(_target(request, name).serving)


# -- inference ------------------------------------------------------------------------------------


@post(["/models/{name:str}/infer", "/models/{name:str}/versions/{version:str}/infer"], status_code=200,
      summary="V2 inference: each item of the batch goes through the model's queue and batcher")
async def infer(name: FromPath[str], request: Request[Any, Any, Any]) -> Response[bytes]:
    """JSON tensors, Triton's binary tensor data extension, or system shared memory. Parameters: `timeout` (us),
    `priority` (1 highest).
    A request is admitted or refused as a whole: its item count against the model's queue before any item is queued."""
    trace = request_phases(request.scope, "receive")
    target = _target(request, name)  # 404 before reading the body; screened once its terms are read (`run_request`)
    limit = _body_limit(request)
    body = _decompress(await request.body(), request.headers.get("content-encoding"), limit)
    regions = client_regions(request, limit)
    work = _decode_and_run(request, target, body, regions, trace)  # a client gone mid-decode stops it first
    decoded, ran = await run_unless_disconnected(request, work)
    if trace is not None:
        trace.enter("respond")  # from the runtime's answer
    content, header_length = encode_response(name, decoded, ran.outputs, [answer.output for answer in ran.answers],
                                             regions, version=served_version(ran.answers))
    if header_length is None:
        return Response(content, media_type=MediaType.JSON)
    return Response(content, media_type="application/octet-stream", headers={HEADER_LENGTH: str(header_length)})


async def _decode_and_run(
    request: Request[Any, Any, Any], target: Target, body: bytes, regions: ClientRegions, trace: Phases | None,
) -> tuple[InferRequest, Ran]:
    """Decode (off the event loop), then run the request through the model's queue (or the
    pipeline's runner) as a whole."""
    if trace is not None:
        trace.enter("decode", time.monotonic())
    model = target.inputs
    max_items = min(_max_items(request), model.queue_capacity)
    small = is_small(len(body), SHARED_MEMORY_KEY in body)
    decoded = await off_loop(small, partial(decode_request, body, request.headers.get(HEADER_LENGTH),
                                            max_items=max_items, regions=regions))
    priority = router_priority(decoded.priority, model.priority_levels)
    request.scope["state"]["access"] = {"model": target.name, "input_bytes": len(body) + regions.bytes_read,
                                        "items": decoded.items}
    span = request_trace(request.scope)
    traces = None if trace is None or span is None else item_traces(span, trace, decoded.items)
    ran = await run_request(target.entry, model, decoded, priority=priority, timeout_ms=decoded.timeout_ms,
                            received_at=received_at(request), traces=traces, small=small)
    return decoded, ran


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
    if inflater.unused_data:
        raise InputError(f"the {name} request body has {len(inflater.unused_data)} bytes after the end of its stream")
    return data


# -- the repository extension ---------------------------------------------------------------------


@post("/repository/index", status_code=200, summary="V2 repository index: every model and its state")
async def repository_index(request: Request[Any, Any, Any]) -> list[dict[str, str]]:
    entries = repository_entries(runtime_of(request), pipelines_of(request), ready_only=_ready_flag(await request.body()))
    return [asdict(entry) for entry in entries]


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
async def repository_load(name: FromPath[str], request: Request[Any, Any, Any]) -> Response[bytes]:
    """Triton's load; its `parameters` (`config`, `file:...`: a configuration to load with) are not
    supported, and a request that sends them is refused rather than loaded without them."""
    runtime_of(request).model(name)  # 404 first
    _no_load_parameters(name, await request.body())
    await runtime_of(request).load_model(name)
    return Response(b"", status_code=200, media_type=MediaType.TEXT)


@post("/repository/models/{name:str}/unload", status_code=200, summary="V2 model unload: unload now, keep out",
      opt={"access": Access.ADMIN})
async def repository_unload(name: FromPath[str], request: Request[Any, Any, Any]) -> Response[bytes]:
    await runtime_of(request).unload_model(name)
    return Response(b"", status_code=200, media_type=MediaType.TEXT)


def _no_load_parameters(name: str, body: bytes) -> None:
    if not body.strip():
        return
    parsed = loads_bounded(body, "the load request", expected='JSON like {"parameters": {}}')
    parameters = parsed.get("parameters") if isinstance(parsed, dict) else None
    if parameters:
        keys = ", ".join(brief(key, 40) for key in list(parameters)[:4]) if isinstance(parameters, dict) else brief(parameters)
        raise InputError(f"load parameters are not supported (got {keys}); change a model's configuration with "
                         f"PUT /models/{name}, its fleet-file section")


@get(["/models/stats", "/models/{name:str}/stats", "/models/{name:str}/versions/{version:str}/stats"],
     summary="V2 model statistics: items answered and failed, batches run (durations are not measured)")
async def model_statistics(request: Request[Any, Any, Any]) -> dict[str, Any]:
    runtime = runtime_of(request)
    name = request.path_params.get("name")
    models = runtime.models() if name is None else [_target(request, name).model]
    return {"model_stats": [repository.model_statistics(model) for model in models]}


# -- errors and the router ------------------------------------------------------------------------


def v2_error_response(request: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, str]]:
    """Every error on a V2 route as `{"error": ...}`, with the status and headers `encode_error` maps."""
    note_error(request.scope, exc)
    mapped = encode_error(exc)
    if mapped is None:
        log.error("unhandled error", exc_info=exc)
        mapped = (500, {"error": "internal server error"}, {})
    status, body, headers = mapped
    return Response(body, status_code=status, headers=headers, media_type=MediaType.JSON)


v2_router = Router(
    path="/v2",
    route_handlers=[server_metadata, server_live, server_ready, model_metadata, model_ready, infer,
                    repository_index, repository_load, repository_unload, model_statistics, *SHARED_MEMORY_ROUTES],
    exception_handlers={Exception: v2_error_response},
    tags=["Open Inference Protocol (V2)"],
)
