"""Pipelines over HTTP: predict at the models' own route, and the pipelines' routes.

    POST   /models/{pipeline}/predict   run one input through a pipeline (the predict handler calls `predict_pipeline`)
    GET    /pipelines                   every pipeline: steps, state, counters
    GET    /pipelines/{name}            one pipeline
    PUT    /pipelines/{name}            add or change a pipeline: its fleet-file section as JSON or YAML (admin)
    DELETE /pipelines/{name}            remove a pipeline; requests inside it finish (admin)
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, delete, get, put
from litestar.params import FromPath

from router.errors import ConfigError, InputError
from router.http.admin import ADMIN, fleet_section
from router.http.request import pipelines_of, received_at, run_unless_disconnected, runtime_of
from router.logs import request_id_var
from router.pipelines import PipelineRunner
from router.sdk.plugin import Payload
from router.serving.rules import Screened
from router.tracing.api import Phases

__all__ = ["PIPELINE_ROUTES", "predict_pipeline"]


async def predict_pipeline(name: str, request: Request[Any, Any, Any], payload: Payload, runner: PipelineRunner,
                           priority: int | None, timeout_ms: float | None,
                           trace: Phases | None = None, screened: Screened | None = None) -> Response[dict[str, Any]]:
    """The predict route's answer for a pipeline: the first model's answer with each item's
    downstream answers attached, and per-step timing. `trace`: the request's path of phases;
    `screened`: the request's screen at the door (`PipelineRunner.screen`)."""
    state = request.scope["state"]
    state["access"] = {"model": name, "pipeline": name, "input_bytes": len(payload.body)}
    answer = await run_unless_disconnected(
        request, runner.run(name, payload, priority=priority, timeout_ms=timeout_ms,
                            request_id=request_id_var.get(), received_at=received_at(request), trace=trace,
                            screened=screened))
    if trace is not None:
        trace.enter("respond")  # from the pipeline's answer
    state["access"].update(items=answer.items, steps={s.key: s.items for s in answer.steps},
                           pipeline_ms=round(answer.seconds * 1000, 3))
    return Response({"pipeline": name, "request_id": answer.request_id, "result": answer.output,
                     "timing": answer.timing()})


@get("/pipelines", summary="All pipelines with their steps, state and counters")
async def list_pipelines(request: Request[Any, Any, Any]) -> dict[str, Any]:
    return {"pipelines": [info.as_dict() for info in pipelines_of(request).infos()]}


@get("/pipelines/{name:str}", summary="One pipeline's steps, state and counters")
async def show_pipeline(name: FromPath[str], request: Request[Any, Any, Any]) -> dict[str, Any]:
    return pipelines_of(request).info(name).as_dict()


@put("/pipelines/{name:str}", summary="Add or change a pipeline from its fleet-file section (JSON or YAML)", opt=ADMIN)
async def put_pipeline(name: FromPath[str], request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
    section = fleet_section(await request.body(), request.headers.get("content-type", ""), "pipeline",
                            '{"steps": [{"model": "yolov8n"}, {"transform": "crop"}, {"model": "resnet18"}]}')
    try:
        outcome, _ = await runtime_of(request).put_pipeline(name, section)
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    info = pipelines_of(request).info(name)
    return Response({"outcome": outcome, "pipeline": info.as_dict()}, status_code=201 if outcome == "added" else 200)


@delete("/pipelines/{name:str}", status_code=200, summary="Remove a pipeline; requests inside it finish", opt=ADMIN)
async def delete_pipeline(name: FromPath[str], request: Request[Any, Any, Any]) -> dict[str, str]:
    await runtime_of(request).delete_pipeline(name)
    return {"deleted": name}


PIPELINE_ROUTES = [list_pipelines, show_pipeline, put_pipeline, delete_pipeline]
