"""Which open connection a server closes to make room for a new one: the longest-idle one.

uvicorn's `limit_concurrency` counts every open connection, and once the count is reached it
answers 503 to every request, liveness included: about 1,100 connections that never send a byte
were enough to make an orchestrator restart the pod. nginx handles the same pressure another way:
a connection waiting for a request (new, or keep-alive between requests) is marked reusable, and
when a worker runs out of `worker_connections` it closes reusable ones, least recently used first,
and serves the new connection ("worker_connections are not enough, reusing connections",
`ngx_drain_connections` in src/core/ngx_connection.c). This does the same, for one server:

- every open connection is counted; one that waits for a request is idle, in the order it became so;
- a connection opened over `limit` closes the longest-idle other connection;
- when none is idle (every connection is in the middle of a request), the new connection is kept,
  but over the limit: the connection answers its requests 503 and closes (liveness excepted).

Connections that send nothing are therefore never what refuses served requests; idle ones are also
closed by the header timeout (never sent a request) and the keep-alive timeout (between requests).
Plain state, no I/O: the connection calls it, and closes the connection it names.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["OpenConnections"]

C = TypeVar("C", bound=Hashable)
#: How often, at most, closing idle connections for room is reported (a flood would log each one).
REPORT_EVERY_S = 10.0


class OpenConnections(Generic[C]):
    """The open connections of one server; which ones are idle, longest-idle first."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.count = 0
        self._idle: OrderedDict[C, None] = OrderedDict()
        self.closed_for_room = 0  # idle connections closed to make room, all told
        self._reported = 0
        self._reported_at: float | None = None

    def opened(self, connection: C) -> C | None:
        """Count a new connection (idle until it begins a request). Over the limit: the idle
        connection to close for it, if there is one."""
        self.count += 1
        victim = None
        if self.limit is not None and self.count > self.limit and self._idle:
            victim, _ = self._idle.popitem(last=False)
            self.closed_for_room += 1
        self._idle[connection] = None
        return victim

    def over_limit(self) -> bool:
        return self.limit is not None and self.count > self.limit

    def busy(self, connection: C) -> None:
        """The connection began a request."""
        self._idle.pop(connection, None)

    def idle(self, connection: C) -> None:
        """The connection answered everything it was sent and waits for its next request."""
        self._idle.pop(connection, None)
        self._idle[connection] = None

    def closed(self, connection: C) -> None:
        self._idle.pop(connection, None)
        self.count -= 1

    @property
    def idle_count(self) -> int:
        return len(self._idle)

    def report_due(self, now: float) -> int | None:
        """How many idle connections were closed for room since the last report, when a report
        is due (the first, then at most one every REPORT_EVERY_S); None otherwise."""
        fresh = self.closed_for_room - self._reported
        if not fresh or (self._reported_at is not None and now - self._reported_at < REPORT_EVERY_S):
            return None
        self._reported, self._reported_at = self.closed_for_room, now
        return fresh
