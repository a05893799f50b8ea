"""One model instance: its lifecycle state machine, out-of-memory splitting, model errors and the
execution timeout, with a plugin whose behaviour each test scripts. No sleeps: a batch that must
hang waits on an event the test sets."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from router.errors import BatchSizeMismatch, DeviceOutOfMemory, ExecutionTimeout, ModelError
from router.sdk.plugin import MemoryEstimate, ModelPlugin, Payload, PluginContext
from router.serving.hooks import INLINE_AFTER_CALLS, TRY_INLINE_BELOW_S
from router.serving.instance import InstanceState, ModelInstance, is_out_of_memory
from tests.outcomes import HeardTicket


class Scripted(ModelPlugin):  # type: ignore[type-arg]
    """predict_batch records each batch's items and does what `behaviour` says."""

    accepts = ("application/json",)

    def __init__(self, behaviour: Callable[[list[Any]], list[Any]]) -> None:
        super().__init__(self.Options(), PluginContext("m", __import__("pathlib").Path(".")))
        self.behaviour = behaviour
        self.batches: list[list[Any]] = []

    def load(self, device: str) -> None:
        pass

    def preprocess(self, payload: Payload) -> Any:
        return payload.body

    def predict_batch(self, items: Sequence[Any]) -> list[Any]:
        self.batches.append(list(items))
        return self.behaviour(list(items))

    def memory_estimate(self) -> MemoryEstimate:
        return MemoryEstimate(0, 0)


def ready_instance(behaviour: Callable[[list[Any]], list[Any]], timeout_s: float = 5.0) -> tuple[ModelInstance, Scripted]:
    plugin = Scripted(behaviour)
    instance = ModelInstance("m", 0, "cpu", plugin, execution_timeout_s=timeout_s)
    instance.begin_load()
    instance.begin_warmup()
    instance.mark_ready(MemoryEstimate(0, 0), 8)
    return instance, plugin


def tickets(*items: str) -> list[HeardTicket]:
    loop = asyncio.get_running_loop()
    return [HeardTicket(item, item, 1, 0.0, 60.0, future=loop.create_future()) for item in items]


async def run(instance: ModelInstance, batch: list[HeardTicket]) -> None:
    """Run a batch and answer its tickets from the result, as the device scheduler does."""
    (await instance.execute(batch)).resolve(dispatched_at=0.0)


def oom_above(limit: int, error: Callable[[int], BaseException]) -> Callable[[list[Any]], list[Any]]:
    def behaviour(items: list[Any]) -> list[Any]:
        if len(items) > limit:
            raise error(len(items))
        return [f"out-{i}" for i in items]

    return behaviour


# -- lifecycle ----------------------------------------------------------------------------------


def test_the_lifecycle_moves_only_along_its_transitions(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="router.serving.instance")
    instance = ModelInstance("m", 0, "cpu", Scripted(list), execution_timeout_s=1.0)
    assert instance.state is InstanceState.PENDING
    with pytest.raises(RuntimeError, match="no transition from pending to ready"):
        instance.mark_ready(MemoryEstimate(0, 0), 1)
    instance.begin_load()
    instance.begin_warmup()
    instance.mark_ready(MemoryEstimate(10, 1), 4)
    assert instance.serving and instance.loaded and instance.max_batch == 4
    instance.fence("test")
    assert instance.serving and not instance.schedulable
    instance.recover()
    instance.begin_drain()
    assert not instance.serving and instance.loaded
    instance.begin_unload()
    instance.mark_unloaded()
    assert not instance.loaded and instance.estimate is None
    instance.begin_load()  # an unloaded instance may load again
    instance.fail("weights missing")
    assert instance.error == "weights missing"
    moves = [r.message for r in caplog.records if "->" in r.message]
    assert moves == [
        "model m instance 0: pending -> loading (on cpu)", "model m instance 0: loading -> warming",
        "model m instance 0: warming -> ready", "model m instance 0: ready -> fenced (test)",
        "model m instance 0: fenced -> ready (the stalled batch returned)", "model m instance 0: ready -> draining",
        "model m instance 0: draining -> unloading", "model m instance 0: unloading -> unloaded",
        "model m instance 0: unloaded -> loading (on cpu)", "model m instance 0: loading -> failed (weights missing)",
    ]


# -- out of memory, errors ------------------------------------------------------------------------


async def test_out_of_memory_splits_the_batch_in_halves_and_loses_nothing() -> None:
    instance, plugin = ready_instance(oom_above(2, lambda n: DeviceOutOfMemory(f"batch of {n}")))
    batch = tickets(*(f"r{i}" for i in range(8)))
    await run(instance, batch)
    assert [t.future.result() for t in batch] == [f"out-r{i}" for i in range(8)]
    assert [len(b) for b in plugin.batches] == [8, 4, 2, 2, 4, 2, 2]


@pytest.mark.parametrize("error", [
    lambda n: torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    lambda n: RuntimeError("CUDA error: out of memory"),
    lambda n: MemoryError(),
], ids=["torch-cuda-oom", "runtime-error-text", "memory-error"])
async def test_each_framework_s_out_of_memory_is_recognised(error: Callable[[int], BaseException]) -> None:
    assert is_out_of_memory(error(1))
    instance, plugin = ready_instance(oom_above(1, error))
    batch = tickets("a", "b", "c", "d")
    await run(instance, batch)
    assert [t.future.result() for t in batch] == ["out-a", "out-b", "out-c", "out-d"]
    assert [len(b) for b in plugin.batches][:3] == [4, 2, 1]


async def test_a_single_input_that_still_runs_out_of_memory_gets_503_alone() -> None:
    def behaviour(items: list[Any]) -> list[Any]:
        if "oom" in items:
            raise DeviceOutOfMemory("no room")
        return items

    instance, _ = ready_instance(behaviour)
    batch = tickets("a", "oom", "b", "c")
    await run(instance, batch)
    with pytest.raises(DeviceOutOfMemory) as error:
        batch[1].future.result()
    assert error.value.status_code == 503
    assert [batch[i].future.result() for i in (0, 2, 3)] == ["a", "b", "c"]


async def test_a_model_error_answers_the_batch_500_and_the_instance_keeps_serving() -> None:
    def behaviour(items: list[Any]) -> list[Any]:
        if "bad" in items:
            raise ValueError("broken input")
        return items

    instance, _ = ready_instance(behaviour)
    failed, later = tickets("bad", "x"), tickets("y")
    await run(instance, failed)
    await run(instance, later)
    for ticket in failed:
        with pytest.raises(ModelError, match="ValueError: broken input"):
            ticket.future.result()
    assert later[0].future.result() == "y" and instance.state is InstanceState.READY


async def test_a_wrong_number_of_outputs_is_a_named_error() -> None:
    instance, _ = ready_instance(lambda items: items[:-1])
    batch = tickets("a", "b")
    await run(instance, batch)
    for ticket in batch:
        with pytest.raises(BatchSizeMismatch, match="returned 1 outputs for a batch of 2"):
            ticket.future.result()


async def test_tickets_whose_caller_left_are_dropped_before_the_batch_runs() -> None:
    instance, plugin = ready_instance(lambda items: items)
    batch = tickets("gone", "here")
    batch[0].abandon()
    await run(instance, batch)
    assert plugin.batches == [["here"]]


# -- the execution timeout ----------------------------------------------------------------------


async def test_a_batch_past_its_execution_timeout_fences_the_instance_until_its_thread_returns() -> None:
    release = threading.Event()

    def behaviour(items: list[Any]) -> list[Any]:
        if "hang" in items:
            release.wait(10)
        return items

    instance, _ = ready_instance(behaviour, timeout_s=0.05)
    hung = tickets("hang")
    await run(instance, hung)
    with pytest.raises(ExecutionTimeout) as error:
        hung[0].future.result()
    assert error.value.status_code == 504
    assert instance.state is InstanceState.FENCED and not instance.schedulable
    behind = tickets("behind")  # dispatched while the thread is still busy: refused, not queued on the thread
    await run(instance, behind)
    with pytest.raises(ExecutionTimeout, match="stalled"):
        behind[0].future.result()
    release.set()
    await instance.wait_idle()
    await asyncio.sleep(0)  # the thread's return is handed to the loop
    assert instance.state is InstanceState.READY
    after = tickets("after")
    await run(instance, after)
    assert after[0].future.result() == "after"
    instance.shutdown()


# -- where a batch runs -------------------------------------------------------------------------


async def _batch_threads(instance: ModelInstance, batches: int) -> list[bool]:
    """Run `batches` batches; whether each ran on the event loop's thread."""
    loop_thread = threading.get_ident()
    where: list[bool] = []
    instance.plugin.behaviour = lambda items: where.append(threading.get_ident() == loop_thread) or items  # type: ignore[attr-defined]
    for index in range(batches):
        await run(instance, tickets(f"r{index}"))
    return where


async def test_a_cheap_batch_on_the_cpu_runs_on_the_event_loop_once_timed_on_its_thread() -> None:
    instance, _ = ready_instance(list)
    where = await _batch_threads(instance, 200)
    instance.shutdown()
    assert not any(where[:INLINE_AFTER_CALLS])  # timed on the instance's thread first
    assert where[-1] and sum(where) > 150


async def test_a_dear_batch_never_runs_on_the_event_loop() -> None:
    instance, _ = ready_instance(list)
    loop_thread = threading.get_ident()
    where: list[bool] = []

    def dear(items: list[Any]) -> list[Any]:
        where.append(threading.get_ident() == loop_thread)
        threading.Event().wait(TRY_INLINE_BELOW_S * 2)  # over the try threshold, on any machine
        return items

    instance.plugin.behaviour = dear  # type: ignore[attr-defined]
    for index in range(2 * INLINE_AFTER_CALLS):
        await run(instance, tickets(f"r{index}"))
    instance.shutdown()
    assert len(where) == 2 * INLINE_AFTER_CALLS and not any(where)


class OwnThread(Scripted):
    predict_on_own_thread = True


@pytest.mark.parametrize("device, plugin_cls", [("cuda:0", Scripted), ("cpu", OwnThread)])
async def test_a_batch_stays_on_its_thread_off_the_cpu_or_when_its_plugin_asks(device: str,
                                                                               plugin_cls: type[Scripted]) -> None:
    instance = ModelInstance("m", 0, device, plugin_cls(list), execution_timeout_s=5.0)
    instance.begin_load()
    instance.begin_warmup()
    instance.mark_ready(MemoryEstimate(0, 0), 8)
    where = await _batch_threads(instance, 100)
    instance.shutdown()
    assert len(where) == 100 and not any(where)
