"""The open-connection count (router/http/connections.py) as plain state: the longest-idle
connection is the one closed for room, busy ones never are, reports come at most every 10 s."""

from __future__ import annotations

from router.http.connections import REPORT_EVERY_S, OpenConnections


def test_over_the_limit_the_longest_idle_connection_is_closed() -> None:
    connections: OpenConnections[str] = OpenConnections(3)
    assert [connections.opened(name) for name in "abc"] == [None, None, None]
    connections.busy("a")
    connections.idle("a")  # answered: idle again, now the most recently idle
    assert connections.opened("d") == "b"
    assert connections.opened("e") == "c"
    assert connections.closed_for_room == 2


def test_busy_connections_are_never_closed_for_room() -> None:
    connections: OpenConnections[str] = OpenConnections(2)
    for name in "ab":
        connections.opened(name)
        connections.busy(name)
    assert connections.opened("c") is None
    assert connections.over_limit()  # kept, over the limit: its requests are refused
    connections.closed("a")
    assert not connections.over_limit() and connections.count == 2


def test_without_a_limit_nothing_is_closed() -> None:
    connections: OpenConnections[int] = OpenConnections(None)
    assert all(connections.opened(i) is None for i in range(10_000))
    assert not connections.over_limit() and connections.idle_count == 10_000


def test_closing_for_room_is_reported_at_most_every_ten_seconds() -> None:
    connections: OpenConnections[int] = OpenConnections(1)
    connections.opened(0)
    assert connections.report_due(0.0) is None  # nothing closed yet
    connections.opened(1)
    assert connections.report_due(100.0) == 1
    for i in range(2, 12):
        connections.opened(i)
    assert connections.report_due(100.0 + REPORT_EVERY_S / 2) is None
    assert connections.report_due(100.0 + REPORT_EVERY_S) == 10
