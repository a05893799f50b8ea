"""The pipelines: section checked before any port opens: shape, names, options, what each step can
take from the one before, cycles; each problem one line naming file, key, bad value and what is
accepted, as `model-router check` prints it."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.cli import main
from router.errors import ConfigError
from router.serving.plan import FleetPlan, load_plan

MODELS = """
models:
  boxes: {plugin: boxes}
  pixels: {plugin: pixels}
  json: {plugin: scripted}
"""


def plan_of(tmp_path: Path, pipelines: str, models: str = MODELS) -> FleetPlan:
    path = tmp_path / "fleet.yaml"
    path.write_text(models + "pipelines:\n" + pipelines, encoding="utf-8")
    return load_plan(path)


def problems(tmp_path: Path, pipelines: str, models: str = MODELS) -> str:
    with pytest.raises(ConfigError) as error:
        plan_of(tmp_path, pipelines, models)
    return str(error.value)


DETECT_CLASSIFY = """
  p:
    steps:
      - model: boxes
      - transform: crop
        options: {max_items: 4, min_score: 0.5}
      - model: pixels
"""


def test_a_detector_then_crops_then_a_classifier_resolves(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, DETECT_CLASSIFY)
    pipeline = plan.pipelines["p"]
    assert pipeline.entry == "boxes" and pipeline.models == ("boxes", "pixels")
    assert pipeline.config.timeout_ms == 10_000
    assert plan.users_of("pixels") == ["p"] and plan.users_of("json") == []
    described = plan.describe()["pipelines"]["p"]
    assert described["steps"][1] == {"transform": "crop", "options": {"max_items": 4, "min_score": 0.5}}


def test_a_pipeline_may_run_another_as_a_step(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, DETECT_CLASSIFY + """
  outer:
    steps: [{pipeline: p}, {transform: whole}, {model: pixels}]
""")
    assert plan.pipelines["outer"].entry == "boxes"
    assert plan.users_of("boxes") == ["outer", "p"]


@pytest.mark.parametrize(("pipelines", "expected"), [
    ("  p: {steps: [{model: boxes}, {transform: crop}, {model: pixel}]}\n",
     "fleet.yaml: pipelines.p.steps[2].model: no model named 'pixel'; models: boxes, json, pixels; did you mean 'pixels'?"),
    ("  p: {steps: [{pipeline: q}]}\n", "pipelines.p.steps[0].pipeline: no pipeline named 'q'; pipelines: p"),
    ("  p: {steps: [{model: boxes}, {transform: cropp}, {model: pixels}]}\n",
     "pipelines.p.steps[1].transform: no transform named 'cropp'; transforms: crop, halves, whole"),
    ("  p: {steps: [{model: boxes}, {transform: crop, options: {max_items: 0}}, {model: pixels}]}\n",
     "pipelines.p.steps[1].options.max_items: Input should be greater than or equal to 1 (got 0)"),
    ("  p: {steps: [{model: boxes}, {transform: crop, options: {maxitems: 3}}, {model: pixels}]}\n",
     "pipelines.p.steps[1].options.maxitems: unknown key; accepted: padding, min_size, min_score, max_items (got 3)"),
    ("  boxes: {steps: [{model: pixels}]}\n", "pipelines.boxes: a model is named 'boxes' too"),
])
def test_a_name_or_option_that_is_not_there_is_named_with_what_is(tmp_path: Path, pipelines: str, expected: str) -> None:
    assert expected in problems(tmp_path, pipelines)


@pytest.mark.parametrize(("pipelines", "expected"), [
    ("  p: {steps: [{model: pixels}, {transform: crop}, {model: pixels}]}\n",
     ("pipelines.p.steps[1]: transform crop reads the answer of a model that answers detections; model pixels answers "
      "colours (plugin pixels)")),
    ("  p: {steps: [{model: boxes}, {transform: crop}, {model: json}]}\n",
     ("pipelines.p.steps[1]: transform crop gives images, for a model that accepts image/*; model json accepts "
      "application/json, application/octet-stream (plugin scripted)")),
    ("  p: {steps: [{model: json}, {transform: whole}, {model: pixels}]}\n",
     "pipelines.p.steps[1]: transform whole passes on the image model json took, but it takes application/json"),
])
def test_a_step_whose_input_the_step_before_cannot_give_is_refused(tmp_path: Path, pipelines: str, expected: str) -> None:
    assert expected in problems(tmp_path, pipelines)


def test_cycles_of_pipelines_are_refused(tmp_path: Path) -> None:
    text = problems(tmp_path, """
  a: {steps: [{model: boxes}, {transform: whole}, {pipeline: b}]}
  b: {steps: [{pipeline: a}]}
  c: {steps: [{model: pixels}, {transform: whole}, {pipeline: c}]}
""")
    assert "pipelines.a.steps: a cycle of pipelines: a -> b -> a; a pipeline cannot run itself" in text
    assert "pipelines.b.steps: a cycle of pipelines: b -> a -> b" in text
    assert "pipelines.c.steps: a cycle of pipelines: c -> c" in text


@pytest.mark.parametrize(("pipelines", "expected"), [
    ("  p: {steps: [{model: boxes}, {model: pixels}]}\n",
     "pipelines.p: steps[1] is a model right after model boxes; put a transform between them: `- transform: crop`"),
    ("  p: {steps: [{transform: crop}, {model: pixels}]}\n",
     "pipelines.p: steps[0] is transform crop, the first step; a transform goes between two models"),
    ("  p: {steps: [{model: boxes}, {transform: crop}]}\n",
     "pipelines.p: the last step is transform crop; end with the model it feeds"),
    ("  p: {steps: [{model: boxes, transform: crop}]}\n",
     "pipelines.p.steps.0: a step names exactly one of model, pipeline or transform, got model, transform"),
    ("  p: {steps: [{model: boxes, options: {a: 1}}]}\n",
     "pipelines.p.steps.0: options belong to a transform step; this step is a model"),
    ("  p: {steps: [{modle: boxes}]}\n",
     "pipelines.p.steps.0.modle: unknown key; accepted: model, pipeline, transform, options"),
    ("  p: {steps: []}\n", "pipelines.p.steps: List should have at least 1 item"),
    ("  p: {steps: [{model: boxes}], timeout: 5}\n", "pipelines.p.timeout: unknown key; accepted: steps, timeout_ms"),
    ("  'bad name': {steps: [{model: boxes}]}\n", "pipeline name 'bad name' is not valid"),
])
def test_the_shape_of_a_pipeline_is_checked(tmp_path: Path, pipelines: str, expected: str) -> None:
    assert expected in problems(tmp_path, pipelines)


def test_the_models_of_a_pipeline_share_their_priority_levels(tmp_path: Path) -> None:
    models = MODELS.replace("pixels: {plugin: pixels}", "pixels: {plugin: pixels, queue: {priority_levels: 5}}")
    text = problems(tmp_path, DETECT_CLASSIFY, models)
    assert ("pipelines.p: its models have different queue.priority_levels (boxes: 3, pixels: 5); X-Priority carries "
            "to every step, so they must agree") in text


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    text = problems(tmp_path, """
  p: {steps: [{model: boxes}, {transform: crop}, {model: nope}]}
  q: {steps: [{model: pixels}, {transform: crop}, {model: pixels}]}
""")
    assert text.startswith("fleet.yaml: invalid configuration (2 problem(s))") or "(2 problem(s))" in text
    assert "pipelines.p.steps[2].model" in text and "pipelines.q.steps[1]" in text


def test_model_router_check_validates_and_describes_pipelines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(MODELS + "pipelines:\n" + DETECT_CLASSIFY, encoding="utf-8")
    assert main(["check", "--config", str(good)]) == 0
    out = capsys.readouterr()
    assert '"entry": "boxes"' in out.out and "3 model(s), 1 pipeline(s) on 1 device(s)" in out.err
    bad = tmp_path / "bad.yaml"
    bad.write_text(MODELS + "pipelines:\n  p: {steps: [{model: boxes}, {transform: crop}, {model: nope}]}\n",
                   encoding="utf-8")
    assert main(["check", "--config", str(bad)]) == 2
    assert f"model-router: {bad}: pipelines.p.steps[2].model: no model named 'nope'" in capsys.readouterr().err
