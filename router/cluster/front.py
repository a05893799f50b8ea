"""`ClusterRuntime`: the serving core of a whole cluster's front, device replicas behind it.

It is the cluster's implementation of `router.serving.facade.Core`, so `Serving` and the Litestar
app over it (native API, KServe V2, auth, limits, request ids, metrics, versions) serve a cluster
unchanged. Pipelines (the fleet file's) are run by the front's pipeline runner, each step's input
sent to a replica like any request, its decoded pixels with it. `run` sends a request to a device
replica through `ReplicaCalls` (Ray deployment handles in
production, `router.cluster.calls`); Ray's request router picks the replica (`ray_router`). A
replica that refuses before running anything (queue full, predicted deadline miss, shutting
down, no room) is avoided and another is tried while the deadline allows; the client gets the
503 with Retry-After only when none can take it. A replica that dies under a request answers
503 (`ReplicaLost`); one that does not answer in time, 504. Snapshots merge the replicas'
latest reports, refreshed from the placement controller every `cluster.stats_period_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from pydantic import ValidationError

from router.cluster.layout import cluster_of, copy_policies, served_models
from router.cluster.reports import ErrorReply, ReplicaReport, Reply
from router.cluster.view import cluster_devices, cluster_model
from router.config import FleetConfig, ModelConfig, RouteConfig
from router.errors import DeadlineExceeded, InputError, ModelNotFound, ModelUnavailable, ShuttingDown, brief
from router.sdk.agreement import default_agreement
from router.sdk.plugin import Payload
from router.serving.facade import Answer, ModelInputs
from router.serving.plan import PipelinePlan, plan_pipeline, version_route
from router.serving.rollouts import Rollouts
from router.serving.rules import ModelFigures, Refusal, Screened, Terms, screen
from router.serving.snapshots import DeviceInfo, ModelInfo
from router.serving.telemetry import TelemetryFanout
from router.serving.traffic import Observation, TrafficChange
from router.serving.verbs import BeginDrain, LoadModel, SetTraffic, UnloadModel, Verb
from router.serving.versions import VersionRoute
from router.tracing.api import Phases
from router.version_config import RouteProblems, changed_route

__all__ = ["ClusterRuntime", "PredictCall", "ReplicaCalls"]

log = logging.getLogger("router.cluster.front")
R = TypeVar("R")
#: Beyond a request's deadline and its model's execution timeout, how long the front waits for a
#: replica before answering 504 itself (a replica that hangs or whose node vanished).
GRACE_S = 2.0


@dataclass(frozen=True)
class PredictCall:
    """One request as a device replica takes it (a pipeline's step: decoded pixels, and how it waits)."""

    model: str
    body: bytes
    media_type: str
    filename: str | None
    priority: int | None
    timeout_ms: float
    request_id: str
    pixels: Any = None  # a numpy array: Ray moves it through its object store
    wait_for_room: bool = False
    must_finish: bool = False
    shadow: bool = False  # a mirrored copy: the replica admits it into spare capacity only


class ReplicaCalls(Protocol):
    """How the front reaches the replicas (Ray deployment handles, or a test's fakes)."""

    async def predict(self, node_type: str, call: PredictCall, avoid: tuple[str, ...], wait_s: float) -> Reply:
        """Raises ReplicaLost when the replica died, DeadlineExceeded after `wait_s`."""
        ...

    async def view(self) -> list[ReplicaReport]: ...
    async def admin(self, verb: str, model: str) -> None: ...


class ClusterRuntime:
    #: A request's whole stay on a replica (its queue, batch and hooks) is one phase of its trace.
    phase: ClassVar[str] = "replica"

    def __init__(self, fleet: FleetConfig, calls: ReplicaCalls, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.fleet = fleet
        self.cluster = cluster_of(fleet)
        self.calls = calls
        self.clock = clock
        self.telemetry = TelemetryFanout()
        self.policies = copy_policies(fleet)
        self._pipelines = {name: plan_pipeline(name, fleet.pipelines) for name in fleet.pipelines}  # checked at deploy
        self._types = {m: [t for t in self.cluster.node_types if m in served_models(fleet, t)] for m in fleet.models}
        self.reports: list[ReplicaReport] = []
        self.requests: dict[str, Counter[str]] = {m: Counter() for m in fleet.models}
        self.cold: Counter[str] = Counter()
        self.retries: Counter[str] = Counter()
        self._draining = False
        self._refresher: asyncio.Task[None] | None = None
        self._route_configs = dict(fleet.routes)
        self._routes = {name: version_route(name, config) for name, config in fleet.routes.items()}
        self.rollouts = Rollouts(self._apply_traffic, lambda: (self._routes, self._route_configs), clock)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.refresh()
        await self.rollouts.start()
        self._refresher = asyncio.create_task(self._refresh_loop(), name="cluster-view")

    async def refresh(self) -> None:
        try:
            self.reports = await self.calls.view()
        except Exception as exc:  # noqa: BLE001  # placement restarting: keep the last view
            log.warning("cluster view not refreshed: %s: %s", type(exc).__name__, exc)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cluster.stats_period_s)
            await self.refresh()

    @property
    def ready(self) -> bool:
        """Not draining, a replica of every node type reports, every model with a min copy has one serving."""
        if self._draining or not all(any(r.node_type == t for r in self.reports) for t in self.cluster.node_types):
            return False
        serving = {m for r in self.reports for m, load in r.loads.items() if load.resident}
        return all(m in serving for m, policy in self.policies.items() if policy.min > 0)

    @property
    def draining(self) -> bool:
        return self._draining

    def begin_drain(self) -> None:
        self._draining = True

    def answer_open(self, error: ShuttingDown) -> None:
        """Nothing waits here but for a replica's reply, and the replicas answer every request."""

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        await self.rollouts.stop()

    # -- snapshots ----------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        return list(self.fleet.models)

    def models(self) -> list[ModelInfo]:
        return [self.model(name) for name in self.fleet.models]

    def model(self, name: str) -> ModelInfo:
        self._config(name)
        extra = {"cold_requests": self.cold[name], "retries": self.retries[name]}
        return cluster_model(name, self.fleet, self.reports, self.policies[name], self.requests[name], extra)

    def devices(self) -> list[DeviceInfo]:
        return cluster_devices(self.reports)

    def _config(self, name: str) -> ModelConfig:
        try:
            return self.fleet.models[name]
        except KeyError:
            known = ", ".join(sorted(self.fleet.models)) or "none"
            raise ModelNotFound(f"no model named {brief(name, 80)}; models: {known}") from None

    # -- requests -----------------------------------------------------------------------------

    def lookup(self, model: str) -> ModelConfig:
        return self._config(model)

    def inputs(self, model: str) -> ModelInputs:
        """From the replicas' reports: what they accept, the queue room of all of them together."""
        info = self.model(model)
        return ModelInputs(info.name, info.accepts, info.queue_capacity, info.priority_levels)

    def screen(self, model: ModelConfig, terms: Terms, *, gate: bool) -> Screened:
        """Refuse what no replica could take, from the name and headers: bad header, shutting
        down, no replica for the model, more items than its queue holds. The replica that takes
        the request commits it."""
        return screen(terms, self._figures(terms.model, model), self.clock())

    def _figures(self, model: str, config: ModelConfig) -> ModelFigures:
        """The model as the request rules see it from here: the replicas keep the queues and decide
        on room and deadlines, so only what the front knows refuses (draining, no replica up)."""
        refusal = None
        if self._draining:
            refusal = Refusal("ShuttingDown", "the cluster front is shutting down; retry on another front", 5.0)
        elif self.reports and not any(r.node_type in self._types[model] for r in self.reports):
            refusal = Refusal("ModelUnavailable", f"no replica of node type(s) {', '.join(self._types[model])} is up "
                                                  f"for model {model!r}; Ray is starting them", 5.0)
        queue = config.queue
        return ModelFigures(model, queue.priority_levels, queue.default_priority, queue.timeout_ms, queue.max_size,
                            occupancy=0, retry_after_s=1.0, refusal=refusal, at=self.clock())

    def ended(self, model: str, outcome: str) -> None:
        self.requests[model][outcome] += 1

    async def run(self, model: ModelConfig, terms: Terms, screened: Screened | None, payload: Payload,
                  request_id: str, trace: Phases | None) -> tuple[Answer, float]:
        """`screened`: the request's screen, not run again; without it the request is screened
        here first. `wait_for_room`, `must_finish` and `shadow` go to the replica with the input."""
        if screened is None:
            screened = screen(terms, self._figures(terms.model, model), self.clock())
        how = {"wait_for_room": terms.wait_for_room, "must_finish": terms.must_finish, "shadow": terms.shadow}
        answer = await self._route(terms.model, model, payload, terms.priority, request_id, screened.deadline, how)
        return answer, screened.deadline

    async def _route(self, model: str, config: ModelConfig, payload: Payload, priority: int | None, request_id: str,
                     deadline: float, how: Mapping[str, bool]) -> Answer:
        """Try replicas until one takes the request: a refusal made before anything ran moves on."""
        avoid: list[str] = []
        refusal: ErrorReply | None = None
        for node_type in self._types[model]:
            for _ in range(max(1, sum(1 for r in self.reports if r.node_type == node_type))):
                left_s = deadline - self.clock()
                if left_s <= 0:
                    break
                call = PredictCall(model, payload.body, payload.media_type, payload.filename, priority,
                                   left_s * 1000, request_id, payload.pixels, **how)
                wait_s = left_s + config.execution.timeout_ms / 1000 + GRACE_S
                reply = await self.calls.predict(node_type, call, tuple(avoid), wait_s)
                if reply.answer is not None:
                    self.cold[model] += reply.cold
                    return reply.answer
                assert reply.error is not None
                if not reply.error.retryable:
                    raise reply.error.error()
                refusal = reply.error
                self.retries[model] += 1
                if reply.replica in avoid:  # the router had nothing else to offer
                    break
                avoid.append(reply.replica)
        if refusal is not None:
            error = refusal.error()
            error.detail = f"every replica refused: {refusal.detail}"
            raise error
        raise DeadlineExceeded(f"deadline passed before a replica of model {model!r} could take the request")

    # -- operators' changes: a cluster's fleet changes by deploying it again, but for these -------

    async def call(self, verb: Verb[R]) -> R:
        """Load and unload (placement keeps or keeps out every copy), a split, a drain."""
        result: Any
        if isinstance(verb, LoadModel):
            result = await self._load(verb.name)
        elif isinstance(verb, UnloadModel):
            self._config(verb.name)
            await self.calls.admin("unload", verb.name)
            result = (self.model(verb.name), [])
        elif isinstance(verb, SetTraffic):  # routed here, where the cluster's requests are (replicas serve every version)
            result = await self.rollouts.set_traffic(verb.name, verb.change)
        elif isinstance(verb, BeginDrain):
            self.begin_drain()
            result = None
        else:
            raise InputError(_REDEPLOY)
        return result  # type: ignore[no-any-return]

    async def _load(self, name: str) -> ModelInfo:
        """Keep at least one copy resident (placement places it); waits until one serves."""
        config = self._config(name)
        await self.calls.admin("load", name)
        limit = self.clock() + config.load_timeout_ms / 1000
        while not any(r.loads.get(name) and r.loads[name].resident for r in self.reports):
            if self.clock() > limit:
                raise ModelUnavailable(f"model {name!r} did not become resident within its load_timeout_ms")
            await asyncio.sleep(self.cluster.stats_period_s)
            await self.refresh()
        return self.model(name)

    # -- versions: the fleet file's routes; the front routes, the replicas serve each version ------

    def routes(self) -> Mapping[str, VersionRoute]:
        return self._routes

    async def _apply_traffic(self, name: str, change: TrafficChange) -> VersionRoute:
        try:
            config = RouteConfig.model_validate(changed_route(
                self._route_configs[name], weights=change.weights, stable=change.stable, mirror=change.mirror,
                mirror_percent=change.mirror_percent))
        except (RouteProblems, ValidationError) as exc:
            raise InputError(f"models.{name}.traffic: {exc}") from None
        self._route_configs[name] = config
        route = version_route(name, config, self._routes[name].generation + 1)
        self._routes = {**self._routes, name: route}
        return route

    def rollout(self, name: str) -> dict[str, Any] | None:
        return self.rollouts.describe(name)

    def agreement(self, model: str, answer: Any, other: Any) -> float | None:
        return default_agreement(answer, other)

    def report_versions(self, observation: Observation) -> None:
        self.rollouts.observe(observation)

    # -- pipelines: the fleet file's, run by the front's pipeline runner through `submit` ------------

    def pipelines(self) -> list[PipelinePlan]:
        return list(self._pipelines.values())

    def pipeline(self, name: str) -> PipelinePlan | None:
        return self._pipelines.get(name)


_REDEPLOY = ("a cluster's fleet changes by deploying it again: edit the fleet file and run "
             "`model-router cluster deploy --config FILE` (Ray Serve replaces the replicas one by one)")
