"""The admin verbs as typed messages: each crosses in a `Call` whole, runs the runtime's verb of its
name with its fields, and its result comes back as the type it declares; a verb not declared is
refused when the frame is decoded."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, get_args

import msgspec
import pytest

from router.host.messages import HEADER, Call, CallReply, Frames, FrontMessage, encode_frame
from router.pipeline_config import PipelineConfig
from router.serving.editor import ReloadReport
from router.serving.plan import PipelinePlan
from router.serving.residency_executor import UnloadReport
from router.serving.snapshots import ModelInfo
from router.serving.traffic import TrafficChange
from router.serving.verbs import (
    AdminVerb,
    BeginDrain,
    DeleteModel,
    DeletePipeline,
    DeleteVersion,
    LoadModel,
    PutModel,
    PutPipeline,
    PutVersion,
    ReleaseModel,
    Reload,
    SetTraffic,
    UnloadModel,
    pipeline_from_wire,
    pipeline_wire,
)
from router.serving.versions import VersionRoute

SECTION = {"plugin": "resnet", "options": {"weights": "r18.pt"}, "batch": {"max_size": 8}}

VERBS = [
    LoadModel("resnet"),
    UnloadModel("resnet"),
    ReleaseModel("resnet", True),
    PutModel("resnet", SECTION, "PUT /models"),
    DeleteModel("resnet"),
    Reload("/etc/router/fleet.yaml"),
    Reload(None),
    PutPipeline("crops", {"steps": [{"model": "yolo"}]}, "PUT /pipelines"),
    DeletePipeline("crops"),
    BeginDrain(),
    PutVersion("resnet", "v2", SECTION, "PUT /models"),
    DeleteVersion("resnet", "v1"),
    SetTraffic("resnet", TrafficChange(weights={"v1": 90.0, "v2": 10.0}, mirror="")),
]


def _info(name: str) -> ModelInfo:
    return ModelInfo(name=name, state="ready", serving=True, error=None, plugin={"name": "resnet", "version": "1"},
                     accepts=("image/jpeg",), devices=("cuda:0",), instances=(), queue_depth=0, queue_capacity=64,
                     queue_timeout_ms=1000, priority_levels=3, batch_max_size=8, batch_max_delay_ms=5.0,
                     budget_bytes=None, execution_timeout_ms=30_000, weight=1.0, required=False, requests={},
                     timing=(), answer_lag_ms=0.0, half_opens=0)


PLAN = PipelinePlan("crops", PipelineConfig.model_validate({"steps": [{"model": "yolo"}]}), ("yolo",), "yolo")
REPORTS = (_info("resnet"), [UnloadReport("resnet", "cuda:0", 1 << 20, None)])


class Recording:
    """A runtime that records which of its verbs ran, with what, and answers each with a fixed value."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.answers: dict[str, Any] = {
            "load_model": _info("resnet"), "unload_model": REPORTS, "release_model": REPORTS,
            "put_model": ("added", _info("resnet")), "reload": ReloadReport(added=["yolo"], errors={"x": "bad"}),
            "put_pipeline": ("added", PLAN), "put_version": ("changed", _info("resnet@v2")),
            "set_traffic": VersionRoute("resnet", ("v1", "v2"), "v1", {"v1": 90.0, "v2": 10.0}, generation=3),
        }

    def __getattr__(self, verb: str) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.ran.append((verb, args, kwargs))
            return self.answers.get(verb)

        async def run_async(*args: Any, **kwargs: Any) -> Any:
            return run(*args, **kwargs)

        return run if verb == "begin_drain" else run_async


#: What each verb must ask of the runtime: the method and the arguments it passes.
EXPECTED = {
    LoadModel: lambda v: ("load_model", (v.name,), {}),
    UnloadModel: lambda v: ("unload_model", (v.name,), {}),
    ReleaseModel: lambda v: ("release_model", (v.name,), {"unload": v.unload}),
    PutModel: lambda v: ("put_model", (v.name, v.section, v.source), {}),
    DeleteModel: lambda v: ("delete_model", (v.name,), {}),
    Reload: lambda v: ("reload", (Path(v.path) if v.path else None,), {}),
    PutPipeline: lambda v: ("put_pipeline", (v.name, v.section, v.source), {}),
    DeletePipeline: lambda v: ("delete_pipeline", (v.name,), {}),
    BeginDrain: lambda v: ("begin_drain", (), {}),
    PutVersion: lambda v: ("put_version", (v.name, v.version, v.section, v.source), {}),
    DeleteVersion: lambda v: ("delete_version", (v.name, v.version), {}),
    SetTraffic: lambda v: ("set_traffic", (v.name, v.change), {}),
}


def test_every_verb_is_covered_here() -> None:
    assert {type(verb) for verb in VERBS} == set(get_args(AdminVerb)) == set(EXPECTED)


@pytest.mark.parametrize("verb", VERBS, ids=lambda verb: type(verb).__name__)
def test_a_verb_crosses_whole_in_its_call(verb: Any) -> None:
    out = bytearray()
    encode_frame(Call(7, verb), out)
    frames = Frames(FrontMessage)
    received = [message for cut in range(0, len(out), 5) for message in frames.feed(out[cut:cut + 5])]
    assert received == [Call(7, verb)]
    assert type(received[0].verb) is type(verb)


@pytest.mark.parametrize("verb", VERBS, ids=lambda verb: type(verb).__name__)
def test_a_verb_runs_its_runtime_verb_and_its_result_comes_back_as_declared(verb: Any) -> None:
    runtime = Recording()
    result = asyncio.run(verb.apply(runtime))
    assert runtime.ran == [EXPECTED[type(verb)](verb)]
    out = bytearray()
    encode_frame(CallReply(7, msgspec.msgpack.encode(result)), out)
    [reply] = Frames(CallReply).feed(out)
    assert verb.result(reply.result) == result
    if isinstance(verb, PutPipeline):  # the plan crosses as plain data and is rebuilt on the front
        outcome, wire = verb.result(reply.result)
        assert (outcome, pipeline_from_wire(wire)) == ("added", PLAN) and wire == pipeline_wire(PLAN)


def test_a_verb_not_declared_is_refused_when_decoded() -> None:
    def frame(raw: list[Any]) -> bytes:
        body = msgspec.msgpack.encode(raw)
        return HEADER.pack(len(body)) + body

    for unknown in (["Shutdown"], ["load", "resnet"], ["LoadModel", 3], ["LoadModel"]):
        with pytest.raises(msgspec.ValidationError):
            Frames(FrontMessage).feed(frame(["Call", 1, unknown]))
    assert Frames(FrontMessage).feed(frame(["Call", 1, ["LoadModel", "resnet"]])) == [Call(1, LoadModel("resnet"))]
