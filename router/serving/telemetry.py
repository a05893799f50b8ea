"""What the serving core reports as things happen. The HTTP layer's Prometheus metrics implement
it; the core never imports them."""

from __future__ import annotations

from typing import Protocol

__all__ = ["Telemetry", "TelemetryFanout"]


class Telemetry(Protocol):
    """Event sinks: called on the event loop, must not block."""

    def observe_request(self, model: str, outcome: str, seconds: float) -> None: ...
    def observe_queue_wait(self, model: str, seconds: float) -> None: ...
    def observe_batch(self, model: str, size: int, seconds: float) -> None: ...
    def observe_load(self, model: str, device: str, seconds: float, ok: bool) -> None: ...
    def observe_eviction(self, model: str, device: str, kind: str) -> None: ...
    def observe_cold_wait(self, model: str, seconds: float) -> None: ...  # a request waited for a load
    def observe_answer(self, model: str, seconds: float, deadline_s: float) -> None: ...  # a 200, and its time budget


class TelemetryFanout:
    """Every event to every attached sink (none by default)."""

    def __init__(self) -> None:
        self.sinks: list[Telemetry] = []

    def observe_request(self, model: str, outcome: str, seconds: float) -> None:
        for sink in self.sinks:
            sink.observe_request(model, outcome, seconds)

    def observe_queue_wait(self, model: str, seconds: float) -> None:
        for sink in self.sinks:
            sink.observe_queue_wait(model, seconds)

    def observe_batch(self, model: str, size: int, seconds: float) -> None:
        for sink in self.sinks:
            sink.observe_batch(model, size, seconds)

    def observe_load(self, model: str, device: str, seconds: float, ok: bool) -> None:
        for sink in self.sinks:
            sink.observe_load(model, device, seconds, ok)

    def observe_eviction(self, model: str, device: str, kind: str) -> None:
        for sink in self.sinks:
            sink.observe_eviction(model, device, kind)

    def observe_cold_wait(self, model: str, seconds: float) -> None:
        for sink in self.sinks:
            sink.observe_cold_wait(model, seconds)
    def observe_answer(self, model: str, seconds: float, deadline_s: float) -> None:
        for sink in self.sinks:
            sink.observe_answer(model, seconds, deadline_s)
