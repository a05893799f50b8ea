"""A deployment: one configured model, its queue and its instances (one per device entry)."""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from pydantic import BaseModel

from router.config import BatchPolicy, ModelConfig
from router.errors import ModelNotFound, brief
from router.scheduling.queue import ModelQueue
from router.scheduling.residency import Occupant
from router.scheduling.scheduler import Runner
from router.scheduling.service_time import (
    MARGIN_DEVIATIONS,
    GateDecision,
    HalfOpenGate,
    InstanceLoad,
    Lag,
    Prediction,
    deadline_gate,
    predict_answer,
)
from router.serving.instance import InstanceState, ModelInstance
from router.serving.registry import PluginInfo

__all__ = ["Deployment", "ModelState", "Pulse", "Residency", "find_deployment"]

#: Expected load time of a model never loaded yet, for residency's urgency.
DEFAULT_LOAD_S = 1.0
#: After a failed load, an on-demand model is not tried again for this long (doubling, up to 60 s).
LOAD_RETRY_S = 2.0


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
class Residency:
    """A model's residency bookkeeping: who holds it, who waits for it, what operators asked,
    and what its loads and unloads cost. Written by the fleet and the request path."""

    holders: int = 0  # requests in flight, from the deadline gate to the answer: a model with holders is in use
    last_used: float = 0.0
    waiting: list[float] = field(default_factory=list)  # deadlines of requests waiting for a load
    held: bool = False  # an operator's load: kept resident until an operator unloads it
    held_down: bool = False  # an operator's unload: not loaded again until an operator loads it
    never_fits: str | None = None
    load_error: str | None = None
    lost: str | None = None  # why an instance's process died, until it serves again (it is restarted)
    restarts: int = 0  # instances restarted after their process died
    retry_at: float = 0.0  # no new load of a failing on-demand model before this
    retry_s: float = LOAD_RETRY_S
    cold_start_s: float | None = None  # the last successful load's duration
    load_started_at: float | None = None
    loads: int = 0
    load_failures: int = 0
    last_load_at: float | None = None  # wall-clock time (epoch seconds)
    last_unload_returned_bytes: int | None = None
    evictions: Counter[str] = field(default_factory=Counter)  # by kind
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def pulse(self) -> None:
        """Wake everyone waiting for a change (a load finished or failed, an unload ended)."""
        self.changed.set()
        self.changed = asyncio.Event()

    def hold(self, now: float) -> None:
        self.holders += 1
        self.last_used = now

    def release(self, now: float) -> None:
        self.holders -= 1
        self.last_used = now


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

    def occupant(self, runner: Runner, now: float) -> Occupant:
        """An instance of this model as its device's residency planner sees it."""
        instance = next(i for i in self.instances if i.key == runner.key)
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

    def predict(
        self, now: float, *, margin: float = MARGIN_DEVIATIONS, device_free_at: Mapping[str, float] | None = None,
    ) -> Prediction | None:
        """When a request queued now would be answered (None: nothing timed to predict from). A
        model that is not loaded first waits for its load, timed by its last cold start. An idle
        instance on a device whose batch slots are all taken (by other models) starts when the
        device frees one (`device_free_at`)."""
        ready = self.ready_instances()
        load_s = 0.0
        if not ready:
            res = self.residency
            ready = [i for i in self.instances if i.times.seeded]
            if not ready or res.cold_start_s is None or not self.waits_for_load:
                return None
            started = res.load_started_at if res.load_started_at is not None else now
            load_s = max(0.0, started + res.cold_start_s - now)
        free = device_free_at or {}
        loads = [InstanceLoad(i.times, None, i.max_batch) if load_s else i.load_view() for i in ready]
        loads = [replace(load, busy_until=free[i.device]) if load.busy_until is None and free.get(i.device, now) > now
                 else load for load, i in zip(loads, ready, strict=True)]
        prediction = predict_answer(
            now + load_s, loads, queued_ahead=self.queue.occupancy,
            max_batch=self.config.batch.max_size, max_delay_s=self.config.batch.max_delay_s,
            lag_s=self.lag.at(now), margin=margin,
        )
        if prediction is None or not load_s:
            return prediction
        return replace(prediction, answer_in_s=prediction.answer_in_s + load_s, loading_s=load_s)

    @property
    def waits_for_load(self) -> bool:
        """Requests may wait for this model to load: it is on demand, an operator is loading it,
        or it is a new version of a changed model on its way in."""
        return self.on_demand or self.residency.held or (self.generation > 1 and self.state is not ModelState.FAILED)

    def deadline_gate(
        self, budget_s: float, now: float, *, take_turn: bool = True, device_free_at: Mapping[str, float] | None = None,
        strict: bool = False,
    ) -> GateDecision:
        """Whether a request with `budget_s` until its deadline should be queued now."""
        samples = [i.times.last_sample_at for i in self.instances if i.times.last_sample_at is not None]
        free = device_free_at or {}
        idle = self.queue.occupancy == 0 and any(not i.busy and free.get(i.device, now) <= now
                                                 for i in self.ready_instances())
        return deadline_gate(self.predict(now, device_free_at=device_free_at), budget_s, idle=idle,
                                gate=self.gate, now=now, last_sample_at=max(samples, default=None),
                                take_turn=take_turn, strict=strict)

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
