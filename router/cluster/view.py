"""The whole cluster as `GET /models` and `/metrics` show it: the replicas' snapshots merged.

Pure functions of the replicas' latest reports: each model's instances are every replica's,
named `REPLICA/DEVICE`; queue figures are summed; the front's own request counts replace the
replicas' (a request one replica refused and another served counts once); where the model is
resident and loading, and its copy bounds, are in `cluster`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace

from router.cluster.placement import CopyPolicy
from router.cluster.reports import ReplicaReport
from router.config import FleetConfig
from router.serving.snapshots import DeviceInfo, InstanceInfo, ModelInfo, ResidencyInfo

__all__ = ["cluster_devices", "cluster_model"]


def cluster_devices(reports: Sequence[ReplicaReport]) -> list[DeviceInfo]:
    """One device per replica, named `REPLICA/DEVICE`."""
    return [replace(d, name=f"{r.replica}/{d.name}") for r in reports for d in r.devices]


def cluster_model(
    name: str, fleet: FleetConfig, reports: Sequence[ReplicaReport], policy: CopyPolicy, requests: Mapping[str, int],
    extra: Mapping[str, int],
) -> ModelInfo:
    """One model over every replica. `requests`: the front's counts by outcome; `extra`: the front's
    own figures for it (cold requests, retries)."""
    pairs = [(r, info) for r in reports for info in r.models if info.name == name]
    resident_on = sorted(r.replica for r, _ in pairs if r.loads.get(name) and r.loads[name].resident)
    loading_on = sorted(r.replica for r, _ in pairs if r.loads.get(name) and r.loads[name].loading)
    replicas = {r.replica: {"node_type": r.node_type, "state": info.state, "queue_depth": info.queue_depth,
                            "requests": dict(info.requests)} for r, info in pairs}
    cluster = {"min": policy.min, "max": policy.max, "copies": len(resident_on), "resident_on": resident_on,
               "loading_on": loading_on, "replicas": replicas, **extra}
    if not pairs:
        return _unplaced(name, fleet, requests, cluster)
    base = pairs[0][1]
    instances = tuple(replace(i, device=f"{r.replica}/{i.device}") for r, info in pairs for i in info.instances)
    serving = any(info.serving for _, info in pairs)
    states = [info.state for _, info in pairs]
    state = "ready" if serving else ("loading" if "loading" in states else base.state)
    return replace(
        base, state=state, serving=serving, error="; ".join(sorted({i.error for _, i in pairs if i.error})) or None,
        devices=tuple(i.device for i in instances), instances=instances,
        queue_depth=sum(i.queue_depth for _, i in pairs), queue_capacity=sum(i.queue_capacity for _, i in pairs),
        requests=dict(requests), timing=tuple(t for _, info in pairs for t in info.timing),
        residency=_residency([info.residency for _, info in pairs if info.residency is not None]),
        extra={"cluster": cluster},
    )


def _residency(parts: list[ResidencyInfo]) -> ResidencyInfo | None:
    if not parts:
        return None
    evictions: Counter[str] = Counter()
    for part in parts:
        evictions.update(part.evictions)
    ages = [p.last_used_s_ago for p in parts if p.last_used_s_ago is not None]
    loads = [p for p in parts if p.last_load_at is not None]
    last = max(loads, key=lambda p: p.last_load_at or 0.0) if loads else None
    return replace(
        parts[0], resident=any(p.resident for p in parts), held=any(p.held for p in parts),
        held_down=all(p.held_down for p in parts), in_use=sum(p.in_use for p in parts),
        waiting_for_load=sum(p.waiting_for_load for p in parts), last_used_s_ago=min(ages) if ages else None,
        loads=sum(p.loads for p in parts), load_failures=sum(p.load_failures for p in parts),
        last_load_at=last.last_load_at if last else None, last_load_s=last.last_load_s if last else None,
        evictions=dict(evictions),
    )


def _unplaced(name: str, fleet: FleetConfig, requests: Mapping[str, int], cluster: dict[str, object]) -> ModelInfo:
    """A model no replica has reported yet (no replica up, or none of its node type)."""
    config = fleet.models[name]
    return ModelInfo(
        name=name, state="unplaced", serving=False, error=None, plugin={"name": config.plugin, "distribution": None,
                                                                      "version": None},
        accepts=(), devices=(), instances=tuple[InstanceInfo, ...](), queue_depth=0, queue_capacity=0,
        queue_timeout_ms=config.queue.timeout_ms, priority_levels=config.queue.priority_levels,
        batch_max_size=config.batch.max_size, batch_max_delay_ms=config.batch.max_delay_ms,
        budget_bytes=int(config.memory.budget) if config.memory.budget is not None else None,
        execution_timeout_ms=config.execution.timeout_ms, weight=config.weight, required=False,
        requests=dict(requests), timing=(), answer_lag_ms=0.0, half_opens=0, residency=None, extra={"cluster": cluster},
    )
