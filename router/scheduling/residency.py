"""Which models are resident on a device: a pure function from the device's occupants to a plan.

No I/O, no clock, no locks. The device scheduler gathers an `Occupant` for every instance
attached to it, calls `plan_residency` with the ledger's committed bytes, and carries out the
plan through the serving layer (loads, drains and unloads).

The rules, in order:
1. An on-demand model unused for its `idle_unload_s` is unloaded.
2. Models with waiting work (or an operator's load) are loaded, most urgent first (least time
   left before a waiting request's deadline, then the most waiting requests), while load slots
   are free and their weights plus one input fit beside what is committed.
3. A model that does not fit makes room by evicting, least recently used first, residents that
   are neither pinned (always-resident, held by an operator, just loaded) nor busy (running a
   batch or holding requests). Memory comes back when the unloads finish; the load waits for it.
4. Only when a waiting request would otherwise miss its deadline are busy residents evicted,
   those with the least work first. They drain first: the running batch finishes, and their
   queued requests stay queued (their model is now waiting to load again), never lost.
5. A model whose weights and one input exceed the budget, or the budget left beside models that
   are always resident, can never load: it is reported, and its requests are answered 503.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["Occupant", "ResidencyPlan", "plan_residency"]

#: A waiting request this close to its deadline, after the load, makes busy residents evictable.
URGENT_S = 0.5


@dataclass(frozen=True)
class Occupant:
    """One instance on the device, as residency sees it."""

    key: str
    model: str
    state: Literal["absent", "loading", "resident", "leaving"]  # leaving: draining or unloading
    weights_bytes: int  # booked when resident; expected when absent or loading
    batch_bytes: int  # one input's batch: the least it needs beside its weights to serve
    on_demand: bool = True  # may be evicted
    pinned: bool = False  # not evictable now: always-resident, held by an operator, just loaded
    busy: bool = False  # a batch is running
    work: int = 0  # its model's requests in flight (waiting for a load, preprocessing, queued)
    last_used: float = 0.0
    wanted: bool = False  # absent or leaving, and asked for: waiting requests or an operator's load
    slack_s: float | None = None  # until the oldest waiting request's deadline
    load_s: float = 0.0  # expected load time
    idle_unload_s: float | None = None


@dataclass(frozen=True)
class ResidencyPlan:
    loads: tuple[str, ...] = ()
    evictions: tuple[tuple[str, str, str], ...] = ()  # (instance key, kind, detail); kind: idle, lru, deadline
    waiting: tuple[tuple[str, str], ...] = ()  # (instance key, why its load waits)
    never_fits: tuple[tuple[str, str], ...] = ()  # (instance key, why it can never load here)


def _urgency(o: Occupant) -> tuple[float, int, str]:
    slack = float("inf") if o.slack_s is None else o.slack_s - o.load_s
    return (slack, -o.work, o.key)


def plan_residency(
    occupants: Sequence[Occupant],
    *,
    budget_bytes: int,
    committed_bytes: int,
    max_loads: int,
    now: float,
) -> ResidencyPlan:
    """Plan loads and evictions. `committed_bytes` is what the ledger (and any memory the probe
    sees beyond it) holds now; loads in progress are not booked yet and are added here."""
    loading = [o for o in occupants if o.state == "loading"]
    leaving = sum(o.weights_bytes for o in occupants if o.state == "leaving")
    free = budget_bytes - committed_bytes - sum(o.weights_bytes for o in loading)
    evicted: dict[str, tuple[str, str]] = {}
    loads: list[str] = []
    waiting: list[tuple[str, str]] = []
    never: list[tuple[str, str]] = []

    for o in occupants:  # 1. idle unloads
        if (o.state == "resident" and o.on_demand and not o.pinned and not o.busy and o.work == 0
                and o.idle_unload_s is not None and now - o.last_used >= o.idle_unload_s):
            evicted[o.key] = ("idle", f"unused for {now - o.last_used:.0f} s")

    pinned_bytes = sum(o.weights_bytes for o in occupants if o.state in ("resident", "loading") and not o.on_demand)
    slots = max_loads - len(loading)
    for want in sorted((o for o in occupants if o.wanted and o.state == "absent"), key=_urgency):
        need = want.weights_bytes + want.batch_bytes
        if need > budget_bytes - pinned_bytes:
            never.append((want.key, _never_reason(want, need, budget_bytes, pinned_bytes)))
            continue
        if slots <= 0:
            waiting.append((want.key, f"{max_loads} load(s) already running"))
            continue
        if need <= free:
            loads.append(want.key)
            free -= want.weights_bytes
            slots -= 1
            continue
        soon = free + leaving + sum(o.weights_bytes for o in occupants if o.key in evicted)
        if need <= soon:
            waiting.append((want.key, "waiting for unloads to return their memory"))
            continue
        victims = _victims(occupants, evicted, want, need - soon)
        if victims is None:
            waiting.append((want.key, "no room: the residents are busy or pinned"))
            continue
        for victim, kind, detail in victims:
            evicted[victim.key] = (kind, detail)
        leaving += sum(v.weights_bytes for v, _, _ in victims)
        waiting.append((want.key, "waiting for evictions to return their memory"))
    evictions = tuple((key, kind, detail) for key, (kind, detail) in evicted.items())
    return ResidencyPlan(tuple(loads), evictions, tuple(waiting), tuple(never))


def _victims(
    occupants: Sequence[Occupant], evicted: dict[str, tuple[str, str]], want: Occupant, short: int
) -> list[tuple[Occupant, str, str]] | None:
    """Residents to evict for `short` more bytes: idle ones, least recently used first; busy ones
    (least work first) only when `want`'s oldest waiting request would otherwise miss its deadline."""
    candidates = [o for o in occupants
                  if o.state == "resident" and o.on_demand and not o.pinned and o.key not in evicted]
    idle = sorted((o for o in candidates if not o.busy and o.work == 0), key=lambda o: (o.last_used, o.key))
    chosen: list[tuple[Occupant, str, str]] = []
    for o in idle:
        chosen.append((o, "lru", f"least recently used; room for {want.model}"))
        short -= o.weights_bytes
        if short <= 0:
            return chosen
    urgent = want.slack_s is not None and want.slack_s - want.load_s < URGENT_S
    if not urgent:
        return None
    busy = sorted((o for o in candidates if o.busy or o.work > 0), key=lambda o: (o.work, o.last_used, o.key))
    for o in busy:
        chosen.append((o, "deadline", f"{want.model} would miss its deadline; {o.work} request(s) wait for a reload"))
        short -= o.weights_bytes
        if short <= 0:
            return chosen
    return None


def _never_reason(want: Occupant, need: int, budget: int, pinned: int) -> str:
    if need > budget:
        return (f"model {want.model!r} needs {need} bytes (weights {want.weights_bytes} + one input "
                f"{want.batch_bytes}), over the device budget of {budget}")
    return (f"model {want.model!r} needs {need} bytes, but always-resident models hold {pinned} of the "
            f"{budget}-byte budget")
