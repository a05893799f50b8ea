"""Mirrored (shadow) items cost real requests nothing: the queue's order and room, the request
rules, batch admission and the device scheduler, each driven with plain values and a fake clock."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from router.config import BatchPolicy
from router.errors import DeadlineExceeded, ModelError, NoSpareCapacity, QueueFull, ShuttingDown
from router.http.metrics import RouterMetrics
from router.scheduling.batch_admission import AdmittedBatch, Candidate, DeviceState, admit_batches
from router.scheduling.queue import ModelQueue, Outcome, Refused, Ticket
from router.serving.intake import Intake, Turn
from router.serving.rules import ModelFigures, Refusal, Terms, admit, has_room, screen
from router.serving.telemetry import TelemetryFanout, mirror_outcome
from tests.outcomes import HeardTicket
from tests.test_scheduler import Clock, enqueue, model, runner, scheduler, settle

NOW = 100.0


def ticket(request_id: str, priority: int = 1, *, shadow: bool = False, at: float = NOW,
           heard: list[tuple[str, Outcome]] | None = None) -> Ticket:
    reply = None if heard is None else (lambda outcome: heard.append((request_id, outcome)))
    return Ticket(request_id, None, priority, at, at + 60.0, reply, shadow=shadow)


def ids(tickets: list[Ticket]) -> list[str]:
    return [t.request_id for t in tickets]


# -- the queue ----------------------------------------------------------------------------------


def test_real_items_are_batched_before_any_shadow_item_at_every_priority() -> None:
    queue = ModelQueue("m", max_size=16, priority_levels=3)
    queue.put(ticket("s1", 3, shadow=True, at=NOW - 5))  # older, and at the highest level
    for level in (1, 2, 3):
        queue.put(ticket(f"r{level}", level))
    queue.put(ticket("s2", 1, shadow=True))

    assert (queue.depth, queue.real_depth, queue.shadow_depth) == (5, 3, 2)
    policy = BatchPolicy(max_size=8, max_delay_ms=0)
    assert queue.due_at(policy) == NOW  # the real lane's oldest, not the older copy
    real, _ = queue.take_viable(8, NOW, 0.0)
    assert ids(real) == ["r3", "r2", "r1"]  # never a copy beside them, however high its level
    assert queue.due_at(policy) is None
    assert queue.due_at(policy, shadow=True) == NOW - 5
    shadows, _ = queue.take_viable(8, NOW, 0.0, shadow=True)
    assert ids(shadows) == ["s1", "s2"]
    assert queue.depth == 0


def test_a_real_item_on_a_full_queue_takes_the_place_of_the_oldest_queued_copy() -> None:
    heard: list[tuple[str, Outcome]] = []
    queue = ModelQueue("m", max_size=3)
    for name in ("s1", "s2"):
        queue.put(ticket(name, shadow=True, heard=heard))
    queue.put(ticket("r1", heard=heard))

    queue.reserve_slot(NOW)  # full: a real one sheds the oldest copy instead of a 503
    assert [(rid, type(o.error)) for rid, o in heard if isinstance(o, Refused)] == [("s1", NoSpareCapacity)]
    queue.put(ticket("r2"))  # not reserved: sheds the next copy
    assert [rid for rid, _ in heard] == ["s1", "s2"]
    assert (queue.occupancy, queue.shadow_occupancy, queue.real_occupancy) == (3, 0, 3)
    with pytest.raises(QueueFull):  # only real items left: the bound holds
        queue.reserve_slot(NOW)


def test_a_shadow_item_counts_every_slot_and_is_refused_without_room() -> None:
    queue = ModelQueue("m", max_size=2)
    queue.put(ticket("r1"))
    queue.reserve_slot(NOW, shadow=True)
    with pytest.raises(NoSpareCapacity):
        queue.reserve_slot(NOW, shadow=True)
    with pytest.raises(NoSpareCapacity):
        queue.put(ticket("s", shadow=True))
    queue.release_slot(shadow=True)
    assert queue.occupancy == 1


def test_a_copy_crowded_out_while_it_was_prepared_is_refused_at_put_and_keeps_its_slot() -> None:
    queue = ModelQueue("m", max_size=2)
    queue.reserve_slot(NOW, shadow=True)
    queue.reserve_slot(NOW)
    queue.reserve_slot(NOW)  # real ones never count the copy: over the bound by the copy being prepared
    assert queue.occupancy == 3

    with pytest.raises(NoSpareCapacity):
        queue.put(ticket("s", shadow=True), reserved=True)
    queue.release_slot(shadow=True)  # its caller gives the slot back
    assert (queue.occupancy, queue.real_occupancy) == (2, 2)


def test_withdrawn_and_drained_copies_leave_the_counts_right() -> None:
    queue = ModelQueue("m", max_size=8)
    shadows = [ticket(f"s{i}", shadow=True, at=NOW + i) for i in range(3)]
    for item in shadows:
        queue.put(item)
    queue.put(ticket("r", at=NOW + 10))
    assert queue.withdraw(shadows[1])
    assert (queue.depth, queue.shadow_depth) == (3, 2)
    assert ids(queue.withdraw_all()) == ["s0", "s2", "r"]
    assert (queue.depth, queue.shadow_depth, queue.real_depth) == (0, 0, 0)


# -- the request rules --------------------------------------------------------------------------


def figures(*, occupancy: int = 0, capacity: int = 4, shadow: int = 0, real_waiting: int | None = 0,
            **kwargs: Any) -> ModelFigures:
    return ModelFigures("m", 1, 1, 1000, capacity, occupancy, 1.0, shadow=shadow, real_waiting=real_waiting,
                        at=NOW, **kwargs)


def shadow_terms(model_name: str = "m") -> Terms:
    return Terms(model_name, NOW, shadow=True)


def test_a_shadow_item_is_refused_while_real_work_waits_on_its_model_or_device() -> None:
    with pytest.raises(NoSpareCapacity, match="real request"):
        admit(shadow_terms(), figures(occupancy=1, real_waiting=1), NOW)
    with pytest.raises(NoSpareCapacity):
        admit(shadow_terms(), figures(real_waiting=3), NOW)  # another model's queue on the device

    taken = admit(shadow_terms(), figures(occupancy=2, shadow=2), NOW)
    assert taken.shadow and not taken.half_open and not taken.measure
    assert taken.queue_position == 2


def test_a_shadow_item_needs_room_and_never_takes_the_half_open_turn() -> None:
    with pytest.raises(NoSpareCapacity, match="no room"):
        admit(shadow_terms(), figures(occupancy=4, shadow=4), NOW)
    with pytest.raises(NoSpareCapacity):
        admit(shadow_terms(), figures(occupancy=3, shadow=3), NOW, pending=1)
    with pytest.raises(ShuttingDown):  # the server's own refusal comes first, as for any request
        admit(shadow_terms(), figures(refusal=Refusal("ShuttingDown", "bye", 5.0)), NOW)


def test_the_board_screen_leaves_the_device_to_the_commit() -> None:
    screened = screen(shadow_terms(), figures(occupancy=1, shadow=0, real_waiting=None), NOW)
    assert screened.terms.shadow


def test_a_real_request_does_not_count_queued_copies_against_its_room() -> None:
    full_of_copies = figures(occupancy=4, shadow=3, real_waiting=None)
    assert has_room(full_of_copies)
    taken = admit(Terms("m", NOW), full_of_copies, NOW)
    assert taken.queue_position == 1 and not taken.shadow  # ahead of every copy
    with pytest.raises(QueueFull):
        admit(Terms("m", NOW), figures(occupancy=4, shadow=0), NOW)


def test_terms_cross_processes_with_the_new_field_and_old_arrays_still_decode() -> None:
    terms = Terms("m", 1.5, 2, 100.0, 3, must_finish=True, shadow=True)
    wire = msgspec.msgpack.encode(terms)
    assert msgspec.msgpack.decode(wire, type=Terms) == terms
    old = msgspec.msgpack.encode(["m", 1.5, 2, 100.0, 3, True, False])  # before `shadow`
    assert msgspec.msgpack.decode(old, type=Terms) == Terms("m", 1.5, 2, 100.0, 3, must_finish=True)
    board = msgspec.msgpack.encode(figures(shadow=2, real_waiting=1))
    assert msgspec.msgpack.decode(board, type=ModelFigures).shadow == 2


# -- batch admission ------------------------------------------------------------------------------


def cand(model_name: str, *, shadow: bool = False, queued: int = 4, share: float = 0.0) -> Candidate:
    return Candidate(model_name, f"{model_name}/0", queued, 8, 10, 0, None, 0, share, shadow)


def device(real_waiting: int = 0) -> DeviceState:
    return DeviceState(budget_bytes=1000, used_bytes=0, reserved_bytes=0, real_waiting=real_waiting)


def test_a_shadow_batch_goes_only_when_no_real_item_waits_on_the_device() -> None:
    assert admit_batches([cand("mirror", shadow=True)], device(real_waiting=1)).admits == []
    plan = admit_batches([cand("mirror", shadow=True, share=0.0), cand("stable", share=9.0)], device(real_waiting=4))
    assert plan.admits == [AdmittedBatch("stable", "stable/0", 4, 40)]  # the lower share is a copy: it waits
    spare = admit_batches([cand("mirror", shadow=True)], device())
    assert spare.admits == [AdmittedBatch("mirror", "mirror/0", 4, 40, shadow=True)]


def test_a_model_s_real_and_shadow_items_never_share_a_batch() -> None:
    plan = admit_batches([cand("m", queued=2), cand("m", shadow=True, queued=5)], device())
    assert [(b.size, b.shadow) for b in plan.admits] == [(2, False)]


# -- the device scheduler -------------------------------------------------------------------------


def put_shadows(m: Any, clock: Clock, count: int) -> list[HeardTicket]:
    loop = asyncio.get_running_loop()
    tickets = [HeardTicket(f"s{i}", None, 1, clock.now, clock.now + 60.0, future=loop.create_future(), shadow=True)
               for i in range(count)]
    for item in tickets:
        m.queue.put(item)
    return tickets


async def test_the_scheduler_holds_copies_while_real_work_waits_then_runs_them_apart() -> None:
    clock = Clock()
    sched = scheduler(clock, budget=1000)
    stable, mirror = model("stable"), model("mirror")
    hold = asyncio.Event()
    r_stable, r_mirror = runner("stable/0", clock, max_batch=1), runner("mirror/0", clock)
    sched.attach(stable, r_stable)
    sched.attach(mirror, r_mirror)
    copies = put_shadows(mirror, clock, 2)
    enqueue(stable, clock, 1)
    enqueue(mirror, clock, 1, prefix="m")  # the mirror version's own real request

    sched.step()
    await settle(sched)
    assert r_stable.batches == [["r0"]] and r_mirror.batches == [["m0"]]  # real first, never beside a copy

    r_stable.hold = hold
    enqueue(stable, clock, 2, prefix="late")
    sched.step()  # late0 runs (held); late1 waits for its busy instance: real work still waits
    await asyncio.sleep(0)
    sched.step()
    assert r_mirror.batches == [["m0"]] and sched.real_waiting() == 1
    assert not any(c.future.done() for c in copies)

    hold.set()
    await settle(sched)
    sched.step()
    await settle(sched)
    assert r_stable.batches[-1] == ["late1"] and r_mirror.batches == [["m0"]]
    sched.step()
    await settle(sched)
    sched.step()
    await settle(sched)
    assert r_mirror.batches == [["m0"], ["s0"], ["s1"]]  # one copy a batch: never long to wait behind
    assert [await c.future for c in copies] == ["s0", "s1"]


# -- intake: the commit, with the device's real work --------------------------------------------


def fake_deployment(name: str, queue: ModelQueue, *, serving: bool = True) -> Any:
    def model_figures(now: float, **_: Any) -> ModelFigures:
        return ModelFigures(name, 1, 1, 1000, queue.max_size, queue.occupancy, 1.0, at=now)
    return SimpleNamespace(name=name, queue=queue, serving=serving, generation=1, figures=model_figures,
                           instances=[SimpleNamespace(device="cpu")], gate=None,
                           residency=SimpleNamespace(hold=lambda now: None))


async def test_the_commit_refuses_a_copy_while_another_model_on_its_device_has_real_work() -> None:
    clock = Clock()
    sched = scheduler(clock)
    stable, mirror = model("stable"), model("mirror")
    sched.attach(stable, runner("stable/0", clock))
    sched.attach(mirror, runner("mirror/0", clock))
    deployments = {"mirror": fake_deployment("mirror", mirror.queue), "cold": fake_deployment(
        "cold", ModelQueue("cold", max_size=4), serving=False)}
    fleet = SimpleNamespace(schedulers={"cpu": sched}, get=deployments.__getitem__)
    intake = Intake(fleet, clock=clock)  # type: ignore[arg-type]

    stable.queue.reserve_slot(clock.now)  # a real request being prepared
    with pytest.raises(NoSpareCapacity):
        Turn(intake).admit(shadow_terms("mirror"))
    stable.queue.release_slot()
    turn = Turn(intake)
    first = turn.admit(shadow_terms("mirror"))
    second = turn.admit(shadow_terms("mirror"))
    assert first.admission.shadow and second.admission.queue_position == 1
    assert (mirror.queue.shadow_occupancy, mirror.queue.real_occupancy) == (2, 0)
    intake.unreserve(first)
    assert mirror.queue.shadow_occupancy == 1
    with pytest.raises(NoSpareCapacity, match="not serving"):
        intake.decide(deployments["cold"], shadow_terms("cold"))


# -- counting -------------------------------------------------------------------------------------


def test_mirror_outcomes_are_labelled_apart_from_a_user_s() -> None:
    assert mirror_outcome(None) == "served"
    assert mirror_outcome(NoSpareCapacity("x")) == "shed"
    assert mirror_outcome(DeadlineExceeded("x")) == "expired"
    assert mirror_outcome(ModelError("x")) == "failed"


def test_mirror_counts_go_to_their_own_counter_only() -> None:
    metrics = RouterMetrics()
    fanout = TelemetryFanout()
    fanout.add(metrics)
    fanout.observe_mirror("m", "shed")
    fanout.observe_mirror("m", "shed")
    fanout.observe_mirror("m", "served")
    assert metrics.mirror_requests.labels("m", "shed")._value.get() == 2
    assert metrics.request_counts() == {}
    assert b'model_router_mirror_requests_total{model="m",outcome="served"} 1.0' in metrics.render()
