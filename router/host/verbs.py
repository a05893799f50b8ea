"""The admin verbs a front forwards to the engine (`Call` -> `CallReply`), and their encoding.

A front's admin routes (load, unload, PUT, DELETE, reload) and its drain reach the one runtime
there is, in the engine; results travel as msgpack of the same frozen snapshots the routes show.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Final

import msgspec

from router.errors import ConfigError, RouterError
from router.host.messages import Call, CallReply, Failure
from router.pipeline_config import PipelineConfig
from router.serving.editor import ReloadReport
from router.serving.plan import PipelinePlan
from router.serving.residency_executor import UnloadReport
from router.serving.runtime import Runtime
from router.serving.snapshots import ModelInfo
from router.serving.traffic import TrafficChange
from router.serving.versions import VersionRoute

__all__ = ["RESULT_TYPES", "call_args", "pipeline_from_wire", "pipeline_wire", "run_call"]

log = logging.getLogger("router.host.verbs")
#: What each verb returns, to decode its result on the front's side.
RESULT_TYPES: Final[dict[str, Any]] = {
    "load": ModelInfo,
    "unload": tuple[ModelInfo, list[UnloadReport]],
    "release": tuple[ModelInfo, list[UnloadReport]],
    "put": tuple[str, ModelInfo],
    "delete": None,
    "reload": ReloadReport,
    "put_pipeline": tuple[str, dict[str, Any]],  # (outcome, `pipeline_wire`)
    "delete_pipeline": None,
    "begin_drain": None,
    "put_version": tuple[str, ModelInfo],
    "delete_version": None,
    "set_traffic": VersionRoute,
}


def pipeline_wire(plan: PipelinePlan) -> dict[str, Any]:
    """A pipeline's plan as plain data, for a message."""
    return {"name": plan.name, "config": plan.config.model_dump(mode="json"), "models": list(plan.models),
            "entry": plan.entry}


def pipeline_from_wire(data: dict[str, Any]) -> PipelinePlan:
    return PipelinePlan(data["name"], PipelineConfig.model_validate(data["config"]), tuple(data["models"]), data["entry"])


def call_args(**kwargs: Any) -> bytes:
    return msgspec.msgpack.encode(kwargs)


async def run_call(runtime: Runtime, call: Call, news: Any = None) -> CallReply:
    """Run one verb on the runtime; its result or its error as a reply."""
    args = msgspec.msgpack.decode(call.args) if call.args else {}
    try:
        result = await _run(runtime, call.verb, args)
    except RouterError as exc:
        return CallReply(call.id, failure=Failure.of(exc))
    except ConfigError as exc:
        return CallReply(call.id, failure=Failure("ConfigError", str(exc)))
    except Exception as exc:  # a bug: the front answers 500, the engine logs it once
        log.exception("admin call %s failed", call.verb)
        return CallReply(call.id, failure=Failure("ModelError", f"{call.verb} failed: {type(exc).__name__}: {exc}"))
    return CallReply(call.id, msgspec.msgpack.encode(result))


async def _run(runtime: Runtime, verb: str, args: dict[str, Any]) -> Any:
    if verb == "load":
        return await runtime.load_model(args["name"])
    if verb == "unload":
        return await runtime.unload_model(args["name"])
    if verb == "release":
        return await runtime.release_model(args["name"], unload=bool(args.get("unload")))
    if verb == "put":
        return await runtime.put_model(args["name"], args["section"], args.get("source", "PUT /models"))
    if verb == "delete":
        await runtime.delete_model(args["name"])
        return None
    if verb == "reload":
        return await runtime.reload(Path(args["path"]) if args.get("path") else None)
    if verb == "put_pipeline":
        outcome, plan = await runtime.put_pipeline(args["name"], args["section"], args.get("source", "PUT /pipelines"))
        return outcome, pipeline_wire(plan)
    if verb == "delete_pipeline":
        await runtime.delete_pipeline(args["name"])
        return None
    if verb == "put_version":
        return await runtime.put_version(args["name"], args["version"], args["section"], args.get("source", "PUT /models"))
    if verb == "delete_version":
        await runtime.delete_version(args["name"], args["version"])
        return None
    if verb == "set_traffic":
        return await runtime.set_traffic(args["name"], msgspec.convert(args["change"], TrafficChange))
    if verb == "begin_drain":
        runtime.begin_drain()
        return None
    raise ConfigError(f"no admin verb named {verb!r}; verbs: {', '.join(RESULT_TYPES)}")


def decode_result(verb: str, data: bytes) -> Any:
    kind = RESULT_TYPES.get(verb)
    return None if kind is None else msgspec.msgpack.decode(data, type=kind)
