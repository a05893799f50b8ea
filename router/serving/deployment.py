"""A deployment: one configured model, its queue and its instances (one per device entry)."""

from __future__ import annotations

import enum
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
    """A model's state, derived from its instances' (see `Deployment.state`)."""

    PENDING = "pending"  # no instance loaded yet
    LOADING = "loading"
    READY = "ready"
    DEGRADED = "degraded"  # serving, but an instance failed or is fenced
    DRAINING = "draining"
    UNLOADING = "unloading"
    UNLOADED = "unloaded"
    FAILED = "failed"


@dataclass
class Deployment:
    name: str
    config: ModelConfig
    plugin: PluginInfo
    options: BaseModel
    queue: ModelQueue
    instances: list[ModelInstance] = field(default_factory=list)
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
        """Serving instances decide first; then work in progress; then what is left."""
        states = {i.state for i in self.instances}
        if states & {InstanceState.READY, InstanceState.FENCED}:
            troubled = states & {InstanceState.FENCED, InstanceState.FAILED}
            return ModelState.DEGRADED if troubled else ModelState.READY
        for busy, model_state in ((InstanceState.LOADING, ModelState.LOADING), (InstanceState.WARMING, ModelState.LOADING),
                                  (InstanceState.DRAINING, ModelState.DRAINING),
                                  (InstanceState.UNLOADING, ModelState.UNLOADING)):
            if busy in states:
                return model_state
        if InstanceState.FAILED in states:
            return ModelState.FAILED
        if states == {InstanceState.PENDING}:
            return ModelState.PENDING
        return ModelState.UNLOADED

    @property
    def error(self) -> str | None:
        """Why the model is failed or degraded: its failed instances' errors."""
        errors = sorted({i.error for i in self.instances if i.state is InstanceState.FAILED and i.error})
        return "; ".join(errors) or None

    @property
    def serving(self) -> bool:
        return any(i.serving for i in self.instances)

    @property
    def settled(self) -> bool:
        """No load in progress (readiness waits for this)."""
        return not any(i.state in (InstanceState.PENDING, InstanceState.LOADING, InstanceState.WARMING)
                       for i in self.instances)

    @property
    def front(self) -> ModelPlugin:  # type: ignore[type-arg]
        """The plugin object that preprocesses and postprocesses: a serving instance's, if any."""
        for instance in self.instances:
            if instance.serving:
                return instance.plugin
        return self.instances[0].plugin

    @property
    def budget_bytes(self) -> int | None:
        budget = self.config.memory.budget
        return int(budget) if budget is not None else None
