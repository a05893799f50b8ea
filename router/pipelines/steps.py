"""What one pipeline request did, step by step: items, time, queue waits and batch sizes; the
answer it gives; and the sinks its figures go to (Prometheus, in the HTTP layer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["PipelineAnswer", "PipelineTelemetry", "StepStats", "Trace"]


class PipelineTelemetry(Protocol):
    """Event sinks for pipelines: called on the event loop, must not block."""

    def observe_pipeline(self, pipeline: str, outcome: str, seconds: float) -> None: ...
    def observe_step(self, pipeline: str, step: str, items: int, seconds: float, batch_sizes: list[int]) -> None: ...


@dataclass
class StepStats:
    """One step of one request: `key` names it by position (`2:resnet18`, `0:inner/2:resnet18`)."""

    key: str
    kind: str
    name: str
    items: int = 0
    first_at: float | None = None
    last_at: float | None = None
    queue_s: float = 0.0  # the longest queue wait of its items
    execution_s: float = 0.0  # the longest batch its items ran in
    batch_sizes: list[int] = field(default_factory=list)  # the batch each item ran in

    def span(self, started: float, ended: float) -> None:
        self.first_at = started if self.first_at is None else min(self.first_at, started)
        self.last_at = ended if self.last_at is None else max(self.last_at, ended)

    @property
    def seconds(self) -> float:
        return 0.0 if self.first_at is None or self.last_at is None else self.last_at - self.first_at

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.key, self.kind: self.name, "items": self.items,
                               "ms": round(self.seconds * 1000, 3)}
        if self.kind != "transform":
            out["queue_ms"] = round(self.queue_s * 1000, 3)
            out["execution_ms"] = round(self.execution_s * 1000, 3)
            out["batch_size"] = round(sum(self.batch_sizes) / len(self.batch_sizes), 3) if self.batch_sizes else 0
        return out


class Trace:
    """The steps of one request, in the order they were first reached."""

    def __init__(self) -> None:
        self.steps: dict[str, StepStats] = {}

    def step(self, key: str, kind: str, name: str) -> StepStats:
        if key not in self.steps:
            self.steps[key] = StepStats(key, kind, name)
        return self.steps[key]

    def model_step(self, key: str, name: str, started: float, ended: float, queue_s: float, execution_s: float,
                   batch_size: int) -> None:
        stats = self.step(key, "model", name)
        stats.items += 1
        stats.span(started, ended)
        stats.queue_s = max(stats.queue_s, queue_s)
        stats.execution_s = max(stats.execution_s, execution_s)
        stats.batch_sizes.append(batch_size)

    def report(self, telemetry: list[PipelineTelemetry], pipeline: str) -> None:
        for stats in self.steps.values():
            for sink in telemetry:
                sink.observe_step(pipeline, stats.key, stats.items, stats.seconds, stats.batch_sizes)


@dataclass(frozen=True)
class PipelineAnswer:
    """A pipeline's answer: the first step's answer with every item's downstream answers attached."""

    request_id: str
    pipeline: str
    output: Any
    seconds: float
    steps: list[StepStats]

    @property
    def items(self) -> int:
        """Items that went through a model, all steps together."""
        return sum(s.items for s in self.steps if s.kind != "transform")

    def timing(self) -> dict[str, Any]:
        return {"total_ms": round(self.seconds * 1000, 3), "steps": [s.as_dict() for s in self.steps]}
