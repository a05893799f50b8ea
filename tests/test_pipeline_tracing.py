"""A traced pipeline request, in process: the runner on a real runtime with the test kit's image
plugins, its spans exported to memory by the OpenTelemetry SDK. Each step is a stage span beside
the request's "pipeline" phase, each item a model step sends has its own phases under the stage,
linked to the batch it rode (which links back to the stage); a step inside a pipeline run as a
step is a stage of that step's stage; a step that fails fails its stage."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from router.errors import ModelError
from router.pipelines import PipelineRunner
from tests.test_pipelines import fleet, jpeg
from tests.test_runtime import make_runtime, running, until
from tests.test_tracing import in_memory

ITEM_PHASES = ["admission", "preprocess", "queue wait", "execute", "postprocess"]


def under(exporter: InMemorySpanExporter, parent: ReadableSpan) -> list[ReadableSpan]:
    assert parent.context is not None
    return sorted((s for s in exporter.get_finished_spans()
                   if s.parent is not None and s.parent.span_id == parent.context.span_id), key=lambda s: s.start_time or 0)


def by_name(spans: list[ReadableSpan]) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans}


async def test_each_step_is_a_stage_and_each_item_has_its_phases_linked_to_its_batch(tmp_path: Path) -> None:
    tracing, exporter = in_memory()
    async with running(make_runtime(tmp_path, fleet(tmp_path / "record.jsonl"), tracing=tracing)) as runtime:
        span = tracing.start_request("POST", "/models/dc/predict", [], time.monotonic())
        path = span.phases()
        assert path is not None
        path.enter("receive", time.monotonic())
        answer = await PipelineRunner(runtime).run("dc", jpeg(64, 48), request_id="r", trace=path)
        path.enter("respond")
        span.end(200, time.monotonic())
    [server] = [s for s in exporter.get_finished_spans() if s.name == "POST"]
    children = under(exporter, server)
    assert [s.name for s in children if not s.name.startswith("step ")] == ["receive", "pipeline", "respond"]
    stages = by_name([s for s in children if s.name.startswith("step ")])
    assert sorted(stages) == ["step 0:boxes", "step 1:crop", "step 2:pixels"]
    pipeline = by_name(children)["pipeline"]
    assert all(pipeline.start_time <= s.start_time and s.end_time <= pipeline.end_time  # type: ignore[operator]
               for s in stages.values())
    timing = {s["step"]: s for s in answer.timing()["steps"]}
    for name, stage in stages.items():
        assert stage.attributes is not None
        assert stage.attributes["router.step"] == name.removeprefix("step ")
        assert stage.attributes["router.items"] == timing[name.removeprefix("step ")]["items"]
    assert stages["step 0:boxes"].attributes["router.model"] == "boxes"  # type: ignore[index]
    assert stages["step 1:crop"].attributes["router.transform"] == "crop"  # type: ignore[index]
    assert under(exporter, stages["step 1:crop"]) == []
    for stage_name, items in (("step 0:boxes", 1), ("step 2:pixels", 3)):
        stage = stages[stage_name]
        phases = under(exporter, stage)
        for item in range(items):
            item_path = [p for p in phases if p.attributes is not None and p.attributes["router.item"] == item]
            assert [p.name for p in item_path] == ITEM_PHASES
            assert all(a.end_time == b.start_time for a, b in itertools.pairwise(item_path))
            [link] = item_path[3].links
            batch = next(s for s in exporter.get_finished_spans() if s.context is not None
                         and s.context.span_id == link.context.span_id)
            assert batch.name == "batch"
            assert any(back.context.span_id == stage.context.span_id for back in batch.links)  # type: ignore[union-attr]
        assert len(phases) == items * len(ITEM_PHASES)


async def test_a_pipeline_run_as_a_step_nests_its_steps_stages(tmp_path: Path) -> None:
    tracing, exporter = in_memory()
    more = "  outer:\n    steps: [{pipeline: dc}, {transform: whole}, {model: pixels}]\n"
    async with running(make_runtime(tmp_path, fleet(tmp_path / "record.jsonl", more=more), tracing=tracing)) as runtime:
        span = tracing.start_request("POST", "/models/outer/predict", [], time.monotonic())
        await PipelineRunner(runtime).run("outer", jpeg(64, 48), trace=span.phases())
        span.end(200, time.monotonic())
    [server] = [s for s in exporter.get_finished_spans() if s.name == "POST"]
    stages = by_name([s for s in under(exporter, server) if s.name.startswith("step ")])
    assert sorted(stages) == ["step 0:dc", "step 1:whole", "step 2:pixels"]
    inner = by_name(under(exporter, stages["step 0:dc"]))
    assert sorted(inner) == ["step 0:dc/0:boxes", "step 0:dc/1:crop", "step 0:dc/2:pixels"]
    assert stages["step 0:dc"].attributes == {"router.step": "0:dc", "router.pipeline": "dc"}  # its items are its steps'
    outer, nested = stages["step 0:dc"], inner["step 0:dc/2:pixels"]
    assert outer.start_time <= nested.start_time and nested.end_time <= outer.end_time  # type: ignore[operator]


async def test_a_failing_step_fails_its_stage_and_the_pipeline_phase(tmp_path: Path) -> None:
    tracing, exporter = in_memory()
    text = fleet(tmp_path / "record.jsonl", pixels="fail_width: 20", pixels_batch="{max_size: 1, max_delay_ms: 0}")
    async with running(make_runtime(tmp_path, text, tracing=tracing)) as runtime:
        span = tracing.start_request("POST", "/models/dc/predict", [], time.monotonic())
        with pytest.raises(ModelError) as error:
            await PipelineRunner(runtime).run("dc", jpeg(64, 48), trace=span.phases())
        span.fail(error.value)
        span.end(500, time.monotonic())
        await until(lambda: runtime.in_flight == 0)
    [server] = [s for s in exporter.get_finished_spans() if s.name == "POST"]
    children = by_name(under(exporter, server))
    failed = children["step 2:pixels"]
    assert failed.status.status_code is StatusCode.ERROR
    assert "step 2:pixels" in (failed.status.description or "") and "scripted failure" in (failed.status.description or "")
    assert children["step 0:boxes"].status.status_code is StatusCode.UNSET
    assert children["pipeline"].status.status_code is StatusCode.ERROR
    preprocess = [p for p in under(exporter, failed) if p.name == "preprocess" and p.status.status_code is StatusCode.ERROR]
    # The crop 20 wide, whose preprocess failed; on a busy machine another crop's preprocess may
    # still be running when the pipeline fails, and ends as cancelled with it, not as this failure.
    failures = [p for p in preprocess if "scripted failure" in (p.status.description or "")]
    assert len(failures) == 1, [p.status.description for p in preprocess]
