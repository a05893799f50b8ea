"""How many copies of each model, and on which replicas: a pure function from reports to commands.

The replicas decide their own residency (on-demand loads, least-recently-used eviction by
measured bytes); placement only adds and removes *held* copies, from the replicas' reports:

1. A model with fewer than its `min` copies gains one, on the replica where its measured weights
   fit best in free memory (best fit, biggest models first); where none has room, on the one
   with the most free memory, which evicts idle on-demand models to make room.
2. A busy model (requests in flight per copy above the target) gains a copy, up to its `max`,
   only where it fits in free memory: an extra copy never evicts another model.
3. Copies beyond `max`, and extra copies of a model unused for `idle_s`, are released; they
   unload now if nothing uses them. A model never drops below its `min`.
4. One change per model per round, and none while a copy of it is loading: loads take time, and
   the next round sees their effect.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from router.cluster.reports import Command, ReplicaReport

__all__ = ["CopyPlan", "CopyPolicy", "plan_copies"]


@dataclass(frozen=True)
class CopyPolicy:
    min: int
    max: int
    target_in_flight: float
    idle_s: float
    node_types: frozenset[str] | None = None  # None: every node type serves it
    held_down: bool = False  # an operator unloaded it: no copies, on any replica


@dataclass(frozen=True)
class CopyPlan:
    commands: tuple[tuple[str, Command], ...] = ()  # (replica, command)
    reasons: tuple[str, ...] = ()

    def for_replica(self, replica: str) -> list[Command]:
        return [c for r, c in self.commands if r == replica]


def plan_copies(
    reports: Sequence[ReplicaReport], policies: Mapping[str, CopyPolicy], weights: Mapping[str, int],
    *, settling: Collection[str] = (),
) -> CopyPlan:
    """`weights`: each model's measured (or declared) weights, 0 when not known yet. `settling`:
    models changed so recently that the reports may not show it yet: left alone this round."""
    live = [r for r in reports if not r.draining]
    free = {r.replica: r.free_bytes for r in live}
    commands: list[tuple[str, Command]] = []
    reasons: list[str] = []
    for model in sorted(policies, key=lambda m: (-weights.get(m, 0), m)):
        policy = policies[model]
        if model in settling:
            continue
        hosts = [r for r in live if policy.node_types is None or r.node_type in policy.node_types]
        if policy.held_down:
            for r in hosts:
                load = r.loads.get(model)
                if load is not None and not load.held_down:
                    commands.append((r.replica, Command("unload", model)))
            continue
        for replica, command, reason in _changes(model, policy, hosts, free, weights.get(model, 0)):
            commands.append((replica, command))
            reasons.append(reason)
    return CopyPlan(tuple(commands), tuple(reasons))


def _holds(report: ReplicaReport, model: str) -> bool:
    load = report.loads.get(model)
    return load is not None and (load.resident or load.loading)


def _changes(
    model: str, policy: CopyPolicy, hosts: list[ReplicaReport], free: dict[str, int], weight: int,
) -> list[tuple[str, Command, str]]:
    """This round's changes for one model; the weights of copies it adds are taken from `free`."""
    copies = [r for r in hosts if _holds(r, model)]
    if any(r.loads[model].loading for r in copies):
        return []
    held = [r for r in copies if r.loads[model].held]
    if len(held) < policy.min:  # 1. hold the copies there are, then add the missing ones
        changes = [(r.replica, Command("load", model), f"{model}: hold the copy on {r.replica} (min {policy.min})")
                   for r in copies if not r.loads[model].held][:policy.min - len(held)]
        others = [r for r in hosts if not _holds(r, model)]
        for _ in range(policy.min - len(copies)):
            target = _best_fit(others, free, weight) or _most_free(others, free)
            if target is None:
                break
            others = [r for r in others if r.replica != target]
            free[target] -= weight
            changes.append((target, Command("load", model), f"{model}: {len(copies)} of min {policy.min} copies"))
        return changes
    in_flight = sum(r.loads[model].in_flight for r in copies)
    if len(copies) < policy.max and copies and in_flight / len(copies) > policy.target_in_flight:  # 2.
        target = _best_fit([r for r in hosts if not _holds(r, model)], free, weight)
        if target is None:
            return []
        free[target] -= weight
        return [(target, Command("load", model), (f"{model}: {in_flight} in flight on {len(copies)} copies, "
                                                  f"over {policy.target_in_flight:g} each"))]
    shrink = _shrink(model, policy, copies, in_flight)
    return [] if shrink is None else [shrink]


def _shrink(model: str, policy: CopyPolicy, copies: list[ReplicaReport], in_flight: int) -> tuple[str, Command, str] | None:
    """3. Release one copy beyond max, or an extra copy of an idle model (never below min)."""
    floor = max(policy.min, 1 if in_flight else 0)
    if len(copies) <= floor:
        return None
    ages = [r.loads[model].last_used_s_ago for r in copies]
    idle = in_flight == 0 and all(age is None or age >= policy.idle_s for age in ages)
    if len(copies) <= policy.max and not idle:
        return None
    quietest = min(copies, key=lambda r: (r.loads[model].in_flight, -(r.loads[model].last_used_s_ago or 0.0), r.replica))
    why = f"over max {policy.max}" if len(copies) > policy.max else f"unused for {policy.idle_s:g} s"
    return quietest.replica, Command("release", model, unload=True), f"{model}: release a copy on {quietest.replica} ({why})"


def _best_fit(candidates: list[ReplicaReport], free: dict[str, int], weight: int) -> str | None:
    """The replica where `weight` fits leaving the least free memory (classic best fit)."""
    fits = [r for r in candidates if free[r.replica] >= weight]
    if not fits:
        return None
    return min(fits, key=lambda r: (free[r.replica] - weight, r.replica)).replica


def _most_free(candidates: list[ReplicaReport], free: dict[str, int]) -> str | None:
    if not candidates:
        return None
    return max(candidates, key=lambda r: (free[r.replica], r.replica)).replica
