"""ModelQueue, Ticket and DrainRate driven with plain float timestamps (an injected clock)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router.config import BatchPolicy
from router.errors import ModelError, PayloadTooLarge, QueueFull
from router.scheduling.queue import BatchFacts, BatchResult, DrainRate, Lease, ModelQueue, Ticket, TicketState, reject
from tests.outcomes import HeardTicket


def ticket(request_id: str, *, priority: int = 1, at: float = 0.0) -> Ticket:
    return Ticket(request_id, item=None, priority=priority, arrived_at=at, deadline=at + 10.0)


def ids(tickets: list[Ticket]) -> list[str]:
    return [t.request_id for t in tickets]


def take(queue: ModelQueue, n: int, now: float) -> list[Ticket]:
    """Dispatch up to n tickets with no deadline horizon: none is dropped as too late."""
    batch, doomed = queue.take_viable(n, now, 0.0)
    assert doomed == []
    return batch


def test_higher_priority_level_is_taken_first() -> None:
    queue = ModelQueue("m", max_size=10, priority_levels=3)
    queue.put(ticket("low", priority=1, at=0.0))
    queue.put(ticket("mid", priority=2, at=1.0))
    queue.put(ticket("high", priority=3, at=2.0))

    assert ids(take(queue, 3, now=3.0)) == ["high", "mid", "low"]


def test_tickets_within_a_level_leave_in_arrival_order() -> None:
    queue = ModelQueue("m", max_size=10, priority_levels=2)
    for n in range(4):
        queue.put(ticket(f"t{n}", priority=2, at=float(n)))

    assert ids(take(queue, 2, now=5.0)) == ["t0", "t1"]
    assert ids(take(queue, 5, now=6.0)) == ["t2", "t3"]


def test_dispatch_marks_tickets_dispatched() -> None:
    queue = ModelQueue("m", max_size=10)
    queue.put(ticket("a"))

    [taken] = take(queue, 1, now=4.5)

    assert taken.state is TicketState.DISPATCHED
    assert queue.depth == 0


def test_a_batch_result_answers_each_ticket_once_with_the_batch_it_rode() -> None:
    loop = asyncio.new_event_loop()
    try:
        done, failed, answered = (HeardTicket(n, None, 1, 0.0, 10.0, future=loop.create_future())
                                  for n in ("done", "failed", "x"))
        earlier, error = ModelError("earlier"), ModelError("boom")
        reject(answered, earlier)
        BatchResult([(done, "out"), (answered, "late")], [(failed, error)], size=3, execution_s=0.25,
                    finished_at=7.5).resolve(dispatched_at=7.0, memory_delta_bytes=-4)
        assert done.future.result() == "out" and done.batch == BatchFacts(3, 7.0, 0.25, 7.5, -4)
        assert failed.future.exception() is error and failed.batch == done.batch
        assert answered.future.exception() is earlier and answered.batch is None  # answered once: the first stands
    finally:
        loop.close()


class Instance:
    """Counts its uses, as `ModelInstance.begin_use`/`end_use` do."""

    def __init__(self) -> None:
        self.uses = 0

    def begin_use(self) -> None:
        self.uses += 1

    def end_use(self) -> None:
        self.uses -= 1


def test_a_served_ticket_leases_its_instance_until_the_lease_ends_once() -> None:
    """The lease is the one place an answered ticket's use of its instance ends: ended twice, it
    ends once; a ticket nobody reads any more (abandoned while its batch ran) takes no use."""
    instance = Instance()
    heard: list[Any] = []
    read, abandoned = (Ticket(n, None, 1, 0.0, 10.0, heard.append) for n in ("read", "abandoned"))
    abandoned.abandon()
    BatchResult([(read, "out"), (abandoned, "late")], size=2, instance=instance).resolve(dispatched_at=1.0)
    [served] = heard
    assert served.output == "out" and isinstance(served.lease, Lease) and instance.uses == 1
    served.lease.end()
    served.lease.end()
    assert instance.uses == 0


def test_put_rejects_priority_outside_configured_levels() -> None:
    queue = ModelQueue("m", max_size=10, priority_levels=2)

    with pytest.raises(ValueError, match=r"1\.\.2, got 3"):
        queue.put(ticket("a", priority=3))
    assert queue.depth == 0


def test_put_beyond_capacity_raises_queue_full_503() -> None:
    queue = ModelQueue("m", max_size=2)
    queue.put(ticket("a"))
    queue.put(ticket("b"))

    with pytest.raises(QueueFull) as error:
        queue.put(ticket("c"))

    assert error.value.status_code == 503
    assert "'m'" in error.value.detail
    assert error.value.headers["Retry-After"] == "1"  # nothing drained yet: the floor
    assert queue.depth == 2


@pytest.mark.parametrize(("drained", "retry_after"), [(1, "8"), (2, "4"), (4, "2")])
def test_retry_after_follows_observed_drain_rate(drained: int, retry_after: str) -> None:
    queue = ModelQueue("m", max_size=4)
    for n in range(drained):
        queue.put(ticket(f"old{n}", at=0.0))
    take(queue, drained, now=0.0)
    for n in range(4):
        queue.put(ticket(f"new{n}", at=1.0))

    with pytest.raises(QueueFull) as error:
        queue.put(ticket("late", at=2.0))  # rate = drained / 2 s; 4 queued

    assert error.value.headers["Retry-After"] == retry_after


def test_retry_after_is_capped_at_a_minute() -> None:
    queue = ModelQueue("m", max_size=100)
    queue.put(ticket("old"))
    take(queue, 1, now=0.0)

    assert queue.retry_after_s(now=0.0) == 1.0  # occupancy 0
    for n in range(100):
        queue.put(ticket(f"n{n}", at=1.0))
    assert queue.retry_after_s(now=4.0) == 60.0  # 100 / 0.25 per s = 400 s, capped


def test_drain_rate_forgets_events_older_than_window() -> None:
    rate = DrainRate(window_s=10.0)
    rate.record(0.0, 5)
    rate.record(4.0, 3)

    assert rate.per_second(4.0) == pytest.approx(8 / 4)
    assert rate.per_second(12.0) == pytest.approx(3 / 8)  # the t=0 event left the window
    assert rate.per_second(20.0) is None


def test_drain_rate_short_span_is_floored_at_quarter_second() -> None:
    rate = DrainRate()
    rate.record(1.0, 2)

    assert rate.per_second(1.0) == pytest.approx(8.0)


def test_reserved_slots_count_against_capacity() -> None:
    queue = ModelQueue("m", max_size=2)
    queue.reserve_slot(now=0.0)
    queue.put(ticket("a"))

    assert queue.occupancy == 2
    assert queue.depth == 1
    with pytest.raises(QueueFull):
        queue.reserve_slot(now=0.0)
    with pytest.raises(QueueFull):
        queue.put(ticket("b"))


def test_room_for_several_items_is_checked_as_a_whole() -> None:
    queue = ModelQueue("m", max_size=4)
    queue.put(ticket("a"))

    queue.check_room(now=0.0, items=3)
    with pytest.raises(QueueFull, match="room for 3 of 4 items"):
        queue.check_room(now=0.0, items=4)
    with pytest.raises(PayloadTooLarge, match="queues at most 4 requests; 5 items in one request can never fit"):
        queue.check_room(now=0.0, items=5)
    assert queue.occupancy == 1  # a check takes nothing


def test_put_with_reserved_slot_converts_it_even_when_full() -> None:
    queue = ModelQueue("m", max_size=2)
    queue.reserve_slot(now=0.0)
    queue.reserve_slot(now=0.0)

    queue.put(ticket("a"), reserved=True)
    queue.put(ticket("b"), reserved=True)

    assert queue.depth == 2
    assert queue.occupancy == 2


def test_release_slot_frees_capacity_and_never_goes_negative() -> None:
    queue = ModelQueue("m", max_size=1)
    queue.reserve_slot(now=0.0)
    queue.release_slot()
    queue.release_slot()

    assert queue.occupancy == 0
    queue.reserve_slot(now=0.0)
    assert queue.occupancy == 1


def test_withdraw_queued_ticket_removes_it() -> None:
    queue = ModelQueue("m", max_size=10)
    a, b = ticket("a"), ticket("b")
    queue.put(a)
    queue.put(b)

    assert queue.withdraw(a) is True
    assert a.state is TicketState.WITHDRAWN
    assert queue.depth == 1
    assert queue.occupancy == 1
    assert ids(take(queue, 10, now=1.0)) == ["b"]


def test_withdraw_dispatched_ticket_is_refused() -> None:
    queue = ModelQueue("m", max_size=10)
    a = ticket("a")
    queue.put(a)
    take(queue, 1, now=1.0)

    assert queue.withdraw(a) is False
    assert a.state is TicketState.DISPATCHED
    assert queue.depth == 0


def test_withdraw_twice_counts_once() -> None:
    queue = ModelQueue("m", max_size=10)
    a = ticket("a")
    queue.put(a)
    queue.put(ticket("b"))

    assert queue.withdraw(a) is True
    assert queue.withdraw(a) is False
    assert queue.depth == 1


def test_dispatch_skips_withdrawn_tickets() -> None:
    queue = ModelQueue("m", max_size=10, priority_levels=2)
    tickets = [ticket(f"t{n}", priority=1 + n % 2, at=float(n)) for n in range(6)]
    for t in tickets:
        queue.put(t)
    queue.withdraw(tickets[1])
    queue.withdraw(tickets[2])

    assert ids(take(queue, 10, now=9.0)) == ["t3", "t5", "t0", "t4"]
    assert queue.depth == 0


def test_due_at_is_none_when_empty() -> None:
    queue = ModelQueue("m", max_size=10)

    assert queue.due_at(BatchPolicy(max_size=4, max_delay_ms=50)) is None


def test_due_at_is_none_once_every_ticket_is_withdrawn() -> None:
    queue = ModelQueue("m", max_size=10)
    a = ticket("a", at=1.0)
    queue.put(a)
    queue.withdraw(a)

    assert queue.due_at(BatchPolicy()) is None


def test_due_at_is_max_delay_after_oldest_arrival_when_not_full() -> None:
    queue = ModelQueue("m", max_size=10)
    queue.put(ticket("a", at=10.0))
    queue.put(ticket("b", at=10.02))

    assert queue.due_at(BatchPolicy(max_size=4, max_delay_ms=50)) == pytest.approx(10.05)


def test_due_at_is_oldest_arrival_when_a_full_batch_waits() -> None:
    queue = ModelQueue("m", max_size=10)
    for n in range(4):
        queue.put(ticket(f"t{n}", at=10.0 + n))

    assert queue.due_at(BatchPolicy(max_size=4, max_delay_ms=50)) == 10.0


def test_due_at_uses_the_smaller_runtime_max_batch() -> None:
    queue = ModelQueue("m", max_size=10)
    queue.put(ticket("a", at=10.0))
    queue.put(ticket("b", at=11.0))
    policy = BatchPolicy(max_size=8, max_delay_ms=50)

    assert queue.due_at(policy) == pytest.approx(10.05)
    assert queue.due_at(policy, max_batch=2) == 10.0


def test_priority_does_not_change_which_arrival_starts_the_delay() -> None:
    queue = ModelQueue("m", max_size=10, priority_levels=3)
    queue.put(ticket("early-low", priority=1, at=1.0))
    queue.put(ticket("late-high", priority=3, at=2.0))

    assert queue.due_at(BatchPolicy(max_size=8, max_delay_ms=100)) == pytest.approx(1.1)


def test_delay_restarts_from_oldest_live_ticket_after_withdrawal() -> None:
    queue = ModelQueue("m", max_size=10, priority_levels=2)
    first = ticket("first", priority=2, at=1.0)
    queue.put(first)
    queue.put(ticket("second", priority=1, at=3.0))
    queue.withdraw(first)

    assert queue.due_at(BatchPolicy(max_size=8, max_delay_ms=100)) == pytest.approx(3.1)


def test_compaction_after_many_withdrawals_keeps_order_and_depth() -> None:
    queue = ModelQueue("m", max_size=2000, priority_levels=3)
    tickets = [ticket(f"t{n}", priority=1 + n % 3, at=float(n)) for n in range(1010)]
    for t in tickets:
        queue.put(t)
    keep = [t for n, t in enumerate(tickets) if n % 101 == 0]
    for t in tickets:
        if t not in keep:
            queue.withdraw(t)

    assert queue.depth == 10
    assert sum(len(level) for level in queue._levels) < 100  # withdrawn tickets were compacted away
    expected = sorted(keep, key=lambda t: (-t.priority, t.arrived_at))
    assert queue.due_at(BatchPolicy(max_size=64, max_delay_ms=1000)) == pytest.approx(1.0)
    assert take(queue, 20, now=2000.0) == expected  # in dispatch order
    assert queue.depth == 0
    assert queue.due_at(BatchPolicy()) is None
