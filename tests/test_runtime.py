"""The runtime without HTTP: out-of-memory splitting, execution timeouts, faults, priorities, probes, drain."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest

from router.errors import (
    DeadlineExceeded,
    DeviceOutOfMemory,
    ExecutionTimeout,
    InputError,
    ModelError,
    QueueFull,
    ShuttingDown,
)
from router.scheduling.memory import ProbeError, make_probe
from router.sdk.plugin import MemoryEstimate, ModelPlugin, Payload
from router.serving.facade import Answer
from router.serving.plan import load_plan
from router.serving.registry import PluginRegistry
from router.serving.runtime import Runtime, in_process
from tests.conftest import read_records
from tests.probes import ScriptedProbe
from tests.virtual_clock import VirtualClockLoop, run_virtual


def ask(ident: str) -> Payload:
    return Payload(json.dumps({"id": ident}).encode(), "application/json")


def make_runtime(tmp_path: Path, fleet: str, registry: PluginRegistry | None = None, **kwargs: Any) -> Runtime:
    path = tmp_path / "fleet.yaml"
    path.write_text(fleet, encoding="utf-8")
    return in_process(load_plan(path, registry), **kwargs)


@asynccontextmanager
async def running(runtime: Runtime) -> AsyncIterator[Runtime]:
    await runtime.start()
    await runtime.core.wait_loaded()
    try:
        yield runtime
    finally:
        await runtime.drain(1.0)
        await runtime.stop()


def one_at_a_time(fixed_ms: int, record: Path) -> str:
    """A fleet of one scripted model `m` whose batches take `fixed_ms`, hold one input and are
    recorded in `record`."""
    return (f"models:\n  m: {{plugin: scripted, options: {{fixed_ms: {fixed_ms}, record: '{record}'}}, "
            "batch: {max_size: 1}}\n")


async def until(condition: Any, timeout_s: float = 5.0) -> None:
    """Wait until `condition()` holds, looking each millisecond: ordering by state, not by timing."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.001)


def busy(runtime: Runtime, model: str = "m") -> bool:
    return any(i.busy for i in runtime.model(model).instances)


def executed(record: Path) -> list[list[str]]:
    """The batches the scripted plugin ran (warm-up left out), in order."""
    return [list(row["ids"]) for row in read_records(record)]  # type: ignore[call-overload]


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


async def test_a_hung_batch_keeps_its_memory_reserved_until_its_thread_returns(tmp_path: Path) -> None:
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
        [device] = runtime.devices()
        weights = device.weights_bytes
        with pytest.raises(ExecutionTimeout) as error:
            await runtime.submit("m", ask("hang"))
        assert error.value.status_code == 504
        assert runtime.model("m").instances[0].state == "fenced"
        assert runtime.devices()[0].reserved_bytes == 5000  # the hung batch still holds its memory
        queued = asyncio.create_task(runtime.submit("m", ask("next")))  # waits, is not lost
        answer = await asyncio.wait_for(queued, 5)
        assert answer.output["id"] == "next"
        assert runtime.model("m").instances[0].state == "ready"
        assert (runtime.devices()[0].weights_bytes, runtime.devices()[0].reserved_bytes) == (weights, 0)


async def test_higher_priority_is_batched_first(tmp_path: Path) -> None:
    fleet = one_at_a_time(200, tmp_path / 'batches.jsonl')
    async with running(make_runtime(tmp_path, fleet)) as runtime:
        first = asyncio.create_task(runtime.submit("m", ask("busy")))
        await until(lambda: busy(runtime))
        low = [asyncio.create_task(runtime.submit("m", ask(f"low{i}"), priority=1)) for i in range(2)]
        await until(lambda: runtime.model("m").queue_depth == 2)
        high = asyncio.create_task(runtime.submit("m", ask("high"), priority=3))
        await asyncio.gather(first, high, *low)
        order = [batch[0] for batch in executed(tmp_path / "batches.jsonl")]
    assert order == ["busy", "high", "low0", "low1"]


def probe_factory(probe: ScriptedProbe) -> Any:
    def factory(device: str, kind: str) -> Any:
        return probe if device == "cpu" else make_probe(device, kind)

    return factory


async def test_a_device_whose_probe_fails_at_start_fails_its_models_only(tmp_path: Path) -> None:
    probe = ScriptedProbe("cpu", [ProbeError("always failing")])
    fleet = "models:\n  m: {plugin: scripted, warmup: {enabled: false}}\n"
    runtime = make_runtime(tmp_path, fleet, probe_factory=probe_factory(probe))
    await runtime.start()
    await runtime.core.wait_loaded()
    [device] = runtime.devices()
    assert not device.available and "always failing" in (device.error or "")  # the device cannot be budgeted
    assert runtime.model("m").state == "failed"
    await runtime.stop()


def test_drain_answers_everything_even_past_its_timeout(tmp_path: Path) -> None:
    """On a virtual clock: batches of 0.3 s, a drain of 0.4 s: the running batch is answered, the
    one after it is cut off, and the rest get 503."""
    fleet = one_at_a_time(300, tmp_path / 'batches.jsonl')

    async def main(loop: VirtualClockLoop) -> list[object]:
        runtime = make_runtime(tmp_path, fleet, clock=loop.time)
        await runtime.start()
        await runtime.core.wait_loaded()
        tasks = [asyncio.create_task(runtime.submit("m", ask(f"r{i}"))) for i in range(4)]
        await until(lambda: busy(runtime))
        await runtime.drain(0.4)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        with pytest.raises(ShuttingDown):
            await runtime.submit("m", ask("late"))
        await runtime.stop()
        return results

    results = run_virtual(main)
    assert isinstance(results[0], Answer)
    assert all(isinstance(r, (Answer, ShuttingDown)) for r in results)
    assert any(isinstance(r, ShuttingDown) for r in results)


async def test_deadline_while_queued_is_504_and_not_run(tmp_path: Path) -> None:
    fleet = one_at_a_time(300, tmp_path / 'batches.jsonl')
    async with running(make_runtime(tmp_path, fleet)) as runtime:
        running_first = asyncio.create_task(runtime.submit("m", ask("busy")))
        await until(lambda: busy(runtime))
        with pytest.raises(DeadlineExceeded):
            await runtime.submit("m", ask("late"), timeout_ms=50)
        await running_first
        await runtime.submit("m", ask("after"))  # first in first out: "late" would have run before it
        assert executed(tmp_path / "batches.jsonl") == [["busy"], ["after"]]


async def test_a_batch_still_running_at_the_deadline_is_504_then_not_a_late_answer(tmp_path: Path) -> None:
    """Its batch takes 2 s more than warm-up timed: admitted for a 1 s deadline, it is still running
    then. The request gets 504 at its deadline; the batch goes on to its end."""
    record = tmp_path / "batches.jsonl"
    fleet = ("models:\n  m: {plugin: scripted, options: {hang_on: slow, hang_ms: 2000, "
             f"record: '{record}'}}, batch: {{max_size: 1}}}}\n")
    async with running(make_runtime(tmp_path, fleet)) as runtime:
        with pytest.raises(DeadlineExceeded) as late:
            await runtime.submit("m", ask("slow"), timeout_ms=1000)
        assert "while the batch of model 'm' holding this input ran" in late.value.detail
        await until(lambda: executed(record) == [["slow"]])  # it ran to its end, unanswered
        # and its instance is free again (the plugin records before the loop sees the batch end:
        # a request in that gap is doomed at dispatch by the 2 s batch just timed)
        await until(lambda: not any(i.busy for i in runtime.core.deployments["m"].instances))
        # the answer that came late ended its use of the instance: nothing holds it loaded
        await asyncio.wait_for(runtime.core.deployments["m"].instances[0].until_unused(), 5)
        assert (await runtime.submit("m", ask("after"), timeout_ms=1000)).output["id"] == "after"


async def test_a_caller_gone_while_its_batch_runs_leaves_no_use_of_the_instance(tmp_path: Path) -> None:
    """Cancelled while its batch runs: the batch goes on, and its answer, which nobody reads,
    ends its use of the instance (an unload would wait for it for ever otherwise)."""
    record = tmp_path / "batches.jsonl"
    fleet = ("models:\n  m: {plugin: scripted, options: {hang_on: slow, hang_ms: 300, "
             f"record: '{record}'}}, batch: {{max_size: 1}}}}\n")
    async with running(make_runtime(tmp_path, fleet)) as runtime:
        caller = asyncio.create_task(runtime.submit("m", ask("slow"), timeout_ms=5000))
        await until(lambda: busy(runtime))
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await until(lambda: executed(record) == [["slow"]])
        instance = runtime.core.deployments["m"].instances[0]
        await asyncio.wait_for(instance.until_unused(), 5)
        assert (await runtime.submit("m", ask("after"))).output["id"] == "after"


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
    assert all(a["end"] <= b["start"] for a, b in itertools.pairwise(rows)), "batches over budget overlapped"


def test_requests_queued_behind_a_hung_batch_get_504_at_their_deadline(tmp_path: Path) -> None:
    """On a virtual clock: the 504 comes at the deadline exactly, not after the hung batch."""
    fleet = """
models:
  m:
    plugin: scripted
    options: {hang_on: "hang", hang_ms: 3000, record: "%s"}
    batch: {max_size: 1}
    execution: {timeout_ms: 100}
""" % (tmp_path / "batches.jsonl")

    async def main(loop: VirtualClockLoop) -> tuple[float, str]:
        async with running(make_runtime(tmp_path, fleet, clock=loop.time)) as runtime:
            hung = asyncio.create_task(runtime.submit("m", ask("hang")))
            await until(lambda: busy(runtime))
            started = loop.time()
            with pytest.raises(DeadlineExceeded):
                await runtime.submit("m", ask("behind"), timeout_ms=300)
            waited = loop.time() - started
            with pytest.raises(ExecutionTimeout):
                await hung
            return waited, runtime.model("m").state

    waited, state = run_virtual(main)
    assert waited == pytest.approx(0.3)
    assert state == "degraded"  # fenced, visible in /models
    assert "behind" not in [i for b in executed(tmp_path / "batches.jsonl") for i in b]


async def test_readiness_follows_the_required_flag(tmp_path: Path) -> None:
    fleet = """
models:
  good: {plugin: scripted}
  bad: {plugin: scripted, options: {load_error: "no weights"}, required: %s}
"""
    for required, ready in (("false", True), ("true", False)):
        async with running(make_runtime(tmp_path, fleet % required)) as runtime:
            assert runtime.ready is ready
            assert runtime.model("bad").state == "failed"
            assert (await runtime.submit("good", ask("x"))).output["id"] == "x"


class Buggy(ModelPlugin):  # type: ignore[type-arg]
    """preprocess raises a bug for 'explode'; postprocess answers NaN for 'nan' and a set for 'set'."""

    accepts = ("application/json",)

    def load(self, device: str) -> None:
        pass

    def preprocess(self, payload: Payload) -> str:
        ident = str(json.loads(payload.body)["id"])
        if ident == "explode":
            raise KeyError("missing field")
        return ident

    def predict_batch(self, items: Sequence[Any]) -> list[Any]:
        return list(items)

    def postprocess(self, output: Any, item: Any) -> Any:
        return {"nan": {"score": float("nan")}, "set": {"ids": {1, 2}}}.get(output, {"id": output})

    def memory_estimate(self) -> MemoryEstimate:
        return MemoryEstimate(0, 0)


async def test_an_input_that_preprocess_cannot_decode_is_a_400_without_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """The plugin's own json.loads recursing past the interpreter's limit, or failing on text that
    is not JSON or not UTF-8: the client's input, so a 400 naming the decoding error, not a bug."""
    registry = PluginRegistry.from_entry_points(only=[])
    registry.register("buggy", Buggy)
    fleet = "models:\n  m: {plugin: buggy, warmup: {enabled: false}}\n"
    bodies = {b"[" * 5_000: "it nests too deeply (RecursionError)", b"{nope": "JSONDecodeError: Expecting",
              b'{"id": "\xff"}': "UnicodeDecodeError"}
    async with running(make_runtime(tmp_path, fleet, registry)) as runtime:
        for body, detail in bodies.items():
            with pytest.raises(InputError) as error:
                await runtime.submit("m", Payload(body, "application/json"))
            assert error.value.status_code == 400 and detail in error.value.detail, error.value.detail
        assert (await runtime.submit("m", ask("fine"))).output == {"id": "fine"}
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


@pytest.mark.parametrize(("ident", "hook", "detail"), [
    ("explode", "preprocess", "failed in preprocess: KeyError: 'missing field'"),
    ("nan", "postprocess", "returned from postprocess nan at answer.score, which JSON cannot carry"),
    ("set", "postprocess", "returned from postprocess a set at answer.ids, which is not JSON"),
])
async def test_a_plugin_bug_is_a_500_whose_log_names_plugin_and_hook(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, ident: str, hook: str, detail: str
) -> None:
    registry = PluginRegistry.from_entry_points(only=[])
    registry.register("buggy", Buggy)
    fleet = "models:\n  m: {plugin: buggy, warmup: {enabled: false}}\n"
    async with running(make_runtime(tmp_path, fleet, registry)) as runtime:
        with pytest.raises(ModelError) as error:
            await runtime.submit("m", ask(ident))
        assert (await runtime.submit("m", ask("fine"))).output == {"id": "fine"}  # the model keeps serving
    assert error.value.status_code == 500 and detail in error.value.detail and "'buggy'" in error.value.detail
    if hook == "preprocess":
        [line] = [r for r in caplog.records if r.name == "router.serving.runtime" and r.levelname == "ERROR"]
        assert line.getMessage() == "model m: plugin buggy raised in preprocess: KeyError: 'missing field'"
        assert line.exc_info is not None  # the traceback, once


class SlowPreprocess(Buggy):
    """preprocess of 'block' waits for `release`; every preprocess call is recorded."""

    calls: ClassVar[list[str]] = []
    release = __import__("threading").Event()

    def preprocess(self, payload: Payload) -> str:
        ident = str(json.loads(payload.body)["id"])
        type(self).calls.append(ident)
        if ident == "block":
            type(self).release.wait(10)
        return ident


async def test_preprocessing_of_a_request_answered_before_a_worker_took_it_is_skipped(tmp_path: Path) -> None:
    registry = PluginRegistry.from_entry_points(only=[])
    registry.register("slow", SlowPreprocess)
    SlowPreprocess.calls.clear()
    SlowPreprocess.release.clear()
    fleet = "models:\n  m: {plugin: slow, warmup: {enabled: false}}\n"
    async with running(make_runtime(tmp_path, fleet, registry, cpu_workers=1)) as runtime:
        blocking = asyncio.create_task(runtime.submit("m", ask("block")))  # holds the only worker
        await until(lambda: SlowPreprocess.calls == ["block"])
        with pytest.raises(DeadlineExceeded, match="preparing the input"):
            await runtime.submit("m", ask("late"), timeout_ms=50)
        SlowPreprocess.release.set()
        await blocking
        assert (await runtime.submit("m", ask("after"))).output == {"id": "after"}
    assert SlowPreprocess.calls == ["block", "after"]  # "late" was never preprocessed
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
    overlapped = any(b["start"] < a["end"] for a, b in itertools.pairwise(rows))
    assert len(rows) == 12 and overlapped is overlap


def test_a_request_behind_another_models_batch_on_a_one_batch_device_is_predicted_from_it(
    tmp_path: Path,
) -> None:
    """On a virtual clock, so the 0.6 s batch is still 0.6 s away when the hurried request comes."""
    fleet = """
devices:
  cpu: {max_concurrent_batches: 1}
models:
  long: {plugin: scripted, options: {fixed_ms: 600}, batch: {max_size: 1}}
  short: {plugin: scripted, options: {fixed_ms: 20}, batch: {max_size: 1}}
"""

    async def main(loop: VirtualClockLoop) -> tuple[QueueFull, Answer]:
        async with running(make_runtime(tmp_path, fleet, clock=loop.time)) as runtime:
            await runtime.submit("short", ask("timed"))  # a real batch: no probe is let through on the way
            running_long = asyncio.create_task(runtime.submit("long", ask("busy")))
            await until(lambda: busy(runtime, "long"))
            with pytest.raises(QueueFull, match="predicted") as refused:
                await runtime.submit("short", ask("hurried"), timeout_ms=300)  # the device is busy for 600 ms
            answer = await runtime.submit("short", ask("patient"), timeout_ms=5000)
            await running_long
        return refused.value, answer

    refused, answer = run_virtual(main)
    assert refused.status_code == 503 and answer.output["id"] == "patient"
