"""A deployment: one configured model, its queue and its instances (one per device entry)."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

from pydantic import BaseModel

from router.config import ModelConfig
from router.instance import InstanceState, ModelInstance
from router.plugin import MemoryEstimate, ModelPlugin
from router.queue import ModelQueue
from router.registry import PluginInfo

__all__ = ["Deployment", "ModelState", "ServiceTime"]


class ModelState(enum.Enum):
    PENDING = "pending"
    LOADING = "loading"
    READY = "ready"
    DEGRADED = "degraded"  # some instances failed or stalled, at least one serves
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class ServiceTime:
    """Dispatch-to-answer time of a model's requests: a smoothed mean and mean deviation, as TCP
    estimates round trips. `horizon_s` (mean + 4 deviations) is how long before its deadline a
    request must be dispatched to be answered in time."""

    mean_s: float = 0.0
    deviation_s: float = 0.0

    def observe(self, seconds: float) -> None:
        if self.mean_s == 0.0:
            self.mean_s, self.deviation_s = seconds, seconds / 2
            return
        self.deviation_s = 0.75 * self.deviation_s + 0.25 * abs(seconds - self.mean_s)
        self.mean_s = 0.875 * self.mean_s + 0.125 * seconds

    @property
    def horizon_s(self) -> float:
        return self.mean_s + 4 * self.deviation_s


@dataclass
class Deployment:
    name: str
    config: ModelConfig
    plugin: PluginInfo
    options: BaseModel
    queue: ModelQueue
    instances: list[ModelInstance] = field(default_factory=list)
    loaded: bool = False
    error: str | None = None
    estimate: MemoryEstimate | None = None
    max_batch: int = 1
    outcomes: Counter[str] = field(default_factory=Counter)
    batch_time_s: float = 0.0  # moving average of one batch's execution time
    service: ServiceTime = field(default_factory=lambda: ServiceTime())

    def predicted_wait_s(self) -> float:
        """Time until a request queued now would be answered: the batches ahead of it, shared among
        the instances that serve, then its own dispatch-to-answer time. Zero until observed."""
        ready = [i for i in self.instances if i.state is InstanceState.READY]
        batches_ahead = self.queue.occupancy // max(self.max_batch, 1)
        if ready and all(i.busy for i in ready):
            batches_ahead += 1  # the running batches finish first
        return batches_ahead / max(len(ready), 1) * self.batch_time_s + self.service.horizon_s

    def observe_batch_time(self, seconds: float) -> None:
        self.batch_time_s = seconds if self.batch_time_s == 0.0 else 0.8 * self.batch_time_s + 0.2 * seconds

    @property
    def state(self) -> ModelState:
        states = [i.state for i in self.instances]
        if states and all(s is InstanceState.STOPPED for s in states):
            return ModelState.STOPPED
        if self.error is not None or (states and all(s is InstanceState.FAILED for s in states)):
            return ModelState.FAILED
        if not self.loaded:
            return ModelState.LOADING if any(s is not InstanceState.PENDING for s in states) else ModelState.PENDING
        if all(s is InstanceState.READY for s in states):
            return ModelState.READY
        if any(s in (InstanceState.READY, InstanceState.STALLED) for s in states):
            return ModelState.DEGRADED
        return ModelState.FAILED

    @property
    def serving(self) -> bool:
        return self.state in (ModelState.READY, ModelState.DEGRADED)

    @property
    def front(self) -> ModelPlugin:  # type: ignore[type-arg]
        """The plugin object that preprocesses and postprocesses: a loaded instance's, if any."""
        for instance in self.instances:
            if instance.state in (InstanceState.READY, InstanceState.STALLED):
                return instance.plugin
        return self.instances[0].plugin

    @property
    def budget_bytes(self) -> int | None:
        budget = self.config.memory.budget
        return int(budget) if budget is not None else None

    def describe(self) -> dict[str, object]:
        """The model's public status, as GET /models/{name} shows it."""
        batch = self.config.batch
        estimate = self.estimate
        return {
            "name": self.name,
            "state": self.state.value,
            "error": self.error,
            "plugin": {"name": self.plugin.name, "distribution": self.plugin.distribution, "version": self.plugin.version},
            "devices": self.config.instance_devices,
            "instances": [
                {"index": i.index, "device": i.device, "state": i.state.value, "busy": i.busy,
                 "batches": i.batches, "error": i.error}
                for i in self.instances
            ],
            "queue": {
                "depth": self.queue.depth,
                "capacity": self.queue.max_size,
                "timeout_ms": self.config.queue.timeout_ms,
                "priority_levels": self.config.queue.priority_levels,
            },
            "batch": {"max_size": batch.max_size, "max_delay_ms": batch.max_delay_ms, "effective_max_size": self.max_batch},
            "memory": {
                "budget_bytes": self.budget_bytes,
                "weights_bytes": estimate.weights_bytes if estimate else None,
                "per_item_bytes": estimate.per_item_bytes if estimate else None,
                "fixed_bytes": estimate.fixed_bytes if estimate else None,
                "source": estimate.source if estimate else None,
            },
            "execution_timeout_ms": self.config.execution.timeout_ms,
            "weight": self.config.weight,
            "required": self.config.required,
            "requests": dict(self.outcomes),
        }
