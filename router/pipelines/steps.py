"""What one pipeline request did, step by step: items, time, queue waits and batch sizes (and,
for a sampled request, each step as a stage span of its trace); the answer it gives; and the
sinks its figures go to (Prometheus, in the HTTP layer)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.tracing.api import Phases, StageSpan

__all__ = ["PipelineAnswer", "PipelineTelemetry", "RequestSteps", "StepStats"]


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


class RequestSteps:
    """The steps of one request, in the order they were first reached. With `path` (a sampled
    request's path of phases), each step reached is a stage of that path: a span from the step's
    first item in to its last answer, with a path of phases per item it sent to its model
    (under a step that is a pipeline, its own steps' stages)."""

    def __init__(self, path: Phases | None = None) -> None:
        self.steps: dict[str, StepStats] = {}
        self.path = path
        self._stages: dict[str, StageSpan] = {}
        self._sent: dict[str, int] = {}  # items sent to each step's model so far

    def step(self, key: str, kind: str, name: str) -> StepStats:
        if key not in self.steps:
            self.steps[key] = StepStats(key, kind, name)
        return self.steps[key]

    def reached(self, key: str, kind: str, name: str, at: float) -> StageSpan | None:
        """The step's stage, started at `at` the first time it is reached; None when not traced."""
        stats = self.step(key, kind, name)
        if self.path is None:
            return None
        stage = self._stages.get(key)
        if stage is None:
            parent = self._stages.get(key.rpartition("/")[0])  # a step of a pipeline run as a step
            attributes = {"router.step": key, f"router.{stats.kind}": stats.name}
            stage = (parent or self.path).stage(f"step {key}", at, **attributes)
            self._stages[key] = stage
        return stage

    def item_path(self, key: str, model: str, at: float) -> Phases | None:
        """The path of phases of the next item the step sends to its model (its stage's child)."""
        stage = self.reached(key, "model", model, at)
        if stage is None:
            return None
        item = self._sent.get(key, 0)
        self._sent[key] = item + 1
        return stage.phases(item)

    def end_stages(self, at: float, failures: Mapping[str, BaseException]) -> None:
        """End every stage: at its last answer, or at `at` with the error of the step that failed in it."""
        for key, stage in self._stages.items():
            stats = self.steps[key]
            error = next((e for k, e in failures.items() if k == key or k.startswith(f"{key}/")), None)
            if stats.kind != "pipeline":  # a pipeline's items are its own steps'
                stage.describe(**{"router.items": stats.items})
            stage.end(at if error is not None or stats.last_at is None else stats.last_at, error)

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
