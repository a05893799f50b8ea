"""A model's versions in the fleet file and in the fleet editor: the expansion into one model per
version and a route, every problem named under the key written, pipelines that name a model with
versions, and the editor's verbs (put a version, delete one, change the split) on a serving runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from router.config import FleetConfig, RouteConfig, load_fleet
from router.errors import ConfigError, Conflict, ModelNotFound
from router.serving.plan import load_plan
from router.serving.runtime import in_process
from router.serving.traffic import TrafficChange
from router.serving.versions import VersionRoute
from router.version_config import removal_problem
from tests.test_fleet import fleet, scripted
from tests.test_pipelines import fleet as pipeline_fleet
from tests.test_runtime import ask, make_runtime, running

RESNET = """
models:
  resnet18:
    plugin: resnet
    options: {weights: resnet18.pt}
    batch: {max_size: 8}
    versions:
      "1": {}
      2: {options: {weights: resnet18-b.pt}, queue: {max_size: 32}}
    stable: "1"
    traffic: {"1": 90, 2: 10}
    mirror: {version: "2", percent: 50}
    rollout: {candidate: "2", steps: [5, 25, 50, 100]}
  yolo: {plugin: yolo}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def problem(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as error:
        load_fleet(write(tmp_path, text))
    return str(error.value)


# -- the fleet file ---------------------------------------------------------------------------------


def test_each_version_is_a_model_merged_over_the_models_own_keys_and_the_name_a_route(tmp_path: Path) -> None:
    config = load_fleet(write(tmp_path, RESNET))
    assert list(config.models) == ["resnet18@1", "resnet18@2", "yolo"]
    one, two = config.models["resnet18@1"], config.models["resnet18@2"]
    assert one.options == {"weights": "resnet18.pt"} and two.options == {"weights": "resnet18-b.pt"}
    assert one.batch.max_size == two.batch.max_size == 8  # from the model's own keys
    assert (one.queue.max_size, two.queue.max_size) == (64, 32)  # merged key by key
    route = config.routes["resnet18"]
    assert route.versions == ["1", "2"] and route.stable == "1" and route.traffic == {"1": 90, "2": 10}
    assert route.mirror is not None and (route.mirror.version, route.mirror.percent) == ("2", 50)
    assert route.rollout is not None and route.rollout.candidate == "2" and route.rollout.steps == [5, 25, 50, 100]


def test_the_defaults_all_traffic_to_the_first_version_listed(tmp_path: Path) -> None:
    config = load_fleet(write(tmp_path, "models:\n  m:\n    plugin: p\n    versions: {b: {}, a: {device: cpu}}\n"))
    route = config.routes["m"]
    assert (route.versions, route.stable, route.traffic, route.mirror, route.rollout) == (["b", "a"], "b", {"b": 100}, None, None)


def test_the_expanded_fleet_validates_again_unchanged(tmp_path: Path) -> None:
    """As the cluster ships a fleet to its replicas and the editor re-validates it."""
    config = load_fleet(write(tmp_path, RESNET))
    assert FleetConfig.model_validate(config.model_dump()) == config
    assert FleetConfig.model_validate(config.model_dump(mode="json", exclude_none=True)) == config


def test_a_fleet_without_versions_parses_as_before(tmp_path: Path) -> None:
    config = load_fleet(write(tmp_path, "models:\n  a: {plugin: p}\n  b: {plugin: q, batch: {max_size: 2}}\n"))
    assert list(config.models) == ["a", "b"] and config.routes == {}


@pytest.mark.parametrize(("change", "message"), [
    (("max_size: 32", "max_size: 0"), "models.resnet18.versions.2.queue.max_size: Input should be greater than or equal to 1 (got 0)"),
    (("batch: {max_size: 8}", "batch: {max_size: 0}"), "models.resnet18.batch.max_size: Input should be greater than or equal to 1 (got 0)"),
    (("queue: {max_size: 32}", "queue: {maxsize: 32}"),
     "models.resnet18.versions.2.queue.maxsize: unknown key; accepted: max_size, timeout_ms, priority_levels, default_priority"),
    (('traffic: {"1": 90, 2: 10}', 'traffic: {"1": 90, 3: 10}'), "models.resnet18.traffic.3: no version '3'; versions: 1, 2"),
    (('traffic: {"1": 90, 2: 10}', 'traffic: {"1": -90, 2: 10}'),
     "models.resnet18.traffic.1: weight -90.0 is not accepted; accepted: a share of 0 or more"),
    (('traffic: {"1": 90, 2: 10}', 'traffic: {"1": 0, 2: 0}'), "models.resnet18.traffic: every weight is 0"),
    (('stable: "1"', 'stable: "9"'), "models.resnet18.stable: no version '9'; versions: 1, 2"),
    (('{version: "2", percent: 50}', '{version: "4", percent: 50}'), "models.resnet18.mirror.version: no version '4'"),
    (("percent: 50", "percent: 101"), "models.resnet18.mirror.percent: Input should be less than or equal to 100 (got 101)"),
    (('candidate: "2"', 'candidate: "7"'), "models.resnet18.rollout.candidate: no version '7'; versions: 1, 2"),
    (('stable: "1"', 'stable: "2"'), "models.resnet18.rollout.candidate: '2' is the stable version"),
    (("steps: [5, 25, 50, 100]", "steps: [50, 25]"), "models.resnet18.rollout.steps: steps must increase"),
    (('"1": {}', '"bad name": {}'), "models.resnet18.versions.bad name: version name 'bad name' is not valid; accepted: "),
    (('"1": {}', '"1": 5'), "models.resnet18.versions.1: a version's section is a mapping of the model's keys"),
    (("yolo: {plugin: yolo}", "yolo: {plugin: yolo, traffic: {a: 1}}"),
     "models.yolo: traffic: only a model with versions: takes it"),
    (("yolo: {plugin: yolo}", "yolo: {plugin: yolo, versions: []}"), "models.yolo.versions: versions must map each"),
    (("yolo: {plugin: yolo}", "yolo@2: {plugin: yolo}"), "models.yolo@2: '@' separates a name from its version"),
    (("models:", "routes: {}\nmodels:"), "routes: not a fleet-file key"),
    (("  yolo: {plugin: yolo}", "  yolo: {plugin: yolo}\npipelines:\n  resnet18: {steps: [{model: yolo}]}"),
     "pipelines.resnet18: a pipeline is named 'resnet18' too, and 'resnet18' is a model with versions"),
])
def test_each_problem_is_named_under_the_key_written(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    assert change[0] in RESNET
    assert message in problem(tmp_path, RESNET.replace(*change))


def test_a_problem_of_the_models_own_keys_is_reported_once_for_all_its_versions(tmp_path: Path) -> None:
    text = problem(tmp_path, RESNET.replace("batch: {max_size: 8}", "batch: {max_size: 0}"))
    assert text.count("max_size") == 1


# -- the plan ---------------------------------------------------------------------------------------

VERSIONED_PIXELS = """
devices:
  cpu: {max_concurrent_batches: 2}
models:
  boxes: {plugin: boxes, batch: {max_size: 4, max_delay_ms: 50}}
  pixels:
    plugin: pixels
    versions: {"1": {}, "2": {options: {fixed_ms: 1}}}
    traffic: {"1": 50, "2": 50}
pipelines:
  dc: {steps: [{model: boxes}, {transform: crop}, {model: pixels}]}
"""


def test_a_pipeline_names_a_model_with_versions_and_lists_it_by_name(tmp_path: Path) -> None:
    plan = load_plan(write(tmp_path, VERSIONED_PIXELS))
    assert plan.pipelines["dc"].models == ("boxes", "pixels")
    assert plan.users_of("pixels@2") == ["dc"] and plan.users_of("pixels") == ["dc"] and plan.users_of("boxes@1") == []
    route = plan.routes["pixels"]
    assert route == VersionRoute("pixels", ("1", "2"), "1", {"1": 50, "2": 50}, None, 0.0, 1)
    described = plan.describe()
    assert list(described["models"]) == ["boxes", "pixels@1", "pixels@2"]
    assert described["routes"]["pixels"] == {"versions": {"1": "pixels@1", "2": "pixels@2"}, "stable": "1",
                                             "traffic": {"1": 50, "2": 50}, "mirror": None, "rollout": None,
                                             "generation": 1}


def test_every_version_of_a_pipelines_model_must_take_what_the_step_before_gives(tmp_path: Path) -> None:
    text = VERSIONED_PIXELS.replace('"2": {options: {fixed_ms: 1}}', '"2": {plugin: scripted}')
    with pytest.raises(ConfigError, match=r"transform crop gives images, for a model that accepts image/\*; "
                                          r"model pixels \(version 2\) accepts application/json"):
        load_plan(write(tmp_path, text))


def test_a_pipeline_step_names_no_such_model_among_models_with_versions(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no model named 'pixel'; models: boxes, pixels, pixels@1, pixels@2"):
        load_plan(write(tmp_path, VERSIONED_PIXELS.replace("{model: pixels}", "{model: pixel}")))


# -- the editor's verbs ------------------------------------------------------------------------------


def versioned(name: str, *versions: str, extra: str = "") -> str:
    """A scripted model with versions (always resident, 10 MB each)."""
    sections = ", ".join(f'"{v}": {{}}' for v in versions)
    return (f"  {name}:\n    plugin: scripted\n    options: {{fixed_ms: 5, weights_bytes: 10000000}}\n"
            f"    versions: {{{sections}}}\n{extra}")


async def test_a_version_is_added_given_traffic_and_removed_each_change_a_new_route(tmp_path: Path) -> None:
    text = fleet(versioned("m", "1", "2", extra='    traffic: {"1": 90, "2": 10}\n'), budget_mb=100)
    async with running(make_runtime(tmp_path, text)) as runtime:
        editor = runtime.core._editor
        first = editor.plan.routes["m"]
        assert (first.versions, first.generation) == (("1", "2"), 1)
        assert await editor.put_version("m", "3", {"plugin": "scripted"}, "put") == "added"
        added = editor.plan.routes["m"]
        assert added.versions == ("1", "2", "3") and added.weights == {"1": 90, "2": 10} and added.generation == 2
        assert (await runtime.submit("m@3", ask("x"))).output["id"] == "x"
        assert await editor.put_version("m", "3", {"plugin": "scripted"}, "put") == "unchanged"
        assert editor.plan.routes["m"].generation == 2
        route = await editor.set_traffic("m", TrafficChange(weights={"1": 80, "3": 20}, mirror="2", mirror_percent=25))
        assert route.weights == {"1": 80, "3": 20} and (route.mirror, route.mirror_percent) == ("2", 25)
        assert route.generation == 3 and editor.plan.routes["m"] is route
        assert editor.plan.fleet.routes["m"].traffic == {"1": 80, "3": 20}
        route = await editor.set_traffic("m", TrafficChange(mirror=""))
        assert route.mirror is None and route.generation == 4
        removed = await editor.delete_version("m", "2")
        assert removed.versions == ("1", "3") and removed.generation == 5
        assert "m@2" not in runtime.model_names() and "m@2" not in editor.plan.models


async def test_a_version_that_still_gets_requests_is_not_deleted(tmp_path: Path) -> None:
    extra = '    traffic: {"1": 90, "2": 10}\n    mirror: {version: "3"}\n'
    text = fleet(versioned("m", "1", "2", "3", "5", extra=extra), budget_mb=100)
    async with running(make_runtime(tmp_path, text)) as runtime:
        editor = runtime.core._editor
        for version, why in [("1", "model 'm': version '1' is the stable version: make another one stable first"),
                             ("2", "version '2' takes 10 of the traffic: move it to another version first"),
                             ("3", "version '3' is the mirror: stop mirroring it")]:
            with pytest.raises(Conflict, match=why) as error:
                await editor.delete_version("m", version)
            assert error.value.status_code == 409
        with pytest.raises(ModelNotFound, match="model 'm' has no version '9'; versions: 1, 2, 3, 5"):
            await editor.delete_version("m", "9")
        assert editor.plan.routes["m"].generation == 1  # nothing changed
        await editor.delete_version("m", "5")
        assert editor.plan.routes["m"].versions == ("1", "2", "3")


def test_the_rollouts_candidate_is_not_removed() -> None:
    route = RouteConfig.model_validate({"versions": ["1", "2"], "rollout": {"candidate": "2"}})
    assert removal_problem(route, "2") == ("version '2' is the candidate of the rollout in the fleet file: change "
                                           "its rollout: and reload first")
    assert removal_problem(route.model_copy(update={"rollout": None}), "2") is None


@pytest.mark.parametrize(("change", "message"), [
    (TrafficChange(weights={"1": 50, "7": 50}), "set: models.m.traffic.7: no version '7'; versions: 1, 2"),
    (TrafficChange(weights={"1": -1, "2": 5}), "set: models.m.traffic.1: weight -1.0 is not accepted; accepted: a share of 0 or more"),
    (TrafficChange(weights={"1": 0}), "set: models.m.traffic: every weight is 0"),
    (TrafficChange(stable="3"), "set: models.m.stable: no version '3'; versions: 1, 2"),
    (TrafficChange(mirror="8"), "set: models.m.mirror.version: no version '8'"),
    (TrafficChange(mirror_percent=120, mirror="2"), "set: models.m.mirror.percent: Input should be less than or equal to 100 (got 120"),
    (TrafficChange(mirror_percent=20), "set: models.m.mirror.percent: 20 given without a mirror; name the version to mirror too"),
])
async def test_a_bad_split_is_refused_whole_naming_the_bad_value(tmp_path: Path, change: TrafficChange,
                                                                 message: str) -> None:
    async with running(make_runtime(tmp_path, fleet(versioned("m", "1", "2"), budget_mb=100))) as runtime:
        editor = runtime.core._editor
        with pytest.raises(ConfigError) as error:
            await editor.set_traffic("m", change, source="set")
        assert message in str(error.value)
        assert editor.plan.routes["m"].generation == 1 and editor.plan.routes["m"].weights == {"1": 100}


async def test_making_the_rollouts_candidate_stable_ends_the_rollout(tmp_path: Path) -> None:
    text = fleet(versioned("m", "1", "2", extra='    rollout: {candidate: "2"}\n'), budget_mb=100)
    async with running(make_runtime(tmp_path, text)) as runtime:
        route = await runtime.core._editor.set_traffic("m", TrafficChange(weights={"2": 100}, stable="2"))
        assert route.stable == "2" and runtime.core._editor.plan.fleet.routes["m"].rollout is None


async def test_versions_are_only_for_models_with_versions(tmp_path: Path) -> None:
    text = fleet(scripted("plain", residency="always"), versioned("m", "1"), budget_mb=100)
    async with running(make_runtime(tmp_path, text)) as runtime:
        editor = runtime.core._editor
        with pytest.raises(Conflict, match="model 'plain' has no versions: give it versions: in the fleet file and reload"):
            await editor.put_version("plain", "2", {"plugin": "scripted"}, "put")
        with pytest.raises(Conflict, match="model 'plain' has no versions"):
            await editor.set_traffic("plain", TrafficChange(weights={"1": 100}))
        with pytest.raises(ModelNotFound, match="no model with versions named 'nope'; models with versions: m"):
            await editor.delete_version("nope", "1")
        with pytest.raises(ConfigError, match="put: models.m.versions.2.queue.max_size: Input should be greater"):
            await editor.put_version("m", "2", {"plugin": "scripted", "queue": {"max_size": 0}}, "put")
        with pytest.raises(ConfigError, match="version name 'a b' is not valid"):
            await editor.put_version("m", "a b", {"plugin": "scripted"}, "put")
        assert editor.plan.routes["m"].versions == ("1",)


async def test_a_model_with_versions_is_put_whole_and_one_version_by_its_own_name(tmp_path: Path) -> None:
    async with running(make_runtime(tmp_path, fleet(versioned("m", "1", "2"), budget_mb=100))) as runtime:
        section: dict[str, Any] = {"plugin": "scripted", "versions": {"2": {}, "3": {}}, "traffic": {"2": 1, "3": 1}}
        assert await runtime.core._editor.put("m", section, "put") == "changed"
        route = runtime.core._editor.plan.routes["m"]
        assert route.versions == ("2", "3") and route.stable == "2" and route.generation == 2
        assert "m@1" not in runtime.model_names()
        outcome, _ = await runtime.put_model("m@4", {"plugin": "scripted"})
        assert outcome == "added" and runtime.core._editor.plan.routes["m"].versions == ("2", "3", "4")
        await runtime.delete_model("m@4")
        await runtime.delete_model("m")
        assert "m" not in runtime.core._editor.plan.routes and not [n for n in runtime.model_names() if n.startswith("m@")]


async def test_a_pipeline_keeps_its_model_with_versions(tmp_path: Path) -> None:
    path = write(tmp_path, VERSIONED_PIXELS)
    async with running(in_process(load_plan(path))) as runtime:
        editor = runtime.core._editor
        with pytest.raises(Conflict, match="model 'pixels' is used by pipeline\\(s\\) dc"):
            await runtime.delete_model("pixels")
        with pytest.raises(Conflict, match="could not use this section"):
            await editor.put_version("pixels", "3", {"plugin": "scripted"}, "put")
        await editor.set_traffic("pixels", TrafficChange(weights={"1": 100}))
        await editor.delete_version("pixels", "2")  # a version no request goes to may go
        assert editor.plan.routes["pixels"].versions == ("1",)


async def test_a_reload_applies_the_difference_of_versions_and_swaps_the_route(tmp_path: Path) -> None:
    first = fleet(versioned("m", "1", "2", extra='    traffic: {"1": 90, "2": 10}\n'),
                  scripted("plain", residency="always"), budget_mb=200)
    async with running(make_runtime(tmp_path, first)) as runtime:
        editor = runtime.core._editor
        second = fleet(versioned("m", "1", "3", extra='    traffic: {"1": 50, "3": 50}\n'),
                       versioned("plain", "a"), budget_mb=200)
        write(tmp_path, second)
        report = await runtime.reload()
        assert report.errors == {}
        assert report.routes == {"m": "changed", "plain": "added"}
        assert sorted(report.added) == ["m@3", "plain@a"] and sorted(report.removed) == ["m@2", "plain"]
        assert report.unchanged == ["m@1"]
        assert editor.plan.routes["m"].weights == {"1": 50, "3": 50} and editor.plan.routes["m"].generation == 2
        assert sorted(runtime.model_names()) == ["m@1", "m@3", "plain@a"]
        assert (await runtime.submit("plain@a", ask("x"))).output["id"] == "x"
        write(tmp_path, fleet(scripted("m", residency="always"), budget_mb=200))
        report = await runtime.reload()
        assert report.routes == {"plain": "removed", "m": "removed"} and report.added == ["m"]
        assert editor.plan.routes == {} and sorted(runtime.model_names()) == ["m"]


def test_the_demo_fleet_with_versions_is_the_default_fleet_with_two_resnet18s() -> None:
    from tests.conftest import REPO

    default, versions = load_fleet(REPO / "config" / "fleet.yaml"), load_fleet(REPO / "config" / "fleet.versions.yaml")
    assert set(versions.models) == {"yolov8n", "resnet18@1", "resnet18@2"}
    assert versions.models["resnet18@1"] == default.models["resnet18"]
    assert versions.models["resnet18@2"].options["weights"] == "resnet18-b.pt"
    assert versions.routes["resnet18"].traffic == {"1": 90, "2": 10}
    assert versions.pipelines == default.pipelines


def test_pipeline_fleet_helper_is_unchanged(tmp_path: Path) -> None:
    assert load_fleet(write(tmp_path, pipeline_fleet(tmp_path / "r.jsonl"))).routes == {}
