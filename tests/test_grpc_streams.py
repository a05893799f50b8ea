"""The bound on open gRPC streams without a key (`router.grpc.streams`), as plain state: per
connection, in total, counted out when they end, and a quarter of the concurrent-RPC limit at most."""

from __future__ import annotations

import pytest

from router.grpc.streams import REPORT_EVERY_S, OpenStreams, Reports, share


def test_streams_are_bounded_per_connection_and_in_total() -> None:
    streams = OpenStreams(per_connection=2, total=3)
    assert streams.open("a") is None and streams.open("a") is None
    on_a = streams.open("a")
    assert on_a is not None and "on this connection (at most 2" in on_a
    assert streams.open("b") is None
    on_c = streams.open("c")
    assert on_c is not None and "on this server (at most 3" in on_c
    assert streams.count == 3 and streams.refused.count == 2  # refused streams are not counted


def test_ended_streams_make_room_again() -> None:
    streams = OpenStreams(per_connection=1, total=2)
    assert streams.open("a") is None and streams.open("b") is None
    assert streams.open("c") is not None
    streams.closed("a")
    assert streams.open("c") is None and streams.open("a") is not None  # the total is full again
    streams.closed("b")
    assert streams.open("a") is None and streams.count == 2


@pytest.mark.parametrize(("setting", "limit", "bound"), [(256, 1024, 256), (256, 32, 8), (4, 32, 4), (256, 2, 1)])
def test_a_kind_of_stream_takes_a_quarter_of_the_limit_at_most(setting: int, limit: int, bound: int) -> None:
    assert share(setting, limit) == bound


def test_refusals_are_reported_at_most_once_a_period() -> None:
    reports = Reports()
    assert reports.due(0.0) is None  # nothing to report
    reports.count += 3
    assert reports.due(0.0) == 3
    reports.count += 2
    assert reports.due(REPORT_EVERY_S / 2) is None
    assert reports.due(REPORT_EVERY_S) == 2
