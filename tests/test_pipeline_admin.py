"""Pipelines changed while the fleet serves: added, changed and removed like models, the models
they use kept from under them (409), and the fleet file's reload applying both."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from router.errors import ConfigError, Conflict, ModelNotFound
from router.pipelines import PipelineRunner
from router.serving.plan import load_plan
from router.serving.runtime import Runtime, in_process
from tests.test_pipelines import fleet, jpeg
from tests.test_runtime import running, until

DC = {"steps": [{"model": "boxes"}, {"transform": "crop"}, {"model": "pixels"}]}


def runtime_for(tmp_path: Path, text: str) -> Runtime:
    path = tmp_path / "fleet.yaml"
    path.write_text(text, encoding="utf-8")
    return in_process(load_plan(path))


async def test_a_pipeline_is_added_changed_and_removed_at_run_time(tmp_path: Path) -> None:
    async with running(runtime_for(tmp_path, fleet(tmp_path / "r.jsonl"))) as runtime:
        runner = PipelineRunner(runtime)
        assert (await runtime.put_pipeline("two", DC))[0] == "added"
        assert len((await runner.run("two", jpeg(64, 48))).output["detections"]) == 3
        assert (await runtime.put_pipeline("two", DC))[0] == "unchanged"
        fewer = {"steps": [{"model": "boxes"}, {"transform": "crop", "options": {"max_items": 1}}, {"model": "pixels"}]}
        outcome, plan = await runtime.put_pipeline("two", fewer)
        assert outcome == "changed" and plan.config.steps[1].options == {"max_items": 1}
        assert len((await runner.run("two", jpeg(64, 48))).output["detections"]) == 1  # the new definition serves
        assert sorted(p.name for p in runtime.pipelines()) == ["dc", "two"]
        await runtime.delete_pipeline("two")
        assert runtime.pipeline("two") is None
        with pytest.raises(ModelNotFound, match="no pipeline named 'two'; pipelines: dc"):
            await runtime.delete_pipeline("two")


async def test_a_bad_pipeline_section_is_refused_naming_its_key(tmp_path: Path) -> None:
    async with running(runtime_for(tmp_path, fleet(tmp_path / "r.jsonl"))) as runtime:
        with pytest.raises(ConfigError, match=r"PUT /pipelines/p: pipelines.p.steps\[2\].model: no model named 'pixel'"):
            await runtime.put_pipeline("p", {"steps": [{"model": "boxes"}, {"transform": "crop"}, {"model": "pixel"}]})
        with pytest.raises(ConfigError, match="pipelines.p.stepz: unknown key; accepted: steps, timeout_ms"):
            await runtime.put_pipeline("p", {"stepz": []})
        with pytest.raises(ConfigError, match="pipelines.boxes: a model is named 'boxes' too"):
            await runtime.put_pipeline("boxes", DC)
        assert [p.name for p in runtime.pipelines()] == ["dc"]  # nothing changed


async def test_a_model_a_pipeline_uses_is_not_deleted_from_under_it(tmp_path: Path) -> None:
    async with running(runtime_for(tmp_path, fleet(tmp_path / "r.jsonl"))) as runtime:
        with pytest.raises(Conflict) as error:
            await runtime.delete_model("pixels")
        assert error.value.status_code == 409
        assert "model 'pixels' is used by pipeline(s) dc: delete them" in error.value.detail
        assert runtime.model("pixels").serving
        await runtime.delete_pipeline("dc")
        await runtime.delete_model("pixels")
        assert "pixels" not in runtime.model_names()


async def test_a_pipeline_that_is_a_step_of_another_is_not_deleted_first(tmp_path: Path) -> None:
    more = "  outer: {steps: [{pipeline: dc}, {transform: whole}, {model: pixels}]}\n"
    async with running(runtime_for(tmp_path, fleet(tmp_path / "r.jsonl", more=more))) as runtime:
        with pytest.raises(Conflict, match="pipeline 'dc' is a step of pipeline\\(s\\) outer"):
            await runtime.delete_pipeline("dc")


async def test_a_model_change_a_pipeline_could_not_use_is_refused(tmp_path: Path) -> None:
    async with running(runtime_for(tmp_path, fleet(tmp_path / "r.jsonl"))) as runtime:
        with pytest.raises(Conflict) as error:
            await runtime.put_model("pixels", {"plugin": "scripted"})  # JSON only: it cannot take crops
        assert error.value.status_code == 409
        assert "model 'pixels' is used by pipeline(s) dc, which could not use this section" in error.value.detail
        assert "transform crop gives images" in error.value.detail
        assert runtime.model("pixels").plugin["name"] == "pixels"
        outcome, _ = await runtime.put_model("pixels", {"plugin": "pixels", "options": {"fixed_ms": 1}})
        assert outcome == "changed"
        with pytest.raises(Conflict, match="a pipeline is named 'dc'"):
            await runtime.put_model("dc", {"plugin": "pixels"})


async def test_a_request_inside_a_pipeline_finishes_on_the_definition_it_started_with(tmp_path: Path) -> None:
    text = fleet(tmp_path / "r.jsonl", pixels="fixed_ms: 300")
    async with running(runtime_for(tmp_path, text)) as runtime:
        runner = PipelineRunner(runtime)
        inside = asyncio.create_task(runner.run("dc", jpeg(64, 48)))
        await until(lambda: runtime.model("pixels").queue_depth > 0 or any(i.busy for i in runtime.model("pixels").instances))
        await runtime.delete_pipeline("dc")
        assert len((await inside).output["detections"]) == 3
        with pytest.raises(ModelNotFound):
            await runner.run("dc", jpeg(64, 48))


async def test_a_reload_applies_the_files_pipelines(tmp_path: Path) -> None:
    record = tmp_path / "r.jsonl"
    runtime = runtime_for(tmp_path, fleet(record))
    async with running(runtime):
        added = fleet(record, more="  whole-image: {steps: [{model: boxes}, {transform: whole}, {model: pixels}]}\n")
        (tmp_path / "fleet.yaml").write_text(added.replace("  dc:\n", "  renamed:\n"), encoding="utf-8")
        report = await runtime.reload()
        assert report.pipelines == {"dc": "removed", "renamed": "added", "whole-image": "added"}
        assert sorted(p.name for p in runtime.pipelines()) == ["renamed", "whole-image"]
        answer = await PipelineRunner(runtime).run("whole-image", jpeg(64, 48))
        assert answer.output["pixels"]["width"] == 64
        # A model leaves with the pipeline that used it, in one reload.
        only_boxes = "models:\n  boxes: {plugin: boxes}\n"
        (tmp_path / "fleet.yaml").write_text(only_boxes, encoding="utf-8")
        report = await runtime.reload()
        assert report.removed == ["pixels"] and report.pipelines == {"renamed": "removed", "whole-image": "removed"}
        assert runtime.pipelines() == []
