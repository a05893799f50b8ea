"""Admin routes: change the fleet while it serves. They need an admin key when keys are set.

    POST   /models/{name}/load     load now and keep resident until unloaded
    POST   /models/{name}/unload   unload now (queued requests get 503) and keep out until loaded
    PUT    /models/{name}          add or change a model: its fleet-file section as JSON or YAML
    DELETE /models/{name}          answer what it accepted, unload, forget (409 while a pipeline uses it)
    POST   /admin/reload           re-read the fleet file and apply the difference (as SIGHUP)

Pipelines have theirs beside them (router.http.pipelines): PUT and DELETE /pipelines/{name}.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import yaml
from litestar import Request, Response, delete, post, put
from litestar.params import FromPath

from router.config import MAX_CONFIG_DEPTH, nesting_exceeds
from router.errors import ConfigError, InputError
from router.http.auth import Access
from router.http.request import runtime_of
from router.sdk.bounded_json import loads_bounded

__all__ = ["ADMIN", "ADMIN_ROUTES", "fleet_section"]

ADMIN = {"access": Access.ADMIN}
MAX_SECTION_BYTES = 1 << 20


@post("/models/{name:str}/load", status_code=200, summary="Load a model now and keep it resident", opt=ADMIN)
async def load_model(name: FromPath[str], request: Request[Any, Any, Any]) -> dict[str, Any]:
    return (await runtime_of(request).load_model(name)).as_dict()


@post("/models/{name:str}/unload", status_code=200, summary="Unload a model now and keep it out", opt=ADMIN)
async def unload_model(name: FromPath[str], request: Request[Any, Any, Any]) -> dict[str, Any]:
    info, reports = await runtime_of(request).unload_model(name)
    return {"model": info.as_dict(), "unloaded": [asdict(report) for report in reports]}


@put("/models/{name:str}", summary="Add or change a model from its fleet-file section (JSON or YAML)", opt=ADMIN)
async def put_model(name: FromPath[str], request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
    section = fleet_section(await request.body(), request.headers.get("content-type", ""))
    try:
        outcome, info = await runtime_of(request).put_model(name, section)
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    return Response({"outcome": outcome, "model": info.as_dict()}, status_code=201 if outcome == "added" else 200)


@delete("/models/{name:str}", status_code=200, summary="Remove a model: answer what it accepted, unload it", opt=ADMIN)
async def delete_model(name: FromPath[str], request: Request[Any, Any, Any]) -> dict[str, str]:
    await runtime_of(request).delete_model(name)
    return {"deleted": name}


@post("/admin/reload", status_code=200, summary="Re-read the fleet file and apply the difference", opt=ADMIN)
async def reload_fleet(request: Request[Any, Any, Any]) -> dict[str, Any]:
    try:
        report = await runtime_of(request).reload()
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    return asdict(report)


def fleet_section(body: bytes, media_type: str, what: str = "model", example: str = '{"plugin": "resnet", ...}') -> dict[str, Any]:
    """A model's (or pipeline's) section from JSON or YAML (YAML is a superset: either parses)."""
    if not body.strip():
        raise InputError(f"the body is empty; send the {what}'s fleet-file section, e.g. {example}")
    if len(body) > MAX_SECTION_BYTES:
        raise InputError(f"a {what}'s section is at most {MAX_SECTION_BYTES} bytes")
    too_deep = InputError(f"a {what}'s section nests mappings and lists more than {MAX_CONFIG_DEPTH} levels deep")
    if "json" in media_type:
        data = loads_bounded(body, "the body", expected="valid JSON", max_depth=MAX_CONFIG_DEPTH)
    else:
        try:
            data = yaml.safe_load(body)
        except RecursionError:
            raise too_deep from None
        except (ValueError, yaml.YAMLError) as exc:
            raise InputError(f"the body is not valid YAML (UTF-8 text): {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise InputError(f"a {what}'s section must be a mapping like {example}, got {type(data).__name__}")
    if nesting_exceeds(data, MAX_CONFIG_DEPTH):
        raise too_deep
    return data


ADMIN_ROUTES = [load_model, unload_model, put_model, delete_model, reload_fleet]
