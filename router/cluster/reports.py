"""What device replicas tell the rest of the cluster, as plain frozen values.

A replica reports (every `cluster.stats_period_s`) to the placement controller and, in a compact
form (`RouteView`), to Ray's request routers through `record_routing_stats`. Answers to a
prediction travel back as a `Reply`: an answer or an error, never an exception across Ray (a
raised error would cost a traceback and lose its class).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.errors import RouterError, error_named
from router.serving.facade import Answer
from router.serving.snapshots import DeviceInfo, ModelInfo

__all__ = ["Command", "ErrorReply", "ModelLoad", "ReplicaReport", "Reply", "RouteView", "model_loads"]

#: Loaded-instance states: the model is resident.
RESIDENT = frozenset({"ready", "fenced", "draining"})
LOADING = frozenset({"loading", "warming"})


@dataclass(frozen=True)
class ModelLoad:
    """One model on one replica."""

    resident: bool
    loading: bool
    held: bool  # kept by the placement (a copy it asked for) or an operator
    held_down: bool
    in_flight: int  # requests holding it: waiting for a load, queued, running
    queue_depth: int
    weights_bytes: int | None  # measured (or the last measured) weights
    last_used_s_ago: float | None
    never_fits: str | None = None


def model_loads(models: list[ModelInfo]) -> dict[str, ModelLoad]:
    """The per-model figures placement and routing need, from a runtime's snapshots."""
    loads = {}
    for info in models:
        states = {i.state for i in info.instances}
        sized = info.sized
        res = info.residency
        loads[info.name] = ModelLoad(
            resident=bool(states & RESIDENT), loading=bool(states & LOADING),
            held=bool(res and res.held), held_down=bool(res and res.held_down),
            in_flight=res.in_use if res else info.queue_depth, queue_depth=info.queue_depth,
            weights_bytes=sized.memory.weights_bytes if sized and sized.memory else None,
            last_used_s_ago=res.last_used_s_ago if res else None, never_fits=res.never_fits if res else None,
        )
    return loads


@dataclass(frozen=True)
class RouteView:
    """A replica as the request router sees it (its `record_routing_stats`)."""

    replica: str
    resident: frozenset[str] = frozenset()
    loading: frozenset[str] = frozenset()
    free_bytes: int = 0
    draining: bool = False

    def as_stats(self) -> dict[str, Any]:
        return {"replica": self.replica, "resident": sorted(self.resident), "loading": sorted(self.loading),
                "free_bytes": self.free_bytes, "draining": self.draining}

    @classmethod
    def from_stats(cls, replica: str, stats: Mapping[str, Any]) -> RouteView:
        """From Ray's routing stats; a replica that has not reported yet is empty."""
        return cls(replica, frozenset(stats.get("resident", ())), frozenset(stats.get("loading", ())),
                   int(stats.get("free_bytes", 0)), bool(stats.get("draining", False)))


@dataclass(frozen=True)
class ReplicaReport:
    """One device replica at one moment: what placement plans from and what /models shows."""

    replica: str
    node_type: str
    node_id: str
    pid: int
    device: str
    budget_bytes: int
    free_bytes: int
    draining: bool
    loads: Mapping[str, ModelLoad]
    models: tuple[ModelInfo, ...] = ()
    devices: tuple[DeviceInfo, ...] = ()
    metrics_text: str = ""
    started_at: float = 0.0  # wall clock
    at: float = 0.0  # wall clock

    def route_view(self) -> RouteView:
        return RouteView(self.replica, frozenset(m for m, load in self.loads.items() if load.resident),
                         frozenset(m for m, load in self.loads.items() if load.loading), self.free_bytes, self.draining)


@dataclass(frozen=True)
class Command:
    """What placement asks of a replica: `load` (and hold) a copy, `release` it (with `unload`,
    unload it now if unused), or `unload` it and hold it down (an operator's unload)."""

    verb: str  # load | release | unload
    model: str
    unload: bool = False


#: Refusals decided before anything ran: another replica may take the request.
RETRYABLE = frozenset({"QueueFull", "ShuttingDown", "ModelDoesNotFit", "DeviceOutOfMemory"})


@dataclass(frozen=True)
class ErrorReply:
    kind: str  # the RouterError class name
    detail: str
    retry_after_s: float | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, error: RouterError) -> ErrorReply:
        return cls(type(error).__name__, error.detail, error.retry_after_s, dict(error.headers))

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE

    def error(self) -> RouterError:
        """The error again, as its class: it answers with the same status, outcome and headers."""
        return error_named(self.kind, self.detail, headers=self.headers, retry_after_s=self.retry_after_s)


@dataclass(frozen=True)
class Reply:
    """A replica's answer to one prediction."""

    replica: str
    answer: Answer | None = None
    error: ErrorReply | None = None
    cold: bool = False  # the model was not resident when the request arrived
