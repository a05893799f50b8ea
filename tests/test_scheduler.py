"""The device scheduler driven step by step: a fake clock, fake models and instances, and a
scripted probe. No sleeps: each test calls `step()` and awaits the batches it started."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from router.config import BatchPolicy, DeviceConfig
from router.errors import DeadlineExceeded
from router.scheduling.memory import MemoryReading, ProbeError
from router.scheduling.queue import BatchResult, ModelQueue, Ticket
from router.scheduling.scheduler import DeviceScheduler
from router.scheduling.service_time import BatchTime
from router.sdk.plugin import MemoryEstimate
from tests.outcomes import HeardTicket
from tests.probes import ScriptedProbe


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass(eq=False)
class FakeRunner:
    """An instance: runs a batch by answering its tickets, after `hold` is set if given."""

    key: str
    estimate: MemoryEstimate | None
    max_batch: int
    clock: Clock
    cost_s: float = 0.0  # fake time one batch takes (advances the clock)
    hold: asyncio.Event | None = None
    stalled: asyncio.Event | None = None  # wait_idle blocks on it: a fenced batch's thread still running
    ready: bool = True
    busy: bool = False
    times: BatchTime = field(default_factory=BatchTime)
    batches: list[list[str]] = field(default_factory=list)

    @property
    def schedulable(self) -> bool:
        return self.ready and not self.busy

    def begin_batch(self, size: int, now: float) -> None:
        self.busy = True

    def end_batch(self) -> None:
        self.busy = False

    async def execute(self, tickets: Sequence[Ticket]) -> BatchResult:
        self.batches.append([t.request_id for t in tickets])
        if self.hold is not None:
            await self.hold.wait()
        self.clock.now += self.cost_s
        return BatchResult([(t, t.request_id) for t in tickets], size=len(tickets), execution_s=self.cost_s)

    async def wait_idle(self) -> None:
        if self.stalled is not None:
            await self.stalled.wait()


@dataclass(eq=False)
class FakeModel:
    name: str
    queue: ModelQueue
    batch_policy: BatchPolicy
    weight: float = 1.0
    budget_bytes: int | None = None
    horizon_s: float = 0.0

    def dispatch_horizon_s(self, runner: Any, size: int, now: float) -> float:
        return self.horizon_s


def model(name: str, *, max_size: int = 8, delay_ms: float = 0.0, weight: float = 1.0,
          budget: int | None = None) -> FakeModel:
    return FakeModel(name, ModelQueue(name, max_size=256), BatchPolicy(max_size=max_size, max_delay_ms=delay_ms),
                     weight, budget)


def scheduler(clock: Clock, *, budget: int = 1000, probe: ScriptedProbe | None = None, **device: Any) -> DeviceScheduler:
    device.setdefault("max_concurrent_batches", 64)  # memory decides here; the batch limit has its own tests
    config = DeviceConfig(memory_budget=budget, probe="none" if probe is None else "host", **device)
    sched = DeviceScheduler("cpu", config, probe, clock=clock)
    sched.resolve_budget()
    return sched


def enqueue(m: FakeModel, clock: Clock, count: int, *, deadline_s: float = 60.0, prefix: str = "r") -> list[HeardTicket]:
    loop = asyncio.get_running_loop()
    tickets = []
    for i in range(count):
        ticket = HeardTicket(f"{prefix}{i}", None, 1, clock.now, clock.now + deadline_s, future=loop.create_future())
        m.queue.put(ticket)
        tickets.append(ticket)
    return tickets


async def settle(sched: DeviceScheduler) -> None:
    """Let every batch the scheduler started finish (its thread returned, its memory released)."""
    while sched._running:
        await asyncio.gather(*list(sched._running))


def runner(key: str, clock: Clock, *, per_item: int = 0, fixed: int = 0, weights: int = 0, max_batch: int = 8,
           **kwargs: Any) -> FakeRunner:
    return FakeRunner(key, MemoryEstimate(weights, per_item, fixed), max_batch, clock, **kwargs)


async def test_a_batch_that_does_not_fit_is_shrunk_to_the_largest_that_does() -> None:
    clock = Clock()
    sched = scheduler(clock, budget=1000)
    m, r = model("m"), runner("m/0", clock, per_item=300)
    sched.attach(m, r)
    enqueue(m, clock, 8)
    sched.step()
    await settle(sched)
    assert r.batches == [["r0", "r1", "r2"]]  # 3 x 300 fits 1000, 4 x 300 does not
    assert sched.ledger.reserved_bytes == 0


async def test_a_head_that_cannot_fit_waits_and_nobody_behind_it_goes_first() -> None:
    clock = Clock()
    sched = scheduler(clock, budget=1000)
    hold = asyncio.Event()
    big, small, other = model("big"), model("small"), model("other")
    r_big = runner("big/0", clock, per_item=600)
    r_small = runner("small/0", clock, per_item=500, hold=hold)
    r_other = runner("other/0", clock, per_item=100)
    for m, r in ((big, r_big), (small, r_small), (other, r_other)):
        sched.attach(m, r)
    enqueue(small, clock, 1, prefix="s")
    sched.step()  # small runs and holds 500
    assert sched.ledger.reserved_bytes == 500
    enqueue(big, clock, 1, prefix="b")
    enqueue(other, clock, 1, prefix="o")
    clock.now += 0.001
    wake = sched.step()
    assert sched.last_admission.blocked == "big"  # 600 does not fit beside 500: big waits at the head...
    assert r_big.batches == [] and r_other.batches == []  # ...and other, behind it in fair order, waits too
    assert wake is not None  # polls the memory again
    hold.set()
    await settle(sched)
    sched.step()
    await settle(sched)
    assert r_big.batches == [["b0"]] and r_other.batches == [["o0"]]


async def test_admission_pauses_above_the_high_watermark_and_resumes_below_the_low() -> None:
    clock = Clock()
    used = {"bytes": 9_500}
    probe = ScriptedProbe("cpu", lambda: MemoryReading(used["bytes"], 10_000))
    sched = scheduler(clock, budget=10_000, probe=probe, poll_interval_ms=20)
    m, r = model("m"), runner("m/0", clock, per_item=1)
    sched.attach(m, r)
    enqueue(m, clock, 1)
    assert sched.step() == pytest.approx(clock.now + 0.02)  # paused: look again after one poll
    assert sched.paused and r.batches == []
    used["bytes"] = 8_500  # between the watermarks (0.8 and 0.9): still paused
    clock.now += 0.05
    sched.step()
    assert sched.paused and r.batches == []
    used["bytes"] = 7_000  # below the low watermark
    clock.now += 0.05
    sched.step()
    await settle(sched)
    assert not sched.paused and r.batches == [["r0"]]


async def test_models_get_device_time_in_proportion_to_their_weight() -> None:
    clock = Clock()
    sched = scheduler(clock, budget=1000)
    heavy, light = model("heavy", max_size=1, weight=3.0), model("light", max_size=1, weight=1.0)
    r_heavy = runner("heavy/0", clock, per_item=600, max_batch=1, cost_s=0.01)
    r_light = runner("light/0", clock, per_item=600, max_batch=1, cost_s=0.01)
    sched.attach(heavy, r_heavy)
    sched.attach(light, r_light)
    enqueue(heavy, clock, 40, prefix="h")
    enqueue(light, clock, 40, prefix="l")
    for _ in range(24):  # one batch fits at a time: the fair order decides each turn
        sched.step()
        await settle(sched)
    assert len(r_heavy.batches) + len(r_light.batches) == 24
    assert len(r_heavy.batches) == 18, (len(r_heavy.batches), len(r_light.batches))  # 3 : 1


async def test_fair_shares_count_recent_use_only() -> None:
    clock = Clock()
    sched = scheduler(clock, budget=1000)
    old, new = model("old", max_size=1), model("new", max_size=1)
    r_old = runner("old/0", clock, per_item=600, max_batch=1, cost_s=1.0)
    r_new = runner("new/0", clock, per_item=600, max_batch=1, cost_s=1.0)
    sched.attach(old, r_old)
    sched.attach(new, r_new)
    enqueue(old, clock, 30, prefix="o")
    for _ in range(30):  # the old model alone for 30 s of device time
        sched.step()
        await settle(sched)
    clock.now += 60.0  # a minute later, both have work
    enqueue(old, clock, 10, prefix="p")
    enqueue(new, clock, 10, prefix="n")
    for _ in range(10):
        sched.step()
        await settle(sched)
    assert len(r_new.batches) <= 7 and len(r_old.batches) >= 30 + 3  # shared, not 10 turns to the newcomer


async def test_a_failing_or_lying_probe_pauses_admission_logged_once_until_it_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    readings: list[Any] = [MemoryReading(0, 10_000), ProbeError("NVML hiccup"), MemoryReading(5, 1),
                           RuntimeError("driver gone"), MemoryReading(0, 10_000)]
    probe = ScriptedProbe("cpu", readings)
    sched = scheduler(clock, budget=5_000, probe=probe)
    m, r = model("m"), runner("m/0", clock, per_item=1)
    sched.attach(m, r)
    enqueue(m, clock, 1)
    caplog.set_level(logging.WARNING, logger="router.scheduling.scheduler")
    for _ in range(3):
        clock.now += 0.1
        sched.step()
        assert r.batches == [] and sched.paused
    assert sched.probe_errors == 3
    assert sum("failed, batch admission paused" in rec.message for rec in caplog.records) == 1
    clock.now += 0.1
    sched.step()
    await settle(sched)
    assert r.batches == [["r0"]] and not sched.paused
    assert any("recovered" in rec.message for rec in caplog.records)


async def test_a_request_that_would_be_answered_after_its_deadline_is_504_at_dispatch_and_not_run() -> None:
    clock = Clock()
    sched = scheduler(clock)
    m, r = model("m"), runner("m/0", clock)
    m.horizon_s = 0.5  # an answer takes half a second from dispatch
    sched.attach(m, r)
    doomed = enqueue(m, clock, 1, deadline_s=0.2, prefix="late")
    kept = enqueue(m, clock, 1, deadline_s=5.0, prefix="ok")
    sched.step()
    await settle(sched)
    assert r.batches == [["ok0"]]
    with pytest.raises(DeadlineExceeded, match="not run"):
        doomed[0].future.result()
    assert kept[0].future.result() == "ok0"


async def test_a_batch_waits_for_its_delay_unless_it_is_full() -> None:
    clock = Clock()
    sched = scheduler(clock)
    m, r = model("m", max_size=4, delay_ms=50), runner("m/0", clock, max_batch=4)
    sched.attach(m, r)
    enqueue(m, clock, 2)
    assert sched.step() == pytest.approx(clock.now + 0.05)  # due 50 ms after the first arrival
    assert r.batches == []
    enqueue(m, clock, 2, prefix="s")  # now full: goes at once
    sched.step()
    await settle(sched)
    assert r.batches == [["r0", "r1", "s0", "s1"]]


async def test_the_loop_restarts_after_a_crash_and_still_dispatches(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    sched = scheduler(clock)
    m, r = model("m"), runner("m/0", clock)
    sched.attach(m, r)
    original = sched.step
    crashes = iter([True])

    def flaky() -> float | None:
        if next(crashes, False):
            raise RuntimeError("bug in the loop")
        return original()

    monkeypatch.setattr(sched, "step", flaky)
    sched.start()
    try:
        [ticket] = enqueue(m, clock, 1)
        sched.notify()
        assert await asyncio.wait_for(ticket.future, 5) == "r0"
    finally:
        await sched.stop()
    assert sched.restarts == 1


async def test_a_fenced_batch_keeps_its_memory_but_not_its_slot_on_a_one_batch_device() -> None:
    clock = Clock()
    sched = scheduler(clock, budget=1000, max_concurrent_batches=1)
    thread = asyncio.Event()
    hung, other = model("hung"), model("other")
    r_hung = runner("hung/0", clock, per_item=100, stalled=thread)
    r_other = runner("other/0", clock, per_item=100)
    sched.attach(hung, r_hung)
    sched.attach(other, r_other)
    enqueue(hung, clock, 1, prefix="h")
    sched.step()
    for _ in range(3):
        await asyncio.sleep(0)  # the hung batch is answered (504 at its timeout); its thread runs on
    assert sched.running_batches == 0 and sched.ledger.reserved_bytes == 100
    enqueue(other, clock, 1, prefix="o")
    clock.now += 0.001
    sched.step()
    for _ in range(3):
        await asyncio.sleep(0)
    assert r_other.batches == [["o0"]]  # the other model runs beside the fenced one
    thread.set()
    await settle(sched)
    assert sched.ledger.reserved_bytes == 0
