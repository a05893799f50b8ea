"""Frozen views of the serving core: what the HTTP layer, metrics and admin routes read.

Built on the event loop from the owners' state at one moment (`Runtime.models()`,
`Runtime.devices()`), they never change afterwards and hold no reference back into the core,
so the core can move into another process without its readers noticing. `as_dict()` is the
JSON that `GET /models` shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from router.scheduling.scheduler import DeviceScheduler
from router.sdk.plugin import MemoryEstimate
from router.serving.deployment import Deployment
from router.serving.instance import ModelInstance

__all__ = [
    "DeviceInfo", "InstanceInfo", "MemoryFigures", "ModelInfo", "ResidencyInfo", "TimingInfo", "device_info", "model_info",
]


@dataclass(frozen=True)
class MemoryFigures:
    weights_bytes: int
    per_item_bytes: int
    fixed_bytes: int
    source: str

    @classmethod
    def of(cls, estimate: MemoryEstimate | None) -> MemoryFigures | None:
        if estimate is None:
            return None
        return cls(estimate.weights_bytes, estimate.per_item_bytes, estimate.fixed_bytes, estimate.source)


@dataclass(frozen=True)
class TimingInfo:
    """The service-time figures the deadline gate predicts from, for one instance."""

    index: int
    source: str
    samples: int
    batch_1_ms: float
    batch_max_ms: float
    load_factor: float
    spread: float


@dataclass(frozen=True)
class InstanceInfo:
    index: int
    device: str
    state: str
    busy: bool
    batches: int
    error: str | None
    max_batch: int
    memory: MemoryFigures | None


@dataclass(frozen=True)
class ResidencyInfo:
    """Where a model stands in the dynamic fleet."""

    mode: str  # always | on_demand
    resident: bool
    held: bool  # loaded by an operator: kept until unloaded
    held_down: bool  # unloaded by an operator: kept out until loaded
    in_use: int  # requests in flight
    waiting_for_load: int
    last_used_s_ago: float | None
    loads: int
    load_failures: int
    last_load_at: float | None  # epoch seconds
    last_load_s: float | None  # the last cold start
    last_unload_returned_bytes: int | None
    evictions: Mapping[str, int]
    never_fits: str | None
    load_error: str | None
    generation: int
    restarts: int = 0  # instances loaded again after their process died
    lost: str | None = None  # why, while the restart is under way


@dataclass(frozen=True)
class ModelInfo:
    """One model at one moment."""

    name: str
    state: str
    serving: bool
    error: str | None
    plugin: Mapping[str, str | None]
    accepts: tuple[str, ...]
    devices: tuple[str, ...]
    instances: tuple[InstanceInfo, ...]
    queue_depth: int
    queue_capacity: int
    queue_timeout_ms: int
    priority_levels: int
    batch_max_size: int
    batch_max_delay_ms: float
    budget_bytes: int | None
    execution_timeout_ms: int
    weight: float
    required: bool
    requests: Mapping[str, int]
    timing: tuple[TimingInfo, ...]
    answer_lag_ms: float
    half_opens: int  # requests the deadline gate let through to measure
    residency: ResidencyInfo | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def sized(self) -> InstanceInfo | None:
        """The first instance with memory figures: the model's figures as a whole."""
        return next((i for i in self.instances if i.memory is not None), None)

    def as_dict(self) -> dict[str, Any]:
        """The model's public status, as GET /models/{name} shows it."""
        sized = self.sized
        memory = sized.memory if sized else None
        return {
            "name": self.name,
            "state": self.state,
            "error": self.error,
            "plugin": dict(self.plugin),
            "devices": list(self.devices),
            "instances": [asdict(i) for i in self.instances],
            "queue": {"depth": self.queue_depth, "capacity": self.queue_capacity,
                      "timeout_ms": self.queue_timeout_ms, "priority_levels": self.priority_levels},
            "batch": {"max_size": self.batch_max_size, "max_delay_ms": self.batch_max_delay_ms,
                      "effective_max_size": sized.max_batch if sized else 1},
            "memory": {"budget_bytes": self.budget_bytes, **_memory_fields(memory)},
            "timing": {"instances": [asdict(t) for t in self.timing], "answer_lag_ms": self.answer_lag_ms,
                       "half_opens": self.half_opens},
            "execution_timeout_ms": self.execution_timeout_ms,
            "weight": self.weight,
            "required": self.required,
            "requests": dict(self.requests),
            "residency": None if self.residency is None else {**asdict(self.residency),
                                                              "evictions": dict(self.residency.evictions)},
            **self.extra,
        }


def _memory_fields(memory: MemoryFigures | None) -> dict[str, Any]:
    keys = ("weights_bytes", "per_item_bytes", "fixed_bytes", "source")
    return {k: None for k in keys} if memory is None else asdict(memory)


@dataclass(frozen=True)
class DeviceInfo:
    """One device's budget, live reading and ledger at one moment."""

    name: str
    available: bool
    error: str | None = None
    budget_bytes: int = 0
    total_bytes: int | None = None
    used_bytes: int | None = None  # the last probe reading
    weights_bytes: int = 0
    reserved_bytes: int = 0
    peak_bytes: int = 0
    high_watermark: float = 0.9
    low_watermark: float = 0.8
    paused: bool = False
    running_batches: int = 0
    probe_errors: int = 0
    restarts: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _timing(instance: ModelInstance, now: float) -> TimingInfo:
    times = instance.times
    factor, spread = times.factor_at(now)
    return TimingInfo(instance.index, times.source, times.samples, round(times.seconds(1, now) * 1000, 3),
                      round(times.seconds(instance.max_batch, now) * 1000, 3), round(factor, 3), round(spread, 3))


def model_info(deployment: Deployment, now: float) -> ModelInfo:
    config = deployment.config
    plugin = deployment.plugin
    return ModelInfo(
        name=deployment.name,
        state=deployment.state.value,
        serving=deployment.serving,
        error=deployment.error,
        plugin={"name": plugin.name, "distribution": plugin.distribution, "version": plugin.version},
        accepts=tuple(plugin.cls.accepts),
        devices=tuple(config.instance_devices),
        instances=tuple(
            InstanceInfo(i.index, i.device, i.state.value, i.busy, i.batches, i.error, i.max_batch,
                         MemoryFigures.of(i.estimate or i.last_estimate))  # an unloaded model's last figures
            for i in deployment.instances
        ),
        queue_depth=deployment.queue.depth,
        queue_capacity=deployment.queue.max_size,
        queue_timeout_ms=config.queue.timeout_ms,
        priority_levels=config.queue.priority_levels,
        batch_max_size=config.batch.max_size,
        batch_max_delay_ms=config.batch.max_delay_ms,
        budget_bytes=deployment.budget_bytes,
        execution_timeout_ms=config.execution.timeout_ms,
        weight=config.weight,
        required=config.is_required,
        requests=dict(deployment.outcomes),
        timing=tuple(_timing(i, now) for i in deployment.instances),
        answer_lag_ms=round(deployment.lag.at(now) * 1000, 3),
        half_opens=deployment.gate.half_opens,
        residency=_residency(deployment, now),
    )


def _residency(deployment: Deployment, now: float) -> ResidencyInfo:
    res = deployment.residency
    return ResidencyInfo(
        mode=deployment.config.residency,
        resident=any(i.loaded for i in deployment.instances),
        held=res.held,
        held_down=res.held_down,
        in_use=res.holders,
        waiting_for_load=len(res.waiting),
        last_used_s_ago=round(now - res.last_used, 3) if res.last_used else None,
        loads=res.loads,
        load_failures=res.load_failures,
        last_load_at=res.last_load_at,
        last_load_s=round(res.cold_start_s, 3) if res.cold_start_s is not None else None,
        last_unload_returned_bytes=res.last_unload_returned_bytes,
        evictions=dict(res.evictions),
        never_fits=res.never_fits,
        restarts=res.restarts,
        lost=res.lost,
        load_error=res.load_error,
        generation=deployment.generation,
    )


def device_info(scheduler: DeviceScheduler) -> DeviceInfo:
    reading = scheduler.last_reading
    ledger = scheduler.ledger
    return DeviceInfo(
        name=scheduler.device,
        available=True,
        budget_bytes=scheduler.budget_bytes,
        total_bytes=reading.total_bytes if reading else None,
        used_bytes=reading.used_bytes if reading else None,
        weights_bytes=ledger.weights_bytes,
        reserved_bytes=ledger.reserved_bytes,
        peak_bytes=ledger.peak_bytes,
        high_watermark=scheduler.config.high_watermark,
        low_watermark=scheduler.config.low_watermark,
        paused=scheduler.paused,
        running_batches=scheduler.running_batches,
        probe_errors=scheduler.probe_errors,
        restarts=scheduler.restarts,
    )
