"""The V2 shared-memory extension over HTTP: register, status and unregister system shared memory
regions (`router.inference_protocol.shared_memory` holds them, for gRPC too); CUDA shared memory is
declared unsupported (400 here, as Triton answers over HTTP; gRPC's UNIMPLEMENTED) except for the
calls that find nothing to do."""

from __future__ import annotations

from typing import Any

from litestar import MediaType, Request, Response, get, post
from litestar.params import FromPath

from router.errors import InputError, brief
from router.inference_protocol.shared_memory import (
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


def _client_host(request: Request[Any, Any, Any]) -> str | None:
    return request.client.host if request.client is not None else None


def client_regions(request: Request[Any, Any, Any], read_limit: int) -> ClientRegions:
    """The regions as this request's client may use them (its address checked at first use)."""
    return registry_of(request).for_client(_client_host(request), read_limit)


def _checked_registry(request: Request[Any, Any, Any]) -> SharedMemoryRegistry:
    registry = registry_of(request)
    registry.check_client(_client_host(request))
    return registry


def _ok() -> Response[bytes]:
    return Response(b"", status_code=200, media_type=MediaType.TEXT)


def _status_json(regions: list[RegionStatus]) -> list[dict[str, Any]]:
    return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in regions]


@get(["/systemsharedmemory/status", "/systemsharedmemory/region/{name:str}/status"],
     summary="V2 system shared memory: the registered regions")
async def system_status(request: Request[Any, Any, Any]) -> list[dict[str, Any]]:
    return _status_json(_checked_registry(request).status(request.path_params.get("name")))


@post("/systemsharedmemory/region/{name:str}/register", status_code=200,
      summary="V2 system shared memory: register a region of a POSIX shared memory object under /dev/shm")
async def system_register(name: FromPath[str], request: Request[Any, Any, Any]) -> Response[bytes]:
    registry = _checked_registry(request)
    spec = loads_bounded(await request.body(), "the register request", expected='JSON like {"key": ..., "byte_size": ...}')
    if not isinstance(spec, dict):
        raise InputError(f"the register request must be a JSON object, got {brief(spec)}")
    key, offset, size = spec.get("key"), spec.get("offset", 0), spec.get("byte_size")
    if not isinstance(key, str):
        raise InputError(f"the register request needs 'key', a string, got {brief(key, 40)}")
    for field, value in (("offset", offset), ("byte_size", size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"the register request's {field!r} must be an integer, got {brief(value, 40)}")
    registry.register(name, key, offset, size)
    return _ok()


@post(["/systemsharedmemory/unregister", "/systemsharedmemory/region/{name:str}/unregister"], status_code=200,
      summary="V2 system shared memory: unregister one region, or every one")
async def system_unregister(request: Request[Any, Any, Any]) -> Response[bytes]:
    _checked_registry(request).unregister(request.path_params.get("name"))
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
