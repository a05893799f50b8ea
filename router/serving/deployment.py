"""A deployment: one configured model, its queue and its instances (one per device entry)."""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import BaseModel

from router.config import BatchPolicy, ModelConfig
from router.errors import ModelNotFound, brief
from router.scheduling.queue import ModelQueue
from router.scheduling.residency import Occupant
from router.scheduling.scheduler import Runner
from router.scheduling.service_time import (
    MARGIN_DEVIATIONS,
    Forecast,
    HalfOpenGate,
    InstanceLoad,
    Lag,
    Prediction,
)
from router.serving.instance import InstanceState, ModelInstance
from router.serving.model_residency import Residency
from router.serving.registry import PluginInfo
from router.serving.rules import ModelFigures, Refusal

__all__ = ["Deployment", "ModelState", "Pulse", "find_deployment"]

#: Expected load time of a model never loaded yet, for residency's urgency.
DEFAULT_LOAD_S = 1.0
#: A model's forecast is computed again after this long even if nothing it depends on changed
#: (its estimates decay with time; its lag moves with every answer).
FORECAST_KEEP_S = 0.001


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


class Pulse:
    """Wakes everyone waiting at the moment it is pulsed (a one-shot event, renewed each time)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def pulse(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    def next(self) -> asyncio.Event:
        """The event the next pulse sets: taken before looking, so no pulse falls in between."""
        return self._event


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
    gate: HalfOpenGate = field(default_factory=HalfOpenGate)
    residency: Residency = field(default_factory=Residency)
    generation: int = 1  # a changed model is a new deployment of the same name, one generation on
    _forecast: tuple[Any, float, Forecast | None] | None = field(default=None, repr=False, compare=False)
    room: Pulse = field(default_factory=Pulse)  # its queue freed room: requests waiting for it look again

    def __post_init__(self) -> None:
        self.queue.on_room = self.room.pulse

    @property
    def on_demand(self) -> bool:
        return self.config.residency == "on_demand"

    @property
    def loading(self) -> bool:
        return any(i.state in (InstanceState.LOADING, InstanceState.WARMING) for i in self.instances)

    def wanted(self, now: float) -> bool:
        """Absent instances should be loaded: requests wait for them, or an operator asked."""
        res = self.residency
        if res.held_down or res.never_fits is not None or now < res.retry_at:
            return False
        return res.held or res.lost is not None or (self.on_demand and (res.holders > 0 or bool(res.waiting)))

    def _instance(self, runner: Runner) -> ModelInstance:
        """This model's instance that the scheduler knows as `runner`."""
        return next(i for i in self.instances if i.key == runner.key)

    def steady(self, runner: Runner) -> bool:
        """The instance serves, and its device's residency plan has nothing to decide about it: it
        is not unloaded when idle (only an idle unload or a wanted load puts anything in a plan)."""
        return self._instance(runner).serving and not (self.on_demand and self.config.idle_unload_s is not None)

    def occupant(self, runner: Runner, now: float) -> Occupant:
        """An instance of this model as its device's residency planner sees it."""
        instance = self._instance(runner)
        res = self.residency
        state = instance.state
        if state in (InstanceState.LOADING, InstanceState.WARMING):
            where = "loading"
        elif state in (InstanceState.READY, InstanceState.FENCED):
            where = "resident"
        elif state in (InstanceState.DRAINING, InstanceState.UNLOADING):
            where = "leaving"
        else:
            where = "absent"
        estimate = instance.estimate or instance.last_estimate
        declared = self.config.memory.weights
        weights = estimate.weights_bytes if estimate else (int(declared) if declared is not None else 0)
        return Occupant(
            key=instance.key,
            model=self.name,
            state=where,  # type: ignore[arg-type]
            weights_bytes=weights,
            batch_bytes=estimate.batch_bytes(1) if estimate else 0,
            on_demand=self.on_demand and not res.held,
            pinned=res.held or not self.on_demand,
            busy=instance.busy,
            work=res.holders,
            last_used=res.last_used,
            wanted=self.wanted(now),
            slack_s=min(res.waiting) - now if res.waiting else None,
            load_s=res.cold_start_s if res.cold_start_s is not None else DEFAULT_LOAD_S,
            idle_unload_s=self.config.idle_unload_s,
        )

    def ready_instances(self) -> list[ModelInstance]:
        return [i for i in self.instances if i.state is InstanceState.READY]

    def forecast(
        self, now: float, *, margin: float = MARGIN_DEVIATIONS, device_free_at: Mapping[str, float] | None = None,
    ) -> Forecast | None:
        """When a request at a given queue position would be answered (None: nothing timed to
        predict from). A model that is not loaded first waits for its load, timed by its last cold
        start. An idle instance on a device whose batch slots are all taken (by other models)
        starts when the device frees one (`device_free_at`). Kept for up to FORECAST_KEEP_S while
        the instances' states, running batches and timings stay as they were."""
        free = device_free_at if device_free_at is not None else {}
        key = (margin, self.residency.load_started_at, *(i.changes for i in self.instances))
        cached = self._forecast
        if cached is not None and cached[0] == key and 0.0 <= now - cached[1] < FORECAST_KEEP_S:
            return cached[2]
        forecast = self._forecast_now(now, margin, free)
        self._forecast = (key, now, forecast)
        return forecast

    def _forecast_now(self, now: float, margin: float, free: Mapping[str, float]) -> Forecast | None:
        ready = self.ready_instances()
        load_s = 0.0
        if not ready:
            res = self.residency
            ready = [i for i in self.instances if i.times.seeded]
            if not ready or res.cold_start_s is None or not self.waits_for_load:
                return None
            started = res.load_started_at if res.load_started_at is not None else now
            load_s = max(0.0, started + res.cold_start_s - now)
        loads = [InstanceLoad(i.times, None, i.max_batch) if load_s else i.load_view() for i in ready]
        loads = [replace(load, busy_until=free[i.device]) if load.busy_until is None and free.get(i.device, now) > now
                 else load for load, i in zip(loads, ready, strict=True)]
        return Forecast.of(now, loads, max_batch=self.config.batch.max_size, max_delay_s=self.config.batch.max_delay_s,
                           lag_s=self.lag.at(now), margin=margin, loading_s=load_s)

    def predict(
        self, now: float, *, margin: float = MARGIN_DEVIATIONS, device_free_at: Mapping[str, float] | None = None,
    ) -> Prediction | None:
        """When a request queued now would be answered (see `forecast`)."""
        forecast = self.forecast(now, margin=margin, device_free_at=device_free_at)
        return None if forecast is None else forecast.predict(now, self.queue.occupancy)

    @property
    def waits_for_load(self) -> bool:
        """Requests may wait for this model to load: it is on demand, an operator is loading it,
        or it is a new version of a changed model on its way in."""
        return self.on_demand or self.residency.held or (self.generation > 1 and self.state is not ModelState.FAILED)

    def refusal(self, now: float) -> Refusal | None:
        """Why the model takes no request now (503), or None. An on-demand model that is not
        loaded is accepted (the request waits for its load) unless it cannot load."""
        if self.serving:
            return None
        if self.waits_for_load:
            return self.residency.refusal(self.name, self.loading, now)
        if self.residency.held_down and (refusal := self.residency.refusal(self.name, self.loading, now)):
            return refusal
        if self.residency.lost is not None:
            return Refusal("InstanceLost", f"model {self.name!r} is restarting: {self.residency.lost}",
                           self.residency.load_left_s(now))
        reason = f": {self.error}" if self.error else ""
        return Refusal("ModelUnavailable", f"model {self.name!r} is {self.state.value}{reason}", 5.0)

    def figures(
        self, now: float, *, refusal: Refusal | None = None, predict: bool = True,
        device_free_at: Mapping[str, float] | None = None,
    ) -> ModelFigures:
        """The model as the request rules see it now (`router.serving.rules`). `refusal`: the
        server's own (shutting down), which comes first; `predict`: compute the deadline gate's
        prediction (it costs more than the rest)."""
        config, queue = self.config.queue, self.queue
        free = device_free_at if device_free_at is not None else {}
        forecast = idle = None
        last_sample = None
        if predict:
            forecast = self.forecast(now, device_free_at=device_free_at)
            idle = queue.occupancy == 0 and any(not i.busy and free.get(i.device, now) <= now
                                                for i in self.ready_instances())
            last_sample = max((i.times.last_sample_at for i in self.instances if i.times.last_sample_at is not None),
                              default=None)
        return ModelFigures(
            name=self.name, priority_levels=config.priority_levels, default_priority=config.default_priority,
            timeout_ms=config.timeout_ms, capacity=queue.max_size, occupancy=queue.occupancy,
            retry_after_s=queue.retry_after_s(now), refusal=refusal or self.refusal(now), forecast=forecast,
            idle=bool(idle), half_open_at=self.gate.last_at, half_open_interval_s=self.gate.interval_s,
            last_sample_at=last_sample, at=now, shadow=queue.shadow_occupancy,
        )

    def dispatch_horizon_s(self, instance: Runner, size: int, now: float) -> float:
        """Time from dispatch to answer of a batch of `size` on `instance`, with the deadline gate's margin:
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
        if states == {InstanceState.PENDING} and not self.on_demand:
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
        """No start-up load in progress (readiness waits for this; on-demand models never hold it up)."""
        if self.on_demand:
            return True
        return not any(i.state in (InstanceState.PENDING, InstanceState.LOADING, InstanceState.WARMING)
                       for i in self.instances)

    def front_instance(self) -> ModelInstance:
        """The instance whose plugin preprocesses an input: a serving one, if any. (Its answer is
        postprocessed by the instance that ran its batch.)"""
        return next((i for i in self.instances if i.serving), self.instances[0])

    @property
    def budget_bytes(self) -> int | None:
        budget = self.config.memory.budget
        return int(budget) if budget is not None else None


def find_deployment(deployments: Mapping[str, Deployment], name: str) -> Deployment:
    """The model called `name`; ModelNotFound (404) listing the models there are."""
    try:
        return deployments[name]
    except KeyError:
        known = ", ".join(sorted(deployments)) or "none"
        raise ModelNotFound(f"no model named {brief(name, 80)}; models: {known}") from None
