"""The parent's decisions: how many fronts, how long before a restart."""

from __future__ import annotations

from router.config import resolve_workers
from router.host.supervisor import FIRST_RESTART_S, MAX_RESTART_S, restart_delay


def test_auto_is_one_process_on_two_cores_and_a_front_per_core_above() -> None:
    assert [resolve_workers("auto", cores) for cores in (1, 2, 3, 8, 64)] == [1, 1, 3, 8, 16]
    assert resolve_workers(4, 2) == 4


def test_a_child_that_keeps_dying_waits_longer_each_time_up_to_a_bound() -> None:
    delays = [restart_delay(deaths) for deaths in range(1, 10)]
    assert delays[0] == FIRST_RESTART_S and delays == sorted(delays) and delays[-1] == MAX_RESTART_S
