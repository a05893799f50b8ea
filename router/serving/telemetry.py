"""What the serving core reports as things happen. The HTTP layer's Prometheus metrics implement
it; the core never imports them.

A mirrored copy (shadow item) is nobody's request: its outcomes go to `observe_mirror` alone, never
to `observe_request` (a user's), labelled by `mirror_outcome`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from router.errors import DeadlineExceeded, Overloaded

__all__ = ["MIRROR_OUTCOMES", "Telemetry", "TelemetryFanout", "mirror_outcome", "mirrored"]

#: The outcomes of a mirrored copy: taken into spare capacity, answered, refused or crowded out
#: for lack of spare capacity, failed in its model, or past its deadline.
MIRROR_OUTCOMES = ("served", "shed", "failed", "expired")


@contextmanager
def mirrored(telemetry: Telemetry, model: str) -> Iterator[None]:
    """A mirrored copy's submission: its outcome to `observe_mirror` when the block ends."""
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        error = exc
        raise
    finally:
        telemetry.observe_mirror(model, mirror_outcome(error))


def mirror_outcome(error: BaseException | None) -> str:
    """The outcome label of a mirrored copy's answer: `served` (no error), `expired` (its deadline
    passed), `shed` (no spare capacity, or not serving now), else `failed`."""
    if error is None:
        return "served"
    if isinstance(error, DeadlineExceeded):
        return "expired"
    if isinstance(error, Overloaded):
        return "shed"
    return "failed"


class Telemetry(Protocol):
    """Event sinks: called on the event loop, must not block."""

    def observe_request(self, model: str, outcome: str, seconds: float) -> None: ...
    def observe_queue_wait(self, model: str, seconds: float) -> None: ...
    def observe_batch(self, model: str, size: int, seconds: float) -> None: ...
    def observe_load(self, model: str, device: str, seconds: float, ok: bool) -> None: ...
    def observe_eviction(self, model: str, device: str, kind: str) -> None: ...
    def observe_cold_wait(self, model: str, seconds: float) -> None: ...  # a request waited for a load
    def observe_answer(self, model: str, seconds: float, deadline_s: float) -> None: ...  # a 200, and its time budget
    def observe_mirror(self, model: str, outcome: str) -> None: ...  # a mirrored copy's (MIRROR_OUTCOMES), not a user's


class TelemetryFanout:
    """Every event to every attached sink (none by default). With one sink, as in every server
    process (its Prometheus metrics), the events go to it straight: `add` binds the sink's own
    methods in place of the loops below."""

    def __init__(self) -> None:
        self.sinks: tuple[Telemetry, ...] = ()

    def add(self, sink: Telemetry) -> None:
        self.sinks = (*self.sinks, sink)
        for event in EVENTS:
            if len(self.sinks) == 1:
                setattr(self, event, getattr(sink, event))
            else:
                self.__dict__.pop(event, None)  # the loop over every sink

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

    def observe_mirror(self, model: str, outcome: str) -> None:
        for sink in self.sinks:
            sink.observe_mirror(model, outcome)


#: The events of `Telemetry`, by method name.
EVENTS = tuple(name for name in vars(Telemetry) if name.startswith("observe_"))
