"""When the router hands freed heap memory back (router/http/request.py), with an injected clock."""

from __future__ import annotations

import sys

import pytest

from router.http.request import BUSY_TRIM_INTERVAL_S, BodyMemory, malloc_trim


def test_a_trim_is_due_after_enough_body_bytes_once_the_burst_is_over() -> None:
    now = [0.0]
    memory = BodyMemory(threshold_bytes=100, clock=lambda: now[0])
    memory.received(60)
    assert not memory.due()  # too little to be worth it
    memory.received(60)
    memory.in_flight = 3
    assert not memory.due()  # the burst is still running
    memory.in_flight = 0
    assert memory.due()


def test_a_long_burst_is_trimmed_every_interval() -> None:
    now = [0.0]
    memory = BodyMemory(threshold_bytes=100, clock=lambda: now[0])
    memory.received(500)
    memory.in_flight = 10
    assert not memory.due()
    now[0] = BUSY_TRIM_INTERVAL_S
    assert memory.due()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_malloc_trim_is_available_here() -> None:
    assert malloc_trim() is True
