"""A deployment: one configured model, its queue and its instances (one per device entry)."""

from __future__ import annotations

import enum
import time
from collections import Counter
from dataclasses import dataclass, field

from pydantic import BaseModel

from router.config import BatchPolicy, ModelConfig
from router.scheduling.queue import ModelQueue
from router.scheduling.scheduler import Runner
from router.scheduling.service_time import (
    MARGIN_DEVIATIONS,
    AdmissionDecision,
    Lag,
    Prediction,
    ProbeGate,
    decide_admission,
    predict_answer,
)
from router.sdk.plugin import ModelPlugin
from router.serving.instance import InstanceState, ModelInstance
from router.serving.registry import PluginInfo

__all__ = ["Deployment", "ModelState"]


class ModelState(enum.Enum):
    PENDING = "pending"
    LOADING = "loading"
    READY = "ready"
    DEGRADED = "degraded"  # some instances failed or stalled, at least one serves
    FAILED = "failed"
    STOPPED = "stopped"


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
    outcomes: Counter[str] = field(default_factory=Counter)
    lag: Lag = field(default_factory=Lag)  # batch end to answer: postprocessing and event-loop lag
    gate: ProbeGate = field(default_factory=ProbeGate)

    def ready_instances(self) -> list[ModelInstance]:
        return [i for i in self.instances if i.state is InstanceState.READY]

    def predict(self, now: float, *, margin: float = MARGIN_DEVIATIONS) -> Prediction | None:
        """When a request queued now would be answered (None: nothing timed to predict from)."""
        return predict_answer(
            now, [i.load_view() for i in self.ready_instances()], queued_ahead=self.queue.occupancy,
            max_batch=self.config.batch.max_size, max_delay_s=self.config.batch.max_delay_s,
            lag_s=self.lag.at(now), margin=margin,
        )

    @property
    def idle(self) -> bool:
        """Nothing queued or being prepared, and an instance free to run it."""
        return self.queue.occupancy == 0 and any(not i.busy for i in self.ready_instances())

    def admission(self, budget_s: float, now: float, *, take_probe: bool = True) -> AdmissionDecision:
        """Whether a request with `budget_s` until its deadline should be queued now."""
        samples = [i.times.last_sample_at for i in self.instances if i.times.last_sample_at is not None]
        return decide_admission(self.predict(now), budget_s, idle=self.idle, gate=self.gate, now=now,
                                last_sample_at=max(samples, default=None), take_probe=take_probe)

    def dispatch_horizon_s(self, instance: Runner, size: int, now: float) -> float:
        """Time from dispatch to answer of a batch of `size` on `instance`, with admission's margin:
        a request whose deadline falls before it is answered 504 at dispatch instead of run."""
        return instance.times.seconds(size, now, MARGIN_DEVIATIONS) + self.lag.at(now)

    @property
    def batch_policy(self) -> BatchPolicy:
        return self.config.batch

    @property
    def weight(self) -> float:
        return self.config.weight

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
        sized = next((i for i in self.instances if i.estimate is not None), None)  # the first loaded instance's
        estimate = sized.estimate if sized else None
        return {
            "name": self.name,
            "state": self.state.value,
            "error": self.error,
            "plugin": {"name": self.plugin.name, "distribution": self.plugin.distribution, "version": self.plugin.version},
            "devices": self.config.instance_devices,
            "instances": [
                {"index": i.index, "device": i.device, "state": i.state.value, "busy": i.busy,
                 "batches": i.batches, "error": i.error, "max_batch": i.max_batch,
                 "memory": None if i.estimate is None else {
                     "weights_bytes": i.estimate.weights_bytes, "per_item_bytes": i.estimate.per_item_bytes,
                     "fixed_bytes": i.estimate.fixed_bytes, "source": i.estimate.source}}
                for i in self.instances
            ],
            "queue": {
                "depth": self.queue.depth,
                "capacity": self.queue.max_size,
                "timeout_ms": self.config.queue.timeout_ms,
                "priority_levels": self.config.queue.priority_levels,
            },
            "batch": {"max_size": batch.max_size, "max_delay_ms": batch.max_delay_ms, "effective_max_size": sized.max_batch if sized else 1},
            "memory": {
                "budget_bytes": self.budget_bytes,
                "weights_bytes": estimate.weights_bytes if estimate else None,
                "per_item_bytes": estimate.per_item_bytes if estimate else None,
                "fixed_bytes": estimate.fixed_bytes if estimate else None,
                "source": estimate.source if estimate else None,
            },
            "timing": self._timing(),
            "execution_timeout_ms": self.config.execution.timeout_ms,
            "weight": self.config.weight,
            "required": self.config.required,
            "requests": dict(self.outcomes),
        }

    def _timing(self) -> dict[str, object]:
        """The service-time figures admission predicts from, per instance."""
        now = time.monotonic()
        instances = []
        for i in self.instances:
            factor, spread = i.times.factor_at(now)
            instances.append({
                "index": i.index, "source": i.times.source, "samples": i.times.samples,
                "batch_1_ms": round(i.times.seconds(1, now) * 1000, 3),
                "batch_max_ms": round(i.times.seconds(i.max_batch, now) * 1000, 3),
                "load_factor": round(factor, 3), "spread": round(spread, 3),
            })
        return {"instances": instances, "answer_lag_ms": round(self.lag.at(now) * 1000, 3), "probes": self.gate.probes}
