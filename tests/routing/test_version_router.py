"""The version router on one process's runtime: fallback, shadow copies, agreement and rollouts."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from router.errors import ModelError, ModelNotFound, QueueFull
from router.pipelines import PipelineRunner
from router.routing import VersionRouter
from router.routing.versions import PRESSURE_S
from router.sdk.plugin import Payload
from router.serving.plan import load_plan
from router.serving.runtime import Runtime, in_process
from router.serving.traffic import TrafficChange

#: Every answer within this bound: only a hang reaches it.
HANG_S = 60.0


def ask(ident: str) -> Payload:
    return Payload(json.dumps({"id": ident}).encode(), "application/json")


def fleet(one: str, two: str, extra: str = "") -> str:
    """A scripted model `m` with versions 1 and 2 (their options), batches of one."""
    return (f"models:\n  m:\n    plugin: scripted\n    batch: {{max_size: 1}}\n"
            f"    queue: {{max_size: 64, timeout_ms: 5000}}\n"
            f"    versions:\n      '1': {{options: {one}}}\n      '2': {{options: {two}}}\n{extra}")


@asynccontextmanager
async def serving(tmp_path: Path, text: str) -> AsyncIterator[tuple[Runtime, VersionRouter]]:
    path = tmp_path / "fleet.yaml"
    path.write_text(text, encoding="utf-8")
    runtime = in_process(load_plan(path))
    await runtime.start()
    await runtime.core.wait_loaded()
    versions = PipelineRunner(runtime).versions
    versions.draw = random.Random(7).random  # the same routing every run
    try:
        yield runtime, versions
    finally:
        await runtime.drain(2.0)
        await runtime.stop()


async def until(condition: Callable[[], Any], timeout_s: float = HANG_S) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.002)


def version_of(answer: Any) -> str:
    return str(answer.model.partition("@")[2])


async def test_a_failing_version_s_item_is_answered_by_the_stable_version(tmp_path: Path) -> None:
    text = fleet("{label: a}", "{label: b, fail: marked}", "    traffic: {'1': 0, '2': 100}\n")
    async with serving(tmp_path, text) as (_, versions):
        answers = [await versions.submit("m", ask(f"fail-{i}")) for i in range(10)]
        assert {version_of(a) for a in answers} == {"1"}  # every item failed on 2, answered by 1
        assert all(a.input_info.get("fallback_from") == "m" for a in answers)
        figures = versions.describe("m")["figures"]
        assert figures["fallbacks"] == 10
        assert figures["outcomes"]["2"] == {"error": 10} and figures["outcomes"]["1"] == {"ok": 10}


async def test_a_pinned_version_s_failure_is_the_caller_s(tmp_path: Path) -> None:
    text = fleet("{label: a}", "{label: b, fail: marked}", "    traffic: {'1': 0, '2': 100}\n")
    async with serving(tmp_path, text) as (_, versions):
        with pytest.raises(ModelError):
            await versions.submit("m", ask("fail-pinned"), version="2")
        with pytest.raises(ModelNotFound, match="versions: 1, 2"):
            await versions.submit("m", ask("nowhere"), version="3")
        assert versions.describe("m")["figures"]["fallbacks"] == 0


async def test_the_stable_version_s_failure_is_not_retried(tmp_path: Path) -> None:
    text = fleet("{fail: marked}", "{}", "    traffic: {'1': 100}\n")
    async with serving(tmp_path, text) as (_, versions):
        with pytest.raises(ModelError):
            await versions.submit("m", ask("fail-r"))


async def test_mirrored_copies_are_compared_and_never_a_user_s_failure(tmp_path: Path) -> None:
    text = fleet("{label: a}", "{label: a, fail: marked}", "    mirror: {version: '2', percent: 100}\n")
    async with serving(tmp_path, text) as (runtime, versions):
        for i in range(12):  # one at a time: the device is idle once each is answered
            answer = await versions.submit("m", ask(f"fail-{i}" if i % 3 == 0 else f"ok-{i}"))
            assert version_of(answer) == "1"
            await until(lambda: versions.mirrors.open == 0)
        figures = versions.describe("m")["figures"]
        assert figures["outcomes"] == {"1": {"ok": 12}}  # the users' answers: all served by 1
        assert figures["agreement"]["2 vs 1"] == {"compared": 8, "mean": 1.0}  # the copies that were answered
        assert runtime.model("m@2").requests == {}  # nobody's requests
        assert runtime.model("m@1").requests == {"ok": 12}


async def test_a_version_that_answers_otherwise_agrees_less(tmp_path: Path) -> None:
    text = fleet("{label: a}", "{label: b}", "    mirror: {version: '2', percent: 100}\n")
    async with serving(tmp_path, text) as (_, versions):
        for i in range(5):
            await versions.submit("m", ask(f"r{i}"))
            await until(lambda: versions.mirrors.open == 0)
        assert versions.describe("m")["figures"]["agreement"]["2 vs 1"] == {"compared": 5, "mean": 0.0}


async def test_a_split_routes_by_weight_and_a_sticky_key_sticks(tmp_path: Path) -> None:
    text = fleet("{label: a}", "{label: a}", "    traffic: {'1': 70, '2': 30}\n")
    async with serving(tmp_path, text) as (_, versions):
        seen = Counter([version_of(await versions.submit("m", ask(f"r{i}"))) for i in range(400)])
        assert abs(seen["2"] - 120) <= 4.5 * (400 * 0.3 * 0.7) ** 0.5
        for key in ("alice", "bob", "carol"):
            assert len({version_of(await versions.submit("m", ask(key), route_key=key)) for _ in range(5)}) == 1


def rollout(candidate_options: str, settings: str = "steps: [10, 50, 100], min_samples: 40") -> str:
    return fleet("{label: a}", candidate_options, f"    rollout: {{candidate: '2', step_min_s: 0, {settings}}}\n")


async def send(versions: VersionRouter, runtime: Runtime, done: Callable[[], bool], fail_every: int = 0,
               limit: int = 4000) -> Counter[str]:
    """Requests one at a time until `done()` (bounded), every fifth a failing one when `fail_every`; the
    versions that answered."""
    seen: Counter[str] = Counter()
    for i in range(limit):
        if done():
            break
        ident = f"fail-{i}" if fail_every and i % fail_every == 0 else f"ok-{i}"
        seen[version_of(await versions.submit("m", ask(ident)))] += 1
        await asyncio.sleep(0)  # the rollout's decisions are applied off the request path
    return seen


async def test_a_candidate_failing_a_fifth_of_its_items_is_rolled_back_and_users_see_none(tmp_path: Path) -> None:
    # The default steps and sample (5% first), whose detection bound the rule states.
    async with serving(tmp_path, rollout("{label: a, fail: marked}", "")) as (runtime, versions):
        assert runtime.routes()["m"].weights == {"1": 95.0, "2": 5.0}  # the first step
        def state() -> dict[str, Any]:
            return runtime.rollout("m") or {}

        await send(versions, runtime, lambda: state().get("status") == "rolled_back", fail_every=5)
        await until(lambda: runtime.routes()["m"].weights.get("2", 0.0) == 0.0)
        ended = state()
        assert ended["status"] == "rolled_back" and ended["step"] == 0, ended
        assert ended["decisions"] == {"rollback": 1}
        assert "error" in ended["reason"] or "fail" in ended["reason"], ended["reason"]
        # The rule's stated bound: rolled back at the first step's second look, within min_samples / 2.
        assert ended["step_answers"] <= 100
        assert runtime.routes()["m"].stable == "1"
        figures = versions.describe("m")["figures"]
        assert set(figures["outcomes"]["1"]) == {"ok"}  # users saw no failure: the candidate's went to 1
        assert figures["fallbacks"] == figures["outcomes"]["2"]["error"] > 0


async def test_an_identical_candidate_is_promoted_through_every_step(tmp_path: Path) -> None:
    # The rule's own false-alarm rate is measured by simulation (tests/versions); here a tiny one, so
    # that a busy machine's latency noise cannot roll this identical candidate back by chance.
    settings = "steps: [10, 50, 100], min_samples: 30, false_alarm_rate: 0.000001"
    async with serving(tmp_path, rollout("{label: a}", settings)) as (runtime, versions):
        weights: list[float] = []
        route = runtime.routes()["m"]

        def done() -> bool:
            nonlocal route
            if runtime.routes()["m"] is not route:
                route = runtime.routes()["m"]
                weights.append(route.weights.get("2", 0.0))
            return (runtime.rollout("m") or {}).get("status") == "promoted"

        await send(versions, runtime, done)
        assert (runtime.rollout("m") or {}).get("status") == "promoted", runtime.rollout("m")
        await until(lambda: runtime.routes()["m"].stable == "2")
        ended = runtime.rollout("m")
        assert ended is not None and ended["decisions"] == {"step": 2, "promote": 1}, ended
        assert weights[:2] == [50.0, 100.0]
        assert runtime.routes()["m"].weights.get("2") == 100.0


async def test_an_operator_s_split_stops_a_rollout(tmp_path: Path) -> None:
    async with serving(tmp_path, rollout("{label: a}")) as (runtime, _):
        route = await runtime.set_traffic("m", TrafficChange(weights={"1": 100, "2": 0}))
        assert route.weights == {"1": 100.0, "2": 0.0}
        ended = runtime.rollout("m")
        assert ended is not None and ended["reason"] == "stopped: an operator changed the split"


async def test_no_copy_is_sent_for_a_while_after_one_of_the_name_s_requests_is_refused(tmp_path: Path) -> None:
    text = ("models:\n  m:\n    plugin: scripted\n    batch: {max_size: 1}\n    versions:\n"
            "      '1': {options: {label: a, fixed_ms: 300}, queue: {max_size: 1}}\n      '2': {options: {label: a}}\n"
            "    mirror: {version: '2', percent: 100}\n")
    async with serving(tmp_path, text) as (runtime, _):
        ahead = [0.0]  # the router's clock, moved on past the pressure without waiting for it
        versions = VersionRouter(runtime, clock=lambda: runtime.clock() + ahead[0])
        first = asyncio.ensure_future(versions.submit("m", ask("r1")))
        await until(lambda: any(i.busy for i in runtime.model("m@1").instances))
        second = asyncio.ensure_future(versions.submit("m", ask("r2")))
        await until(lambda: runtime.model("m@1").queue_depth == 1)
        with pytest.raises(QueueFull):
            await versions.submit("m", ask("r3"))  # a surge: the name has no room
        await asyncio.gather(first, second)
        assert versions.mirrors.open == 0 and versions.describe("m")["figures"]["agreement"] == {}  # no copy
        ahead[0] += PRESSURE_S
        await versions.submit("m", ask("r4"))
        await until(lambda: versions.mirrors.open == 0)
        assert versions.describe("m")["figures"]["agreement"] == {"2 vs 1": {"compared": 1, "mean": 1.0}}


async def test_a_pipeline_step_naming_a_model_with_versions_is_routed(tmp_path: Path) -> None:
    text = fleet("{label: a}", "{label: b}", "    traffic: {'1': 0, '2': 100}\n") + \
        "pipelines:\n  p:\n    steps: [{model: m}]\n"
    async with serving(tmp_path, text) as (runtime, versions):
        runner = PipelineRunner(runtime, versions=versions)
        assert runner.info("p").state == "ready"
        answer = await runner.run("p", ask("through-p"))
        assert answer.output == {"id": "through-p", "batch": answer.output["batch"], "label": "b"}  # version 2's
        assert versions.describe("m")["figures"]["outcomes"] == {"2": {"ok": 1}}
