"""Pipelines run by the runner over a real runtime, in process, with the test kit's image plugins:
the answer, batching across requests, one deadline, the door, queue room, hostile detectors,
failures, priorities, plugin transforms and nested pipelines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from router.errors import DeadlineExceeded, ModelError, QueueFull
from router.pipelines import MAX_STEP_ITEMS, PipelineRunner
from router.sdk import NoOptions, Payload, StepItem, Transform, Transformed, decode_image
from router.sdk.images import example_jpeg
from router.serving.plan import load_plan
from router.serving.runtime import Runtime, in_process
from router.serving.transforms import TransformRegistry
from tests.test_runtime import ask, busy, executed, one_at_a_time, running, until

THREE_BOXES = "[[0, 0, 10, 10, 0.9], [10, 0, 30, 20, 0.8], [0, 20, 40, 50, 0.7]]"


def fleet(record: Path, *, boxes: str = f"{{boxes: {THREE_BOXES}}}", pixels: str = "", crop: str = "{}",
          timeout_ms: int = 10_000, boxes_queue: str = "{}", pixels_batch: str = "{max_size: 8, max_delay_ms: 100}",
          more: str = "") -> str:
    return f"""
devices:
  cpu: {{max_concurrent_batches: 2}}  # the detector runs while a classifier batch does
models:
  boxes: {{plugin: boxes, options: {boxes}, batch: {{max_size: 4, max_delay_ms: 50}}, queue: {boxes_queue}}}
  pixels:
    plugin: pixels
    options: {{record: '{record}', {pixels}}}
    batch: {pixels_batch}
pipelines:
  dc:
    steps: [{{model: boxes}}, {{transform: crop, options: {crop}}}, {{model: pixels}}]
    timeout_ms: {timeout_ms}
{more}"""


@asynccontextmanager
async def serving(tmp_path: Path, text: str, transforms: TransformRegistry | None = None) -> AsyncIterator[
        tuple[Runtime, PipelineRunner]]:
    path = tmp_path / "fleet.yaml"
    path.write_text(text, encoding="utf-8")
    async with running(in_process(load_plan(path, transforms=transforms))) as runtime:
        yield runtime, PipelineRunner(runtime, transforms=transforms)


def jpeg(width: int, height: int, seed: int = 0) -> Payload:
    """A generated JPEG (not named as warm-up's, which the test kit leaves out of its records)."""
    return Payload(example_jpeg(width, height, seed=seed).body, "image/jpeg", "test.jpg")


def batches(record: Path) -> list[list[list[int]]]:
    """The sizes of the images in each batch the pixels model ran (warm-up left out), in order."""
    if not record.exists():
        return []
    return [json.loads(line)["sizes"] for line in record.read_text(encoding="utf-8").splitlines() if line]


async def test_each_detection_carries_its_crops_answer_cut_from_the_decoded_image(tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    async with serving(tmp_path, fleet(record)) as (_, runner):
        payload = jpeg(64, 48)
        answer = await runner.run("dc", payload)
    pixels = decode_image(payload)
    detections = answer.output["detections"]
    assert [d["crop_box"] for d in detections] == [[0, 0, 10, 10], [10, 0, 30, 20], [0, 20, 40, 48]]
    for d in detections:
        left, top, right, bottom = d["crop_box"]
        expected = pixels[top:bottom, left:right].reshape(-1, 3).mean(axis=0)
        assert d["pixels"]["width"] == right - left and d["pixels"]["height"] == bottom - top
        assert np.allclose(d["pixels"]["mean"], expected, atol=1e-3)
    assert answer.output["image"] == {"width": 64, "height": 48} and answer.output["crop"]["kept"] == 3
    steps = answer.timing()["steps"]
    assert [(s["step"], s["items"]) for s in steps] == [("0:boxes", 1), ("1:crop", 3), ("2:pixels", 3)]
    assert sorted(tuple(size) for batch in batches(record) for size in batch) == [(10, 10), (20, 20), (40, 28)]


async def test_crops_of_different_requests_share_the_next_models_batches(tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    async with serving(tmp_path, fleet(record, pixels_batch="{max_size: 8, max_delay_ms: 500}")) as (_, runner):
        first, second = await asyncio.gather(runner.run("dc", jpeg(64, 48)), runner.run("dc", jpeg(80, 60)))
    assert [d["pixels"]["height"] for d in first.output["detections"]][2] == 28
    assert [d["pixels"]["height"] for d in second.output["detections"]][2] == 30
    shared = [batch for batch in batches(record) if [40, 28] in batch and [40, 30] in batch]
    assert shared, f"no batch held crops of both requests: {batches(record)}"
    assert max(s["batch_size"] for s in first.timing()["steps"] if s["step"] == "2:pixels") > 1


async def test_a_later_step_that_cannot_finish_in_time_is_answered_504_and_never_runs(tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    text = fleet(record, pixels="fixed_ms: 1500", timeout_ms=1000)
    async with serving(tmp_path, text) as (runtime, runner):
        assert runtime.model("pixels").timing[0].batch_1_ms >= 1500  # timed at warm-up: the gate knows
        with pytest.raises(DeadlineExceeded) as error:
            await runner.run("dc", jpeg(64, 48))
        await until(lambda: runtime.in_flight == 0)
    assert error.value.status_code == 504
    assert "pipeline 'dc', step 2:pixels: model 'pixels' cannot answer before the deadline" in error.value.detail
    assert "the input was not run" in error.value.detail
    assert batches(record) == []  # an idle classifier too: no crop ran for a request already answered
    assert runtime.model("pixels").requests == {"deadline": 3}  # each refused before its queue: none runs later
    assert runner.requests["dc"]["deadline"] == 1


async def test_a_full_first_step_refuses_at_the_door_with_retry_after(tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    text = fleet(record, boxes=f"{{boxes: {THREE_BOXES}, fixed_ms: 400}}", boxes_queue="{max_size: 1}")
    async with serving(tmp_path, text) as (runtime, runner):
        first = asyncio.create_task(runner.run("dc", jpeg(64, 48)))
        await until(lambda: busy(runtime, "boxes"))
        second = asyncio.create_task(runner.run("dc", jpeg(64, 48)))
        await until(lambda: runtime.model("boxes").queue_depth == 1)
        with pytest.raises(QueueFull) as door:
            runner.screen("dc")
        with pytest.raises(QueueFull):
            await runner.run("dc", jpeg(64, 48))
        assert {len((await task).output["detections"]) for task in (first, second)} == {3}
    assert door.value.status_code == 503 and int(door.value.headers["Retry-After"]) >= 1
    assert door.value.detail.startswith("pipeline 'dc': model 'boxes' queue is full")
    assert runner.requests["dc"]["rejected_full"] == 2


async def test_forty_crops_wait_for_room_in_a_queue_of_ten(tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    text = fleet(record, boxes="{count: 40}", crop="{max_items: 40}", pixels="fixed_ms: 10",
                 pixels_batch="{max_size: 4, max_delay_ms: 1}")
    text = text.replace("    batch: {max_size: 4, max_delay_ms: 1}", "    batch: {max_size: 4, max_delay_ms: 1}\n"
                        "    queue: {max_size: 10}")
    async with serving(tmp_path, text) as (runtime, runner):
        assert runtime.model("pixels").queue_capacity == 10
        answer = await runner.run("dc", jpeg(200, 120))
        flood = await asyncio.gather(*(runtime.submit("pixels", jpeg(32, 32)) for _ in range(40)), return_exceptions=True)
    assert len(answer.output["detections"]) == 40 and all("pixels" in d for d in answer.output["detections"])
    crops = [size for batch in batches(record) for size in batch if size == [2, 2]]
    assert len(crops) == 40 and max(len(batch) for batch in batches(record)) <= 4
    # The same forty as direct requests meet the same bound: refused, not waited for.
    assert any(isinstance(result, QueueFull) for result in flood)


async def test_wait_for_room_waits_within_the_deadline_and_never_runs_after_it(tmp_path: Path) -> None:
    record = tmp_path / "scripted.jsonl"
    text = one_at_a_time(300, record).replace("batch: {max_size: 1}}", "batch: {max_size: 1}, queue: {max_size: 1}}")
    path = tmp_path / "fleet.yaml"
    path.write_text(text, encoding="utf-8")
    async with running(in_process(load_plan(path))) as runtime:
        running_one = asyncio.create_task(runtime.submit("m", ask("a")))
        await until(lambda: busy(runtime))
        queued = asyncio.create_task(runtime.submit("m", ask("b")))
        await until(lambda: runtime.model("m").queue_depth == 1)
        with pytest.raises(QueueFull):
            await runtime.submit("m", ask("refused"))
        late = asyncio.create_task(runtime.submit("m", ask("late"), timeout_ms=100, wait_for_room=True))
        waited = asyncio.create_task(runtime.submit("m", ask("waited"), wait_for_room=True))
        with pytest.raises(DeadlineExceeded, match="waiting for room in the queue of model 'm'; the input was not run"):
            await late
        assert [(await t).output["id"] for t in (running_one, queued, waited)] == ["a", "b", "waited"]
    assert [ids for ids in executed(record)] == [["a"], ["b"], ["waited"]]


async def test_a_detector_gone_wild_is_cut_by_max_items(tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    async with serving(tmp_path, fleet(record, boxes="{count: 5000}", crop="{max_items: 5}")) as (_, runner):
        answer = await runner.run("dc", jpeg(200, 200))
    assert len(answer.output["detections"]) == 5
    assert answer.output["crop"] == {"kept": 5, "below_min_score": 0, "below_min_size": 0, "over_max_items": 4995}
    assert sum(len(batch) for batch in batches(record)) == 5


async def test_a_failing_step_fails_the_request_naming_it_and_cancels_its_other_items(tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    text = fleet(record, pixels="fixed_ms: 1500, fail_width: 20", pixels_batch="{max_size: 1, max_delay_ms: 0}")
    async with serving(tmp_path, text) as (runtime, runner):
        blocker = asyncio.create_task(runtime.submit("pixels", jpeg(64, 64)))
        await until(lambda: busy(runtime, "pixels"))
        with pytest.raises(ModelError) as error:
            await runner.run("dc", jpeg(64, 48))  # crops 10, 20 (fails in preprocess) and 40 wide
        assert runtime.model("pixels").queue_depth == 0  # the others, queued behind the blocker, are withdrawn
        await blocker
        await until(lambda: runtime.in_flight == 0)
    assert error.value.status_code == 500
    assert error.value.detail.startswith("pipeline 'dc', step 2:pixels: model 'pixels': plugin 'pixels' failed in "
                                         "preprocess: RuntimeError: scripted failure")
    assert batches(record) == [[[64, 64]]]  # none of the answered request's other crops ran


async def test_the_priority_carries_to_every_step(tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    text = fleet(record, boxes="{boxes: [[0, 0, 10, 10, 0.9]]}", pixels="fixed_ms: 700",
                 pixels_batch="{max_size: 1, max_delay_ms: 0}")
    async with serving(tmp_path, text) as (runtime, runner):
        blocker = asyncio.create_task(runtime.submit("pixels", jpeg(64, 64)))
        await until(lambda: busy(runtime, "pixels"))
        low = [asyncio.create_task(runtime.submit("pixels", jpeg(64, 64), priority=1)) for _ in range(3)]
        await until(lambda: runtime.model("pixels").queue_depth == 3)
        answer = await runner.run("dc", jpeg(64, 48), priority=3)
        await asyncio.gather(blocker, *low)
    assert answer.output["detections"][0]["pixels"]["width"] == 10
    assert batches(record) == [[[64, 64]], [[10, 10]], [[64, 64]], [[64, 64]], [[64, 64]]]


async def test_a_plugins_transform_and_a_pipeline_run_as_a_step(tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    more = """  split:
    steps: [{model: boxes}, {transform: halves}, {model: pixels}]
  outer:
    steps: [{pipeline: dc}, {transform: whole}, {model: pixels}]
"""
    async with serving(tmp_path, fleet(record, more=more)) as (_, runner):
        split = await runner.run("split", jpeg(64, 48))
        outer = await runner.run("outer", jpeg(64, 48))
    assert [(h["side"], h["pixels"]["width"]) for h in split.output["halves"]] == [("left", 32), ("right", 32)]
    assert outer.output["pixels"] == {"width": 64, "height": 48, "mean": outer.output["pixels"]["mean"]}
    assert [d["pixels"]["width"] for d in outer.output["detections"]] == [10, 20, 40]  # dc's own answer inside
    assert [s["step"] for s in outer.timing()["steps"]] == ["0:dc", "1:whole", "2:pixels", "0:dc/0:boxes",
                                                            "0:dc/1:crop", "0:dc/2:pixels"]


class Flood(Transform[NoOptions]):
    """A transform that never stops making items."""

    needs: ClassVar[str | None] = None

    def apply(self, payload: Payload, answer: Any) -> Transformed:
        def endless() -> Any:
            while True:
                yield StepItem(Payload(b"", "image/x-pixels", pixels=np.zeros((2, 2, 3), np.uint8)), {})
        return Transformed({}, endless())


async def test_a_transform_that_never_stops_is_cut_at_max_step_items(tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    transforms = TransformRegistry.from_entry_points()
    transforms.register("flood", Flood)
    text = fleet(record, pixels="fixed_ms: 200").replace("{transform: crop, options: {}}", "{transform: flood}")
    async with serving(tmp_path, text, transforms) as (runtime, runner):
        with pytest.raises(ModelError, match=f"step 1:flood: the transform made more than {MAX_STEP_ITEMS} items"):
            await runner.run("dc", jpeg(64, 48))
        await until(lambda: runtime.in_flight == 0)
