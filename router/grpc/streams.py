"""How many long gRPC streams without a key one server holds open, per connection and in total,
below grpcio's concurrent-RPC limit: health `Watch` streams, and `ModelStreamInfer` streams on a
server without keys.

grpcio's `maximum_concurrent_rpcs` counts every call from its headers on, and a call over it is
RESOURCE_EXHAUSTED, liveness and health checks included: 1,024 `grpc.health.v1.Health/Watch`
streams, which need no key unless health is protected and stay open as long as the client likes,
were enough to refuse every other call, a keyed `ModelInfer` and the `health.Check` an
orchestrator probes with among them; on a server without keys, so were `ModelStreamInfer` streams.
So streams without an inference key are bounded per connection (grpc's peer, an address and port)
and for the whole server, a quarter of that limit at most (`share`; calls waiting for their
message take another quarter at most, `router.grpc.arrival`): a stream over a bound is refused
with RESOURCE_EXHAUSTED, and the rest of the concurrent-RPC limit stays for the calls that end
(probes, keyed calls). It is the gRPC side of the HTTP server's connection bound
(`router.http.connections`). Plain state, no I/O: `router.grpc.calls.hold_stream` asks it.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["OpenStreams", "Reports", "share"]

#: How often, at most, refusals are reported (a flood would log each one).
REPORT_EVERY_S = 10.0


def share(setting: int, max_concurrent_rpcs: int) -> int:
    """A bound on calls without a key of one kind: the setting, but never more than a quarter of the
    concurrent-RPC limit, so that the two kinds together leave at least half of it to other calls
    (and never less than one)."""
    return max(1, min(setting, max_concurrent_rpcs // 4))


class Reports:
    """How many times something happened since it was last reported: a report is due the first
    time, then at most once every REPORT_EVERY_S."""

    def __init__(self) -> None:
        self.count = 0
        self._reported = 0
        self._reported_at: float | None = None

    def due(self, now: float) -> int | None:
        """How many since the last report, when one is due; None otherwise."""
        fresh = self.count - self._reported
        if not fresh or (self._reported_at is not None and now - self._reported_at < REPORT_EVERY_S):
            return None
        self._reported, self._reported_at = self.count, now
        return fresh


class OpenStreams:
    """The open long streams without a key of one server, counted per connection and in total."""

    def __init__(self, per_connection: int, total: int) -> None:
        self.per_connection = per_connection
        self.total = total
        self._open: Counter[str] = Counter()
        self.count = 0
        self.refused = Reports()

    def open(self, connection: str) -> str | None:
        """Count a new stream on `connection`; the reason it is refused, and not counted, when it is over a bound."""
        if self._open[connection] >= self.per_connection:
            self.refused.count += 1
            return (f"too many open streams without an inference key on this connection (at most "
                    f"{self.per_connection}: health Watch, ModelStreamInfer); close one, or send the key")
        if self.count >= self.total:
            self.refused.count += 1
            return (f"too many open streams without an inference key on this server (at most {self.total}: "
                    "health Watch, ModelStreamInfer); retry later, or send the key")
        self._open[connection] += 1
        self.count += 1
        return None

    def closed(self, connection: str) -> None:
        """A stream `open` counted has ended."""
        self._open[connection] -= 1
        if self._open[connection] <= 0:
            del self._open[connection]
        self.count -= 1
