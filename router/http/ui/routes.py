"""The live page's routes: the page itself and its two files (open: they hold no data), and
`/ui/state`, its data, guarded like `/models`."""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from typing import Any

from litestar import MediaType, Request, Response, Router, get
from litestar.exceptions import NotFoundException
from litestar.params import FromPath

from router.http.auth import Access
from router.http.ui.state import fleet_state

__all__ = ["ui_router"]

ASSETS = {"index.html": MediaType.HTML.value, "ui.js": "text/javascript", "ui.css": "text/css"}
# Everything the page loads comes from the router itself: no inline script, no third-party origin.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


@cache
def _asset(name: FromPath[str]) -> bytes:
    return (files("router.http.ui") / "static" / name).read_bytes()


def _file(name: FromPath[str]) -> Response[bytes]:
    return Response(_asset(name), media_type=ASSETS[name], headers=HEADERS)


@get("/", opt={"access": Access.OPEN}, include_in_schema=False)
async def page() -> Response[bytes]:
    return _file("index.html")


@get("/static/{name:str}", opt={"access": Access.OPEN}, include_in_schema=False)
async def asset(name: FromPath[str]) -> Response[bytes]:
    if name not in ASSETS or name == "index.html":
        raise NotFoundException(f"no page file named {name!r}")
    return _file(name)


@get("/state", summary="The live page's data: devices, models, pipelines and cumulative histograms",
     opt={"access": Access.PREDICT})
async def state(request: Request[Any, Any, Any]) -> dict[str, Any]:
    return fleet_state(request.app.state.runtime, request.app.state.metrics, request.app.state.pipelines)


ui_router = Router(path="/ui", route_handlers=[page, asset, state])
