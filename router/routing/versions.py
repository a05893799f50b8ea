"""`VersionRouter`: a name's requests between its versions, written once for every front.

Every way in (native HTTP, KServe V2 over HTTP and gRPC, a pipeline's steps; one process, a split
host's front, the cluster's front) screens and submits a model's requests here. A plain model's
name, or a version's own deployment name (`resnet18@2`), goes straight to the serving core. A
routed name (a model with `versions:`) is routed per request:

- the version: a pinned one (`X-Model-Version`, V2's `model_version`), else the sticky key's
  (`X-Route-Key`: the same key, the same version while the weights hold), else a weighted draw
  (`router.serving.versions.pick`);
- a mirrored copy (`mirror:`) goes to the mirror version as a shadow item once the user's answer
  is ready, admitted only into spare device capacity (none is sent for a second after one of the
  name's requests was refused for capacity or expired); its answer is compared with the user's and dropped, and its failures
  are nobody's (`router.routing.mirror`); a request routed to a version other than the stable one
  has a shadow copy on the stable one, so a split's answers are compared too;
- a version other than the stable one that fails an item (a 5xx, its own timeout) has the item
  run on the stable version when the deadline leaves room: the user sees the stable answer;
- every answer is tallied by version (outcome, latency, agreement) for the metrics and the
  rollout that owns the route's weights (`Serving.report_versions`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from router.errors import DeadlineExceeded, ModelNotFound, Overloaded, RouterError, ShuttingDown, brief
from router.routing.mirror import Mirrors
from router.routing.tally import Tallies
from router.sdk.plugin import Payload
from router.serving.facade import Answer, Serving
from router.serving.rules import Screened
from router.serving.versions import VersionRoute, mirrors, pick, split_name
from router.tracing.api import Phases

__all__ = ["COPY_TIMEOUT_MS", "FALLBACK_MIN_S", "PRESSURE_S", "VersionRouter", "is_version_fault"]

#: A failed candidate's item is run again on the stable version only if at least this much of its
#: deadline is left (less would only turn its failure into a 504).
FALLBACK_MIN_S = 0.005
#: After a request for a routed name is refused for want of capacity (503) or expires (504), no
#: shadow copy of its requests is sent for this long: a surge leaves no spare capacity to copy into.
PRESSURE_S = 1.0
#: A shadow copy waits at most this long for spare capacity; a copy that cannot run soon is stale.
COPY_TIMEOUT_MS = 1000.0


def is_version_fault(error: BaseException) -> bool:
    """The version failed the item (a 5xx of its own: the model raised, its batch overran, it ran
    out of memory or took no input), as opposed to the caller's mistake or the server's shutdown."""
    return isinstance(error, RouterError) and error.status_code >= 500 and not isinstance(error, ShuttingDown)


class VersionRouter:
    """Screens and submits a name's requests, routing a routed name's between its versions."""

    def __init__(self, facade: Serving, *, clock: Callable[[], float] = time.monotonic,
                 draw: Callable[[], float] = random.random) -> None:
        self.facade = facade
        self.clock = clock
        self.draw = draw
        self.tallies = Tallies(facade.report_versions, clock)
        self.mirrors = Mirrors(facade, self.tallies, clock)
        self._pressed_until: dict[str, float] = {}  # routed name -> no copies before this time

    # -- what a name names ------------------------------------------------------------------------

    def routes(self) -> Mapping[str, VersionRoute]:
        return self.facade.routes()

    def serves(self, name: str) -> bool:
        """`name` is a routed name (a model with versions)."""
        return name in self.facade.routes()

    def route(self, name: str) -> VersionRoute:
        route = self.facade.routes().get(name)
        if route is None:
            raise ModelNotFound(f"model {brief(name, 80)!r} has no versions")
        return route

    def target(self, name: str, version: str | None = None) -> str:
        """The deployment a request for `name` (at `version`, if pinned) names, without a draw: the
        pinned version's, or the stable one's (for metadata and readiness)."""
        route = self.facade.routes().get(name)
        if route is None:
            return name
        return route.deployment(pick(route, pinned=version or None, draw=0.0) if version else route.stable)

    def choose(self, name: str, *, version: str | None = None, route_key: str | None = None) -> str:
        """The deployment this request goes to."""
        route = self.facade.routes().get(name)
        if route is None:
            if version:
                _, own = split_name(name)
                if own is None and version != "1" or own is not None and version != own:
                    raise ModelNotFound(f"model {brief(name, 80)!r} has no version {brief(version, 40)!r}; "
                                        f"versions: {own or '1'}")
            return name
        return route.deployment(pick(route, pinned=version or None, sticky_key=route_key or None, draw=self.draw()))

    # -- the request path -------------------------------------------------------------------------

    def screen(self, name: str, *, priority: int | None = None, timeout_ms: float | None = None,
               received_at: float | None = None, items: int = 1, body_bytes: int | None = None,
               version: str | None = None, route_key: str | None = None) -> Screened:
        """The serving core's screen of the version this request is routed to: its `Screened`
        names that version's deployment, so the commit goes where the screen looked."""
        deployment = self.choose(name, version=version, route_key=route_key)
        try:
            return self.facade.screen(deployment, priority=priority, timeout_ms=timeout_ms, received_at=received_at,
                                      items=items, body_bytes=body_bytes)
        except (Overloaded, DeadlineExceeded):
            if deployment != name:
                self._pressed_until[name] = self.clock() + PRESSURE_S
            raise

    async def submit(self, name: str, payload: Payload, *, priority: int | None = None,
                     timeout_ms: float | None = None, request_id: str | None = None,
                     received_at: float | None = None, trace: Phases | None = None,
                     wait_for_room: bool = False, must_finish: bool = False, screened: Screened | None = None,
                     version: str | None = None, route_key: str | None = None) -> Answer:
        """One input through the version it is routed to (the screen's, when it was screened);
        its answer names the version that served it."""
        route = self.facade.routes().get(name)
        if screened is not None:
            deployment = screened.terms.model
        else:
            deployment = self.choose(name, version=version, route_key=route_key)
        started = self.clock() if received_at is None else min(received_at, self.clock())
        submit = self.facade.submit
        work = submit(deployment, payload, priority=priority, timeout_ms=timeout_ms, request_id=request_id,
                      received_at=started, trace=trace, wait_for_room=wait_for_room, must_finish=must_finish,
                      screened=screened)
        if route is None:
            return await work
        _, chosen = split_name(deployment)
        assert chosen is not None
        try:
            answer = await work
        except BaseException as exc:
            self.tallies.failed(route.name, chosen, exc, self.clock() - started)
            if isinstance(exc, Overloaded | DeadlineExceeded):
                self._pressed_until[route.name] = self.clock() + PRESSURE_S
            if chosen == route.stable or version or not is_version_fault(exc):
                raise
            return await self._fallback(route, payload, exc, priority, timeout_ms, request_id, started, trace,
                                        wait_for_room, must_finish)
        self.tallies.served(route.name, chosen, self.clock() - started)
        # The copy goes once the user's item is answered: it never waits beside it, and it finds the
        # device idle when the traffic leaves room (the core admits it only then).
        copy = None if version or self.clock() < self._pressed_until.get(route.name, 0.0) else self._copy_to(route, chosen)
        if copy is not None:
            copy_ms = min(timeout_ms, COPY_TIMEOUT_MS) if timeout_ms is not None else COPY_TIMEOUT_MS
            self.mirrors.compare(route, chosen, answer, self.mirrors.start(route, copy, payload, priority, copy_ms))
        return answer

    def _copy_to(self, route: VersionRoute, chosen: str) -> str | None:
        """The version a shadow copy of this request goes to: the mirror's share of the name's
        requests; and every request routed to a version other than the stable one, copied to the
        stable one, so that the split's answers are compared on the same inputs too."""
        copy = mirrors(route, chosen, self.draw())
        if copy is None and chosen != route.stable:
            copy = route.stable
        return copy

    async def _fallback(self, route: VersionRoute, payload: Payload, error: BaseException, priority: int | None,
                        timeout_ms: float | None, request_id: str | None, started: float, trace: Phases | None,
                        wait_for_room: bool, must_finish: bool) -> Answer:
        """The item a candidate failed, run on the stable version within what is left of its deadline."""
        left_s = self._left_s(route, timeout_ms, started)
        if left_s < FALLBACK_MIN_S:
            raise error
        self.tallies.fell_back(route.name)
        answer = await self.facade.submit(route.deployment(route.stable), payload, priority=priority,
                                          timeout_ms=left_s * 1000, request_id=request_id, received_at=self.clock(),
                                          trace=trace, wait_for_room=wait_for_room, must_finish=must_finish)
        self.tallies.served(route.name, route.stable, self.clock() - started)
        return replace(answer, input_info={**answer.input_info, "fallback_from": route.name})

    def _left_s(self, route: VersionRoute, timeout_ms: float | None, started: float) -> float:
        """What is left of the request's deadline: its own timeout, else the stable version's queue timeout."""
        if timeout_ms is None:
            try:
                timeout_ms = self.facade.model(route.deployment(route.stable)).queue_timeout_ms
            except RouterError:
                return 0.0
        return started + timeout_ms / 1000 - self.clock()

    def describe(self, name: str) -> dict[str, Any]:
        """A routed name as /models shows it: its versions, split, mirror and figures."""
        route = self.route(name)
        return {"name": name, "versions": list(route.versions), "stable": route.stable, "weights": dict(route.weights),
                "mirror": {"version": route.mirror, "percent": route.mirror_percent} if route.mirror else None,
                "generation": route.generation, "figures": self.tallies.describe(name),
                "deployments": {v: route.deployment(v) for v in route.versions}}
