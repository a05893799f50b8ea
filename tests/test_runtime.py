"""The runtime without HTTP: out-of-memory splitting, execution timeouts, faults, priorities, probes, drain."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from router.cli import build_plan
from router.errors import (
    BatchSizeMismatch,
    DeadlineExceeded,
    DeviceOutOfMemory,
    ExecutionTimeout,
    ModelError,
    ShuttingDown,
)
from router.scheduling.probes import MemoryReading, ProbeError, ScriptedProbe, make_probe
from router.sdk.plugin import MemoryEstimate, ModelPlugin, Payload
from router.serving.instance import InstanceState
from router.serving.registry import PluginRegistry
from router.serving.runtime import Answer, Runtime


def ask(ident: str) -> Payload:
    return Payload(json.dumps({"id": ident}).encode(), "application/json")


def make_runtime(tmp_path: Path, fleet: str, registry: PluginRegistry | None = None, **kwargs: Any) -> Runtime:
    path = tmp_path / "fleet.yaml"
    path.write_text(fleet, encoding="utf-8")
    return Runtime(build_plan(path, registry), **kwargs)


@asynccontextmanager
async def running(runtime: Runtime) -> AsyncIterator[Runtime]:
    await runtime.start()
    await runtime.wait_loaded()
    try:
        yield runtime
    finally:
        await runtime.drain(1.0)
        await runtime.stop()


def one_at_a_time(fixed_ms: int) -> str:
    """A fleet of one scripted model `m` whose batches take `fixed_ms` and hold one input."""
    return f"models:\n  m: {{plugin: scripted, options: {{fixed_ms: {fixed_ms}}}, batch: {{max_size: 1}}}}\n"


def executed(runtime: Runtime, model: str) -> list[list[str]]:
    batches: list[list[str]] = []
    for instance in runtime.deployments[model].instances:
        batches += [b for b in instance.plugin.executed if "warmup" not in b]  # type: ignore[attr-defined]
    return batches


async def test_out_of_memory_splits_the_batch_and_loses_nothing(tmp_path: Path) -> None:
    fleet = """
models:
  m:
    plugin: scripted
    options: {oom_above: 2}
    batch: {max_size: 8, max_delay_ms: 100}
    warmup: {batch_sizes: [1]}
"""
    async with running(make_runtime(tmp_path, fleet)) as runtime:
        answers = await asyncio.gather(*(runtime.submit("m", ask(f"r{i}")) for i in range(8)))
        batches = executed(runtime, "m")
    assert [a.output["id"] for a in answers] == [f"r{i}" for i in range(8)]
    assert all(len(batch) <= 2 for batch in batches)
    assert sorted(i for batch in batches for i in batch) == sorted(f"r{i}" for i in range(8))


async def test_a_single_input_that_still_runs_out_of_memory_gets_503(tmp_path: Path) -> None:
    fleet = """
models:
  m:
    plugin: scripted
    options: {oom_marker: "oom"}
    batch: {max_size: 4, max_delay_ms: 100}
"""
    async with running(make_runtime(tmp_path, fleet)) as runtime:
        results = await asyncio.gather(
            *(runtime.submit("m", ask(i)) for i in ("a", "oom-1", "b", "c")), return_exceptions=True
        )
        after = await runtime.submit("m", ask("d"))
    assert isinstance(results[1], DeviceOutOfMemory) and results[1].status_code == 503
    assert [r.output["id"] for r in results if isinstance(r, Answer)] == ["a", "b", "c"]
    assert after.output["id"] == "d"


class TorchOomPlugin(ModelPlugin):  # type: ignore[type-arg]
    """Raises torch's own CUDA out-of-memory error for batches over one item."""

    accepts = ("application/json",)

    def load(self, device: str) -> None:
        self.sizes: list[int] = []

    def preprocess(self, payload: Payload) -> str:
        return str(json.loads(payload.body)["id"])

    def predict_batch(self, items: Sequence[Any]) -> list[Any]:
        self.sizes.append(len(items))
        if len(items) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return list(items)

    def memory_estimate(self) -> MemoryEstimate:
        return MemoryEstimate(0, 0)


class MiscountingPlugin(TorchOomPlugin):
    def predict_batch(self, items: Sequence[Any]) -> list[Any]:
        return list(items)[:-1]


def custom_registry() -> PluginRegistry:
    registry = PluginRegistry.from_entry_points()
    registry.register("torch-oom", TorchOomPlugin)
    registry.register("miscount", MiscountingPlugin)
    return registry


async def test_torch_cuda_out_of_memory_error_is_recognised(tmp_path: Path) -> None:
    fleet = """
models:
  m:
    plugin: torch-oom
    batch: {max_size: 4, max_delay_ms: 100}
"""
    async with running(make_runtime(tmp_path, fleet, custom_registry())) as runtime:
        answers = await asyncio.gather(*(runtime.submit("m", ask(f"r{i}")) for i in range(4)))
        sizes = runtime.deployments["m"].instances[0].plugin.sizes  # type: ignore[attr-defined]
    assert [a.output for a in answers] == [f"r{i}" for i in range(4)]
    assert sizes[:3] == [4, 2, 1]


async def test_wrong_number_of_outputs_is_a_named_error(tmp_path: Path) -> None:
    fleet = """
models:
  m:
    plugin: miscount
    batch: {max_size: 2, max_delay_ms: 100}
    warmup: {enabled: false}
"""
    async with running(make_runtime(tmp_path, fleet, custom_registry())) as runtime:
        results = await asyncio.gather(*(runtime.submit("m", ask(i)) for i in "ab"), return_exceptions=True)
    assert all(isinstance(r, BatchSizeMismatch) and r.status_code == 500 for r in results)
    assert "returned 1 outputs for a batch of 2" in str(results[0])


async def test_execution_timeout_fences_the_instance_until_its_batch_returns(tmp_path: Path) -> None:
    fleet = """
devices:
  cpu: {probe: none, memory_budget: 1GB}
models:
  m:
    plugin: scripted
    options: {hang_on: "hang", hang_ms: 700, per_item_bytes: 5000}
    batch: {max_size: 1}
    execution: {timeout_ms: 150}
"""
    async with running(make_runtime(tmp_path, fleet)) as runtime:
        deployment = runtime.deployments["m"]
        ledger = runtime.schedulers["cpu"].ledger
        weights = ledger.weights_bytes
        started = time.monotonic()
        with pytest.raises(ExecutionTimeout) as error:
            await runtime.submit("m", ask("hang"))
        assert error.value.status_code == 504
        assert time.monotonic() - started < 0.5
        assert deployment.instances[0].state is InstanceState.STALLED
        assert ledger.reserved_bytes == 5000  # the hung batch still holds its memory
        queued = asyncio.create_task(runtime.submit("m", ask("next")))  # waits, is not lost
        answer = await asyncio.wait_for(queued, 5)
        assert answer.output["id"] == "next"
        assert deployment.instances[0].state is InstanceState.READY
        assert ledger.total_bytes == weights


async def test_higher_priority_is_batched_first(tmp_path: Path) -> None:
    fleet = one_at_a_time(200)
    async with running(make_runtime(tmp_path, fleet)) as runtime:
        first = asyncio.create_task(runtime.submit("m", ask("busy")))
        await asyncio.sleep(0.05)
        low = [asyncio.create_task(runtime.submit("m", ask(f"low{i}"), priority=1)) for i in range(2)]
        await asyncio.sleep(0.01)
        high = asyncio.create_task(runtime.submit("m", ask("high"), priority=3))
        await asyncio.gather(first, high, *low)
        order = [batch[0] for batch in executed(runtime, "m")]
    assert order == ["busy", "high", "low0", "low1"]


async def test_scheduler_loop_restarts_after_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = "models:\n  m: {plugin: scripted}\n"
    async with running(make_runtime(tmp_path, fleet)) as runtime:
        scheduler = runtime.schedulers["cpu"]
        original = scheduler.step
        crashes = iter([True])

        def flaky_step() -> float | None:
            if next(crashes, False):
                raise RuntimeError("bug in the loop")
            return original()

        monkeypatch.setattr(scheduler, "step", flaky_step)
        answer = await asyncio.wait_for(runtime.submit("m", ask("x")), 5)
    assert answer.output["id"] == "x"
    assert scheduler.restarts == 1


def probe_factory(probe: ScriptedProbe) -> Any:
    def factory(device: str, kind: str) -> Any:
        return probe if device == "cpu" else make_probe(device, kind)

    return factory


async def test_failing_or_nonsense_probe_pauses_admission_until_it_recovers(tmp_path: Path) -> None:
    good = MemoryReading(1_000_000_000, 10_000_000_000)
    bad: list[Any] = [ProbeError("NVML hiccup"), MemoryReading(5, 1), RuntimeError("driver gone")] * 4
    readings: list[Any] = [good, *bad, good]
    probe = ScriptedProbe("cpu", readings)
    fleet = "models:\n  m: {plugin: scripted, warmup: {enabled: false}}\n"
    runtime = make_runtime(tmp_path, fleet, probe_factory=probe_factory(probe))
    async with running(runtime):
        answer = await asyncio.wait_for(runtime.submit("m", ask("x")), 5)
        scheduler = runtime.schedulers["cpu"]
    assert answer.output["id"] == "x"
    assert scheduler.probe_errors == len(bad)
    assert probe.reads >= len(readings)


async def test_admission_pauses_above_the_high_watermark_and_resumes_below_the_low(tmp_path: Path) -> None:
    total = 10_000
    state = {"used": 9_500}  # budget is 0.9 * total = 9000: far above the high watermark
    probe = ScriptedProbe("cpu", lambda: MemoryReading(state["used"], total))
    fleet = "models:\n  m: {plugin: scripted, options: {weights_bytes: 0, per_item_bytes: 1}, warmup: {enabled: false}}\n"
    runtime = make_runtime(tmp_path, fleet, probe_factory=probe_factory(probe))
    async with running(runtime):
        scheduler = runtime.schedulers["cpu"]
        waiting = asyncio.create_task(runtime.submit("m", ask("x")))
        await asyncio.sleep(0.1)
        assert not waiting.done() and scheduler.paused
        state["used"] = 7_700  # 85% of budget: between the watermarks, still paused
        await asyncio.sleep(0.1)
        assert not waiting.done() and scheduler.paused
        state["used"] = 7_000  # 78%: below the low watermark
        answer = await asyncio.wait_for(waiting, 2)
    assert answer.output["id"] == "x" and not scheduler.paused


async def test_a_device_whose_probe_fails_at_start_fails_its_models_only(tmp_path: Path) -> None:
    probe = ScriptedProbe("cpu", [ProbeError("always failing")])
    fleet = "models:\n  m: {plugin: scripted, warmup: {enabled: false}}\n"
    runtime = make_runtime(tmp_path, fleet, probe_factory=probe_factory(probe))
    await runtime.start()
    await runtime.wait_loaded()
    assert "cpu" in runtime.device_errors  # the first reading failed: the device cannot be budgeted
    assert runtime.deployments["m"].state.value == "failed"
    await runtime.stop()


async def test_drain_answers_everything_even_past_its_timeout(tmp_path: Path) -> None:
    fleet = one_at_a_time(300)
    runtime = make_runtime(tmp_path, fleet)
    await runtime.start()
    await runtime.wait_loaded()
    tasks = [asyncio.create_task(runtime.submit("m", ask(f"r{i}"))) for i in range(4)]
    await asyncio.sleep(0.05)
    await runtime.drain(0.4)  # time for about one batch; the rest is answered 503
    results = await asyncio.gather(*tasks, return_exceptions=True)
    with pytest.raises(ShuttingDown):
        await runtime.submit("m", ask("late"))
    await runtime.stop()
    assert isinstance(results[0], Answer)
    assert all(isinstance(r, (Answer, ShuttingDown)) for r in results)
    assert any(isinstance(r, ShuttingDown) for r in results)


async def test_deadline_while_queued_is_504_and_not_run(tmp_path: Path) -> None:
    fleet = one_at_a_time(300)
    async with running(make_runtime(tmp_path, fleet)) as runtime:
        busy = asyncio.create_task(runtime.submit("m", ask("busy")))
        await asyncio.sleep(0.05)
        with pytest.raises(DeadlineExceeded):
            await runtime.submit("m", ask("late"), timeout_ms=50)
        await busy
        await asyncio.sleep(0.35)
        assert executed(runtime, "m") == [["busy"]]


async def test_model_error_answers_500_and_keeps_the_model_serving(tmp_path: Path) -> None:
    fleet = """
models:
  m:
    plugin: scripted
    options: {fail: marked}
    batch: {max_size: 1}
"""
    async with running(make_runtime(tmp_path, fleet)) as runtime:
        with pytest.raises(ModelError) as error:
            await runtime.submit("m", ask("fail-1"))
        answer = await runtime.submit("m", ask("ok"))
    assert error.value.status_code == 500 and "scripted failure" in error.value.detail
    assert answer.output["id"] == "ok"


async def test_models_sharing_a_device_get_time_in_proportion_to_their_weight(tmp_path: Path) -> None:
    record = tmp_path / "batches.jsonl"
    model = """
  {name}:
    plugin: scripted
    options: {{fixed_ms: 10, weights_bytes: 1000000, per_item_bytes: 60000000, record: "{record}"}}
    queue: {{max_size: 64, timeout_ms: 60000}}
    batch: {{max_size: 1}}
    weight: {weight}
    warmup: {{enabled: false}}
"""
    # One batch of 60 MB fits the 100 MB budget at a time, so the two models take turns.
    fleet = ("devices:\n  cpu: {probe: none, memory_budget: 100MB}\nmodels:"
             + model.format(name="heavy", weight=3, record=record) + model.format(name="light", weight=1, record=record))
    async with running(make_runtime(tmp_path, fleet)) as runtime:
        await asyncio.gather(*(runtime.submit(m, ask(f"{m}{i}")) for i in range(40) for m in ("heavy", "light")))
    rows = sorted((json.loads(line) for line in record.read_text().splitlines()), key=lambda r: r["start"])
    first = [r["model"] for r in rows[:24]]  # both queues are still full here
    assert 15 <= first.count("heavy") <= 21, first
    assert all(a["end"] <= b["start"] for a, b in zip(rows, rows[1:])), "batches over budget overlapped"


async def test_requests_queued_behind_a_hung_batch_get_504_at_their_deadline(tmp_path: Path) -> None:
    fleet = """
models:
  m:
    plugin: scripted
    options: {hang_on: "hang", hang_ms: 3000}
    batch: {max_size: 1}
    execution: {timeout_ms: 100}
"""
    async with running(make_runtime(tmp_path, fleet)) as runtime:
        hung = asyncio.create_task(runtime.submit("m", ask("hang")))
        await asyncio.sleep(0.02)
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await runtime.submit("m", ask("behind"), timeout_ms=300)
        waited = time.monotonic() - started
        with pytest.raises(ExecutionTimeout):
            await hung
        assert 0.25 < waited < 0.6
        assert runtime.deployments["m"].state.value == "degraded"  # fenced, visible in /models
        assert "behind" not in [i for b in executed(runtime, "m") for i in b]


async def test_readiness_follows_the_required_flag(tmp_path: Path) -> None:
    fleet = """
models:
  good: {plugin: scripted}
  bad: {plugin: scripted, options: {load_error: "no weights"}, required: %s}
"""
    for required, ready in (("false", True), ("true", False)):
        async with running(make_runtime(tmp_path, fleet % required)) as runtime:
            assert runtime.ready is ready
            assert runtime.deployments["bad"].state.value == "failed"
            assert (await runtime.submit("good", ask("x"))).output["id"] == "x"


@pytest.mark.parametrize("setting, overlap", [("", False), ("max_concurrent_batches: 2", True)])
async def test_the_device_decides_how_many_batches_run_at_once(tmp_path: Path, setting: str, overlap: bool) -> None:
    record = tmp_path / "batches.jsonl"
    model = """
  {name}:
    plugin: scripted
    options: {{fixed_ms: 30, record: "{record}"}}
    batch: {{max_size: 1}}
    warmup: {{enabled: false}}
"""
    fleet = f"devices:\n  cpu: {{{setting}}}\nmodels:" + "".join(model.format(name=n, record=record) for n in "abc")
    async with running(make_runtime(tmp_path, fleet)) as runtime:
        await asyncio.gather(*(runtime.submit(m, ask(f"{m}{i}")) for i in range(4) for m in "abc"))
    rows = sorted((json.loads(line) for line in record.read_text().splitlines()), key=lambda r: r["start"])
    overlapped = any(b["start"] < a["end"] for a, b in zip(rows, rows[1:]))
    assert len(rows) == 12 and overlapped is overlap
