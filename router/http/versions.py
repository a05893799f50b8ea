"""Admin routes of a model's versions and of its split; they need an admin key when keys are set.

    PUT    /models/{name}/versions/{version}   add or change one version: its section (JSON or YAML)
    DELETE /models/{name}/versions/{version}   remove a version that takes no traffic
    PUT    /models/{name}/traffic              change the split, the stable version or the mirror, whole

A version is served as its own model, `{name}@{version}`: load and unload it as any model
(`POST /models/resnet18@2/load`). docs/rollouts.md.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, delete, put
from litestar.params import FromPath

from router.errors import ConfigError, InputError
from router.http.admin import ADMIN, fleet_section
from router.http.request import pipelines_of, runtime_of
from router.sdk.bounded_json import loads_bounded
from router.serving.traffic import TrafficChange

__all__ = ["VERSION_ROUTES", "traffic_change"]

TRAFFIC_EXAMPLE = '{"weights": {"1": 90, "2": 10}, "stable": "1", "mirror": {"version": "2", "percent": 100}}'


@put("/models/{name:str}/versions/{version:str}", summary="Add or change one version of a model", opt=ADMIN)
async def put_version(name: FromPath[str], version: FromPath[str], request: Request[Any, Any, Any]) -> Response[Any]:
    section = fleet_section(await request.body(), request.headers.get("content-type", ""), what="version")
    try:
        outcome, info = await runtime_of(request).put_version(name, version, section)
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    return Response({"outcome": outcome, "model": info.as_dict()}, status_code=201 if outcome == "added" else 200)


@delete("/models/{name:str}/versions/{version:str}", status_code=200, summary="Remove a version without traffic",
        opt=ADMIN)
async def delete_version(name: FromPath[str], version: FromPath[str], request: Request[Any, Any, Any]) -> dict[str, str]:
    await runtime_of(request).delete_version(name, version)
    return {"deleted": f"{name} version {version}"}


@put("/models/{name:str}/traffic", summary="Change a model's split between its versions, whole", opt=ADMIN)
async def put_traffic(name: FromPath[str], request: Request[Any, Any, Any]) -> dict[str, Any]:
    change = traffic_change(await request.body())
    try:
        await runtime_of(request).set_traffic(name, change)
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    return pipelines_of(request).versions.describe(name)


def traffic_change(body: bytes) -> TrafficChange:
    """The body of PUT /models/{name}/traffic: weights, stable and mirror, each optional."""
    data = loads_bounded(body or b"null", "the body", expected="a JSON object", max_depth=4)
    if not isinstance(data, dict) or not data:
        raise InputError(f"send a JSON object with weights, stable or mirror, e.g. {TRAFFIC_EXAMPLE}")
    unknown = sorted(set(data) - {"weights", "stable", "mirror"})
    if unknown:
        raise InputError(f"unknown key(s) {', '.join(map(repr, unknown))}; accepted: weights, stable, mirror")
    mirror = data.get("mirror", ...)
    target: Any = None
    percent: Any = None
    if mirror is None:
        target = ""  # no mirror from now on
    elif mirror is not ...:
        if not isinstance(mirror, dict) or set(mirror) - {"version", "percent"} or "version" not in mirror:
            raise InputError(f"mirror is an object with version and percent (or null for none); got {mirror!r:.80}")
        target, percent = mirror["version"], mirror.get("percent", 100)
    try:  # in the struct's field order (it travels as an array)
        return msgspec.convert([data.get("weights"), data.get("stable"), target, percent], TrafficChange)
    except msgspec.ValidationError as exc:
        raise InputError(f"{exc}; e.g. {TRAFFIC_EXAMPLE}") from None


VERSION_ROUTES = [put_version, delete_version, put_traffic]
