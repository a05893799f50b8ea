"""The rollouts of the fleet's routed names, and every change of a split: one owner.

A routed name whose fleet-file section has `rollout:` starts one when the fleet is served (or its
route changes): its candidate gets the first step's weight, and every observation of its answers
and of the stable version's (`Observation`, from whichever front saw them) goes to its decision
rule (`router.serving.rollout.Rollout`). When the rule decides (the next step, promotion or
rollback), the new split is applied here, as an operator's change is, logged once and counted.
An operator who changes the split of a name whose rollout runs stops that rollout.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from router.config import RouteConfig
from router.errors import ModelNotFound
from router.rollout_config import RolloutConfig
from router.serving.rollout import Decision, Rollout
from router.serving.traffic import Observation, TrafficChange
from router.serving.versions import VersionRoute

__all__ = ["Rollouts"]

log = logging.getLogger("router.serving.rollouts")


#: Applies one change of a split, whole (the fleet editor's `set_traffic`): the new route.
Apply = Callable[[str, TrafficChange], Awaitable[VersionRoute]]
#: The routes served now, and the fleet file's section of each routed name (its `rollout:`).
Routes = Callable[[], tuple[Mapping[str, VersionRoute], Mapping[str, RouteConfig]]]


class Rollouts:
    """Owns the rollouts in progress and applies each change of a split (`apply`)."""

    def __init__(self, apply: Apply, routes: Routes, clock: Callable[[], float]) -> None:
        self._apply_change = apply
        self._routes = routes
        self._clock = clock
        self._running: dict[str, Rollout] = {}
        self._ended: dict[str, dict[str, Any]] = {}
        self._ended_configs: dict[str, RolloutConfig] = {}  # a rollout the fleet file declares again starts anew
        self._applying: set[asyncio.Task[None]] = set()
        self.decisions: Counter[tuple[str, str]] = Counter()  # (name, step | promote | rollback)

    async def start(self) -> None:
        """Start the rollouts the fleet file declares, each at its first step (when the fleet is
        served, and after each reload: a rollout that ended starts again only if its section changed)."""
        routes, configs = self._routes()
        for name, route in routes.items():
            config = configs[name].rollout if name in configs else None
            if config is not None and name not in self._running and self._ended_configs.get(name) != config:
                rollout = Rollout(name, route.stable, config, self._clock)
                self._running[name] = rollout
                await self._apply(name, rollout.state["weights"], why=f"rollout of version {config.candidate!r} starts")

    def observe(self, observation: Observation) -> None:
        """One observation from a front; a decision it brings is applied (off the caller's path)."""
        rollout = self._running.get(observation.name)
        if rollout is None:
            return
        if observation.kind == "agreement":
            if observation.version == rollout.config.candidate:
                rollout.observe_agreement(observation.value)
        else:
            rollout.observe(observation.version, observation.kind == "served", observation.value)
        decision = rollout.decide()
        if decision is not None:
            task = asyncio.ensure_future(self._decided(observation.name, rollout, decision))
            self._applying.add(task)
            task.add_done_callback(self._applying.discard)

    async def _decided(self, name: str, rollout: Rollout, decision: Decision) -> None:
        self.decisions[name, decision.action] += 1
        log.info("rollout of %s: %s (step %d): %s", name, decision.action, decision.step, decision.reason,
                 extra={"model": name, "rollout_action": decision.action, "figures": decision.figures})
        stable = rollout.config.candidate if decision.action == "promote" else None
        if decision.action in ("promote", "rollback"):
            self._end(name, rollout, decision.reason)
        await self._apply(name, decision.weights, why=decision.reason, stable=stable)

    async def _apply(self, name: str, weights: dict[str, float], *, why: str, stable: str | None = None) -> None:
        try:
            await self._apply_change(name, TrafficChange(weights=dict(weights), stable=stable))
        except Exception:
            log.exception("rollout of %s: the split %s could not be applied (%s)", name, weights, why)

    async def set_traffic(self, name: str, change: TrafficChange) -> VersionRoute:
        """An operator's change of a split; a rollout of that name in progress stops."""
        routes, _ = self._routes()
        if name not in routes:
            raise ModelNotFound(f"no model named {name!r} has versions; routed names: "
                                f"{', '.join(sorted(routes)) or 'none'}")
        route = await self._apply_change(name, change)
        rollout = self._running.get(name)
        if rollout is not None:
            self._end(name, rollout, "stopped: an operator changed the split")
            log.info("rollout of %s stopped: an operator changed the split", name, extra={"model": name})
        return route

    def _end(self, name: str, rollout: Rollout, reason: str) -> None:
        self._running.pop(name, None)
        self._ended[name] = {**rollout.state, "reason": reason}
        self._ended_configs[name] = rollout.config

    def describe(self, name: str) -> dict[str, Any] | None:
        """The rollout of `name`, running or ended, as /models shows it."""
        rollout = self._running.get(name)
        if rollout is not None:
            return {**rollout.state, "decisions": {a: n for (r, a), n in self.decisions.items() if r == name}}
        ended = self._ended.get(name)
        return None if ended is None else {**ended, "decisions": {a: n for (r, a), n in self.decisions.items()
                                                                   if r == name}}

    async def stop(self) -> None:
        for task in list(self._applying):
            task.cancel()
        await asyncio.gather(*self._applying, return_exceptions=True)
