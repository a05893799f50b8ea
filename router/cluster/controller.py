"""The placement controller: one Serve replica that owns the cluster's view and its model copies.

Device replicas report to it every `cluster.stats_period_s`; it keeps the latest report of each
(a replica silent for `STALE_PERIODS` periods is gone), learns each model's measured weights
from them, plans copies with `plan_copies` once a period, and hands each replica its commands in
the answer to its next report. Fronts read the reports (`view`) for `GET /models` and
`/metrics`. Its state is soft: restarted by Ray, it rebuilds everything from the next reports.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from router.cluster.layout import copy_policies
from router.cluster.placement import CopyPolicy, plan_copies
from router.cluster.reports import Command, ReplicaReport
from router.config import FleetConfig

__all__ = ["PlacementController"]

log = logging.getLogger("router.cluster.controller")
#: A replica that has not reported for this many periods (and at least 3 s) is gone.
STALE_PERIODS = 6
#: A model given a command is left alone this many periods (and at least 2 s), until reports show it.
SETTLE_PERIODS = 4


class PlacementController:
    """A Serve deployment class with one replica (options in `router.cluster.app`)."""

    async def __init__(self, fleet: dict[str, Any]) -> None:  # type: ignore[misc]  # Ray awaits it
        config = FleetConfig.model_validate(fleet)
        assert config.cluster is not None
        self._period_s = config.cluster.stats_period_s
        self._policies = copy_policies(config)
        self._declared = {name: int(m.memory.weights) for name, m in config.models.items() if m.memory.weights}
        self._reports: dict[str, ReplicaReport] = {}
        self._seen_at: dict[str, float] = {}
        self._weights: dict[str, int] = {}
        self._pending: dict[str, list[Command]] = {}
        self._changed_at: dict[str, float] = {}
        self._planner = asyncio.create_task(self._plan_loop(), name="placement")

    async def heartbeat(self, report: ReplicaReport) -> list[Command]:
        """A replica's report; the answer is what it should do."""
        self._reports[report.replica] = report
        self._seen_at[report.replica] = time.monotonic()
        for model, load in report.loads.items():
            if load.weights_bytes:
                self._weights[model] = max(self._weights.get(model, 0), load.weights_bytes)
        return self._pending.pop(report.replica, [])

    async def view(self) -> list[ReplicaReport]:
        """The live replicas' latest reports."""
        self._forget_stale()
        return list(self._reports.values())

    async def admin(self, verb: str, model: str) -> None:
        """An operator's `load` (keep at least one copy) or `unload` (no copy anywhere until loaded)."""
        policy = self._policies[model]
        if verb == "load":
            self._policies[model] = CopyPolicy(max(policy.min, 1), max(policy.max, 1), policy.target_in_flight,
                                               policy.idle_s, policy.node_types, held_down=False)
            for replica, report in self._reports.items():  # lift a hold-down where there is one
                load = report.loads.get(model)
                if load is not None and load.held_down:
                    self._pending.setdefault(replica, []).append(Command("release", model))
        elif verb == "unload":
            self._policies[model] = CopyPolicy(policy.min, policy.max, policy.target_in_flight, policy.idle_s,
                                               policy.node_types, held_down=True)
        self._changed_at.pop(model, None)
        log.info("operator: %s %s", verb, model)

    def _forget_stale(self) -> None:
        limit = max(3.0, STALE_PERIODS * self._period_s)
        now = time.monotonic()
        for replica in [r for r, at in self._seen_at.items() if now - at > limit]:
            log.warning("replica %s has not reported for %.1f s: dropped from the view", replica, now - self._seen_at[replica])
            self._reports.pop(replica, None)
            self._seen_at.pop(replica, None)
            self._pending.pop(replica, None)

    async def _plan_loop(self) -> None:
        while True:
            await asyncio.sleep(self._period_s)
            try:
                self._plan_once()
            except Exception:
                log.exception("placement round failed; the next round plans again")

    def _plan_once(self) -> None:
        self._forget_stale()
        now = time.monotonic()
        settle = max(2.0, SETTLE_PERIODS * self._period_s)
        settling = {m for m, at in self._changed_at.items() if now - at < settle}
        weights = {name: self._weights.get(name, self._declared.get(name, 0)) for name in self._policies}
        plan = plan_copies(list(self._reports.values()), self._policies, weights, settling=settling)
        for replica, command in plan.commands:
            self._pending.setdefault(replica, []).append(command)
            self._changed_at[command.model] = now
        for reason in plan.reasons:
            log.info("placement: %s", reason)
