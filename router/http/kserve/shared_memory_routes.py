"""The V2 shared-memory extension over HTTP: register, status and unregister system shared memory
regions (`router.inference_protocol.shared_memory` holds them, for gRPC too); CUDA shared memory is
declared unsupported (400 here, as Triton answers over HTTP; gRPC's UNIMPLEMENTED) except for the
calls that find nothing to do."""

from __future__ import annotations

from typing import Any

from litestar import MediaType, Request, Response, get, post
from litestar.params import FromPath

from router.access import AccessPolicy
from router.errors import InputError, brief
from router.inference_protocol.shared_memory import (
    Caller,
    ClientRegions,
    RegionStatus,
    SharedMemoryRegistry,
    refuse_cuda,
)
from router.sdk.bounded_json import loads_bounded

__all__ = ["SHARED_MEMORY_ROUTES", "client_regions", "registry_of"]


def registry_of(request: Request[Any, Any, Any]) -> SharedMemoryRegistry:
    registry: SharedMemoryRegistry = request.app.state.shared_memory
    return registry


def _caller(request: Request[Any, Any, Any]) -> Caller:
    """The request's client as shared memory knows it: its address (the connection's peer, or the
    proxy's X-Forwarded-For where MODEL_ROUTER_PROXY_HEADERS trusts it) and the key it presented."""
    policy: AccessPolicy = request.app.state.access_policy
    holder = policy.holder(tuple(request.headers.getall("authorization", ())))
    host = request.client.host if request.client is not None else None
    return registry_of(request).caller(host, holder.id, holder.admin)


def client_regions(request: Request[Any, Any, Any], read_limit: int) -> ClientRegions:
    """The regions as this request's client may use them (its address checked at first use)."""
    return registry_of(request).for_client(_caller(request), read_limit)


def _ok() -> Response[bytes]:
    return Response(b"", status_code=200, media_type=MediaType.TEXT)


def _status_json(regions: list[RegionStatus]) -> list[dict[str, Any]]:
    return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in regions]


@get(["/systemsharedmemory/status", "/systemsharedmemory/region/{name:str}/status"],
     summary="V2 system shared memory: the registered regions")
async def system_status(request: Request[Any, Any, Any]) -> list[dict[str, Any]]:
    return _status_json(registry_of(request).status(_caller(request), request.path_params.get("name")))


@post("/systemsharedmemory/region/{name:str}/register", status_code=200,
      summary="V2 system shared memory: register a region of a POSIX shared memory object under /dev/shm")
async def system_register(name: FromPath[str], request: Request[Any, Any, Any]) -> Response[bytes]:
    registry, caller = registry_of(request), _caller(request)
    registry.check_may_register(caller)  # before reading the body
    spec = loads_bounded(await request.body(), "the register request", expected='JSON like {"key": ..., "byte_size": ...}')
    if not isinstance(spec, dict):
        raise InputError(f"the register request must be a JSON object, got {brief(spec)}")
    key, offset, size = spec.get("key"), spec.get("offset", 0), spec.get("byte_size")
    if not isinstance(key, str):
        raise InputError(f"the register request needs 'key', a string, got {brief(key, 40)}")
    for field, value in (("offset", offset), ("byte_size", size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"the register request's {field!r} must be an integer, got {brief(value, 40)}")
    registry.register(caller, name, key, offset, size)
    return _ok()


@post(["/systemsharedmemory/unregister", "/systemsharedmemory/region/{name:str}/unregister"], status_code=200,
      summary="V2 system shared memory: unregister one region, or every one")
async def system_unregister(request: Request[Any, Any, Any]) -> Response[bytes]:
    registry_of(request).unregister(_caller(request), request.path_params.get("name"))
    return _ok()


@get(["/cudasharedmemory/status", "/cudasharedmemory/region/{name:str}/status"],
     summary="V2 CUDA shared memory: not supported, so no region is ever registered")
async def cuda_status(request: Request[Any, Any, Any]) -> list[dict[str, Any]]:
    if request.path_params.get("name") is not None:
        raise refuse_cuda()
    return []


@post("/cudasharedmemory/region/{name:str}/register", status_code=200, summary="V2 CUDA shared memory: not supported (400, as Triton answers)")
async def cuda_register(name: FromPath[str]) -> Response[bytes]:
    raise refuse_cuda()


@post(["/cudasharedmemory/unregister", "/cudasharedmemory/region/{name:str}/unregister"], status_code=200,
      summary="V2 CUDA shared memory: nothing to unregister")
async def cuda_unregister() -> Response[bytes]:
    return _ok()


SHARED_MEMORY_ROUTES = [system_status, system_register, system_unregister, cuda_status, cuda_register, cuda_unregister]
