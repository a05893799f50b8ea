"""Loading (router/serving/loading.py): warm-up batches are capped by the memory budget like any
batch, each size is timed several times, and a model whose one input cannot fit fails before any
warm-up batch runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.serving.loading import TIMING_RUNS, warmup_sizes
from router.serving.plan import load_plan
from router.serving.runtime import in_process

# weights 1000 B, 100 B per input: a 1500 B budget leaves 500 B, and with the 20% margin
# 4 inputs fit (4 x 100 x 1.2 = 480) while 5 do not (600).
FLEET = """
models:
  m:
    plugin: scripted
    options: {{weights_bytes: 1000, per_item_bytes: 100, record: {record}}}
    batch: {{max_size: 8}}
    memory: {{budget: {budget}}}
    warmup: {warmup}
"""


def warm_up_batches(record: Path) -> list[int]:
    """Sizes of the batches the plugin ran, all of them warm-up batches here."""
    if not record.exists():
        return []
    rows = [json.loads(line) for line in record.read_text(encoding="utf-8").splitlines()]
    assert all(set(row["ids"]) == {"warmup"} for row in rows)
    return [len(row["ids"]) for row in rows]


async def load(tmp_path: Path, budget: int, warmup: str = "{enabled: true}") -> dict[str, object]:
    record = tmp_path / "batches.jsonl"
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET.format(record=record, budget=budget, warmup=warmup), encoding="utf-8")
    runtime = in_process(load_plan(path))
    await runtime.start()
    try:
        await runtime.core.wait_loaded()
        return runtime.model("m").as_dict()
    finally:
        await runtime.stop()


@pytest.mark.parametrize(("configured", "cap", "sizes"), [
    (None, 8, [1, 8]),
    (None, 4, [1, 4]),
    ([1, 2, 8, 16], 4, [1, 2, 4]),
    ([3], 1, [1]),
])
def test_warm_up_sizes_never_exceed_the_cap(configured: list[int] | None, cap: int, sizes: list[int]) -> None:
    assert warmup_sizes(configured, 8, cap) == sizes


async def test_warm_up_batches_are_capped_by_the_model_budget(tmp_path: Path) -> None:
    described = await load(tmp_path, budget=1500)

    assert described["state"] == "ready"
    assert described["batch"] == {"max_size": 8, "max_delay_ms": 5.0, "effective_max_size": 4}
    sizes = warm_up_batches(tmp_path / "batches.jsonl")
    assert sizes and max(sizes) == 4, sizes  # warm-up at [1, 4], then the timed batches at [1, 4]


async def test_each_batch_size_is_timed_several_times_after_warm_up(tmp_path: Path) -> None:
    """The deadline gate's estimate is seeded from the fastest timing of each size
    (`BatchTime.seed`), so one that met a busy host does not become its prior."""
    await load(tmp_path, budget=1500)
    assert warm_up_batches(tmp_path / "batches.jsonl") == [1, 4] + [1] * TIMING_RUNS + [4] * TIMING_RUNS


async def test_configured_warm_up_sizes_are_capped_too(tmp_path: Path) -> None:
    await load(tmp_path, budget=1500, warmup="{batch_sizes: [2, 8]}")

    assert max(warm_up_batches(tmp_path / "batches.jsonl")) == 4


async def test_a_model_that_cannot_fit_one_input_fails_before_warming_up(tmp_path: Path) -> None:
    described = await load(tmp_path, budget=1100)  # 100 B left: one input needs 120 B with the margin

    assert described["state"] == "failed"
    assert "ModelDoesNotFit" in str(described["error"]) and "over its budget of 1100" in str(described["error"])
    assert warm_up_batches(tmp_path / "batches.jsonl") == []
