"""Operators' changes to a serving fleet: load, unload, add, change and remove models, and
re-read the fleet file, with nothing accepted lost.

- `load`: load a model now and keep it resident until an operator unloads it.
- `unload`: unload now, and keep it unloaded until an operator loads it (as Triton's explicit
  model control); requests still queued are answered 503 with the reason.
- `put` a model's section: a new model is added; a changed one (new weights, new options) is
  loaded beside the old version when memory allows and swapped in, so no request fails; when it
  does not fit, the old version finishes its work and unloads first, and new requests wait for
  the new version. A new version that fails to load leaves (or brings back) the old one serving.
- `delete`: new requests get 404; what was accepted is answered; then the model unloads. A model
  that a pipeline uses is not deleted (409) until the pipeline is.
- `put_pipeline`, `delete_pipeline`: add, change or remove a pipeline; requests already inside one
  finish on the definition they started with. A model change that a pipeline could no longer
  use is refused (409).
- `put_version`, `delete_version`, `set_traffic`: a model with versions (each version is the model
  `name@version`): add or change one version, remove one that no request goes to, change the split,
  the stable version or the mirror. Each is one change, applied whole: the name's route is swapped
  for a new one with the next generation (`plan.routes`), never patched.
- `reload`: the difference between the fleet file and what serves, applied model by model (a model
  with versions: version by version, then its route), then pipeline by pipeline.

One change runs at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from router.config import FleetConfig, ModelConfig, RouteConfig, config_error, format_validation_error, validation_problems
from router.errors import ConfigError, Conflict, ModelDoesNotFit, ModelNotFound, ModelUnavailable, brief
from router.scheduling.queue import reject
from router.serving.deployment import Deployment
from router.serving.fleet_state import FleetState, Forget, Replan, Serve, Stage, Withdraw
from router.serving.instance import InstanceState
from router.serving.loading import load_instance
from router.serving.plan import (
    FleetPlan,
    PipelinePlan,
    load_plan,
    pipeline_transforms,
    resolve_fleet,
    resolve_pipelines,
    version_route,
)
from router.serving.registry import PluginRegistry
from router.serving.residency_executor import ResidencyExecutor, UnloadReport
from router.serving.traffic import TrafficChange
from router.serving.versions import VersionRoute, deployment_name, split_name
from router.version_config import ROUTE_KEYS, RouteProblems, changed_route, merge_section, removal_problem, version_name_problem

__all__ = ["FleetEditor", "ReloadReport"]

log = logging.getLogger("router.serving.editor")
Builder = Callable[[str, FleetPlan, int], Deployment]
#: How often a retiring model's remaining requests are looked at.
POLL_S = 0.02


@dataclass(frozen=True)
class ReloadReport:
    """What a reload of the fleet file changed."""

    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    pipelines: dict[str, str] = field(default_factory=dict)  # name: added, changed, unchanged, removed or the error
    routes: dict[str, str] = field(default_factory=dict)  # a model with versions: added, changed, unchanged, removed


class FleetEditor:
    """The fleet editor: the admin verbs. Each changes the fleet as a few `FleetChange`s given to
    `FleetState.apply` (stage the new deployment, serve it, forget the old one once it drained),
    with the loads and drains between them, and drives the residency executor."""

    def __init__(
        self,
        fleet: FleetState,
        residency: ResidencyExecutor,
        build: Builder,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fleet = fleet
        self._residency = residency
        self._build = build
        self._clock = clock
        self._lock = asyncio.Lock()
        self._generations = {d.name: d.generation for d in fleet}
        self._route_generations = {name: route.generation for name, route in fleet.plan.routes.items()}

    @property
    def plan(self) -> FleetPlan:
        """The plan served now; every change gives the fleet state a new one, whole (`Replan`)."""
        return self._fleet.plan

    def _replan(self, plan: FleetPlan) -> None:
        self._fleet.apply(Replan(plan))

    def _deployment(self, name: str) -> Deployment:
        return self._fleet.get(name)

    # -- load and unload ------------------------------------------------------------------------

    async def load(self, name: str) -> None:
        async with self._lock:
            await self._load(self._deployment(name))

    async def _load(self, deployment: Deployment) -> None:
        """Ask residency to load every instance and keep it; wait until it serves or cannot."""
        res = deployment.residency
        res.operator_load()
        self._residency.notify(deployment)
        limit = self._clock() + deployment.config.load_timeout_ms / 1000 * max(1, len(deployment.instances))
        while not all(i.state in (InstanceState.READY, InstanceState.FENCED) for i in deployment.instances):
            if res.never_fits is not None:
                raise ModelDoesNotFit(res.never_fits)
            if any(i.state is InstanceState.FAILED for i in deployment.instances) and not deployment.loading:
                raise ModelUnavailable(f"model {deployment.name!r} failed to load: {deployment.error}")
            if self._clock() > limit:
                raise ModelUnavailable(f"model {deployment.name!r} did not load within its load_timeout_ms")
            changed = res.changed
            try:
                await asyncio.wait_for(changed.wait(), 1.0)
            except TimeoutError:
                self._residency.notify(deployment)

    async def unload(self, name: str) -> list[UnloadReport]:
        async with self._lock:
            deployment = self._deployment(name)
            deployment.residency.operator_unload()  # requests waiting for a load get 503 now
            return await self._unload(deployment, "admin", "unloaded by an operator")

    async def release(self, name: str, unload: bool) -> list[UnloadReport]:
        """Drop a hold (an operator's or the cluster placement's load): the model is on demand
        again. With `unload`, an on-demand model that holds no request unloads now; one in use
        stays for residency to evict later. It is never held down: a request loads it again."""
        async with self._lock:
            deployment = self._deployment(name)
            res = deployment.residency
            res.let_go()
            self._residency.notify(deployment)
            if not unload or not deployment.on_demand or res.holders or deployment.queue.occupancy:
                return []
            return await self._unload(deployment, "released", "released by the cluster's placement")

    async def _unload(self, deployment: Deployment, kind: str, why: str) -> list[UnloadReport]:
        while deployment.loading:  # a load in flight finishes first, then unloads
            changed = deployment.residency.changed
            await changed.wait()
        loaded = [i for i in deployment.instances if i.loaded]
        for instance in loaded:
            self._residency.count_eviction(deployment, instance, kind)
        reports = await asyncio.gather(*(self._residency.unload_instance(deployment, i, f"{kind}: {why}") for i in loaded))
        for ticket in deployment.queue.withdraw_all():
            reject(ticket, ModelUnavailable(f"model {deployment.name!r} was {why}", retry_after_s=5.0))
        return list(reports)

    # -- add, change, remove --------------------------------------------------------------------

    async def put(self, name: str, section: Mapping[str, Any], source: str) -> str:
        """Add or change one model from its fleet-file section: a section with versions: puts them all
        and the name's route; `name@version` puts that version. Returns added, changed or unchanged."""
        async with self._lock:
            if name in self.plan.pipelines:
                raise Conflict(f"a pipeline is named {name!r}; models and pipelines share one name: choose another")
            base, version = split_name(name)
            if version is not None:
                return await self._put_version(base, version, section, source)
            if name in self.plan.routes or set(section) & set(ROUTE_KEYS):
                return await self._put_routed(name, dict(section), source)
            plan = self._resolve(name, dict(section), source)
            self._check_users(name, plan)
            return await self._apply(name, plan)

    def _check_users(self, name: str, plan: FleetPlan) -> None:
        """409 when the pipelines that use the model could not use its new section."""
        users = self.plan.users_of(name)
        if not users:
            return
        try:
            resolve_pipelines(plan.fleet, plan.models, pipeline_transforms(plan.fleet), plan.source)
        except ConfigError as exc:
            raise Conflict(f"model {name!r} is used by pipeline(s) {', '.join(users)}, which could not use this "
                           f"section: {exc}") from None

    async def delete(self, name: str) -> None:
        """Remove a model; a model with versions goes whole (`name@version` removes that version only)."""
        async with self._lock:
            base, version = split_name(name)
            if version is not None and base in self.plan.routes:
                await self._delete_version(base, version)
                return
            model = name if name in self.plan.routes else self._deployment(name).name
            if users := self.plan.users_of(model):
                raise Conflict(f"model {name!r} is used by pipeline(s) {', '.join(users)}: delete them "
                               "(DELETE /pipelines/{name}) or change them first")
            if model in self.plan.routes:
                await self._drop_route(model, "removed from the fleet")
            else:
                await self._remove(model, "removed from the fleet")

    async def _remove(self, model: str, why: str) -> None:
        """Stop serving one model (new requests get 404), answer what it accepted, unload it."""
        deployment = self._deployment(model)
        self._fleet.apply(Withdraw(model, replace(
            self.plan, models={k: v for k, v in self.plan.models.items() if k != model},
            fleet=self.plan.fleet.model_copy(update={"models": {k: v for k, v in self.plan.fleet.models.items() if k != model}}))))
        await self._retire(deployment, "removed", why)

    async def _drop_route(self, name: str, why: str) -> list[str]:
        """Stop routing a model with versions (its name gets 404), then remove every version; the versions removed."""
        config = self.plan.fleet.routes[name]
        self._set_route(name, None)
        removed = [deployment_name(name, v) for v in config.versions if deployment_name(name, v) in self._fleet.deployments]
        for model in removed:
            await self._remove(model, why)
        log.info("model %s and its versions removed", name, extra={"model": name})
        return removed

    # -- pipelines ------------------------------------------------------------------------------

    async def put_pipeline(self, name: str, section: Mapping[str, Any], source: str) -> tuple[str, PipelinePlan]:
        """Add or change one pipeline from its fleet-file section: nothing loads, it serves at once."""
        async with self._lock:
            fleet_data = self.plan.fleet.model_dump()
            fleet_data["pipelines"] = {**fleet_data["pipelines"], name: dict(section)}
            try:
                fleet = FleetConfig.model_validate(fleet_data)
            except ValidationError as exc:
                raise ConfigError(format_validation_error(exc, source, FleetConfig)) from exc
            pipelines = resolve_pipelines(fleet, self.plan.models, pipeline_transforms(fleet), source)
            current = self.plan.pipelines.get(name)
            outcome = "added" if current is None else "unchanged" if current.config == fleet.pipelines[name] else "changed"
            self._replan(replace(self.plan, fleet=fleet, pipelines=pipelines))
            log.info("pipeline %s %s", name, outcome, extra={"pipeline": name})
            return outcome, pipelines[name]

    async def delete_pipeline(self, name: str) -> None:
        async with self._lock:
            if name not in self.plan.pipelines:
                known = ", ".join(sorted(self.plan.pipelines)) or "none"
                raise ModelNotFound(f"no pipeline named {brief(name, 80)}; pipelines: {known}")
            users = sorted(p for p, plan in self.plan.pipelines.items() if name in plan.config.pipelines)
            if users:
                raise Conflict(f"pipeline {name!r} is a step of pipeline(s) {', '.join(users)}: change them first")
            self._set_pipelines({k: v for k, v in self.plan.pipelines.items() if k != name})
            log.info("pipeline %s removed", name, extra={"pipeline": name})

    def _set_pipelines(self, pipelines: dict[str, PipelinePlan]) -> None:
        fleet = self.plan.fleet.model_copy(update={"pipelines": {k: p.config for k, p in pipelines.items()}})
        self._replan(replace(self.plan, fleet=fleet, pipelines=pipelines))

    def _reload_pipelines(self, target: FleetPlan, report: ReloadReport) -> None:
        """The file's pipelines whose models all serve; the others are reported, not served."""
        served = {}
        for name, plan in target.pipelines.items():
            missing = [m for m in plan.models if m not in self._fleet.deployments and m not in self.plan.routes]
            if missing:
                report.pipelines[name] = f"not served: model(s) {', '.join(missing)} did not come in"
                continue
            current = self.plan.pipelines.get(name)
            report.pipelines[name] = ("added" if current is None else
                                      "unchanged" if current.config == plan.config else "changed")
            served[name] = plan
        self._set_pipelines(served)

    # -- versions -------------------------------------------------------------------------------

    async def put_version(self, name: str, version: str, section: Mapping[str, Any], source: str) -> str:
        """Add or change one version of a model with versions from its section, merged over the
        stable version's (as a version's section in the fleet file is over the model's keys). A new
        version takes no traffic until the split gives it some. Returns added, changed or unchanged."""
        async with self._lock:
            return await self._put_version(name, version, section, source)

    async def delete_version(self, name: str, version: str) -> VersionRoute:
        """Remove a version no request goes to (not the stable one, the mirror, or one with a
        share of the traffic); what it accepted is answered. Returns the new route."""
        async with self._lock:
            return await self._delete_version(name, version)

    async def set_traffic(self, name: str, change: TrafficChange, source: str = "traffic") -> VersionRoute:
        """Change a model's split, stable version or mirror, whole (`TrafficChange`: what it
        leaves None stays). Returns the new route; the same one when nothing changed."""
        async with self._lock:
            config = self._route_config(name)
            try:
                new = RouteConfig.model_validate(changed_route(
                    config, weights=change.weights, stable=change.stable, mirror=change.mirror,
                    mirror_percent=change.mirror_percent))
            except (RouteProblems, ValidationError) as exc:
                raise config_error(source, _route_lines(exc, source, name)) from None
            if new != config:
                self._set_route(name, new)
                route = self.plan.routes[name]
                log.info("model %s: traffic %s, stable %s, mirror %s (generation %d)", name, dict(route.weights),
                         route.stable, route.mirror, route.generation, extra={"model": name})
            return self.plan.routes[name]

    def _route_config(self, name: str) -> RouteConfig:
        """The route section of a model with versions; 409 for a model without, 404 for no model."""
        config = self.plan.fleet.routes.get(name)
        if config is not None:
            return config
        if name in self._fleet.deployments:
            raise Conflict(f"model {name!r} has no versions: give it versions: in the fleet file and reload "
                           "(docs/configuration.md, \"Versions and traffic splits\")")
        known = ", ".join(sorted(self.plan.routes)) or "none"
        raise ModelNotFound(f"no model with versions named {brief(name, 80)}; models with versions: {known}")

    async def _put_version(self, name: str, version: str, section: Mapping[str, Any], source: str) -> str:
        config = self._route_config(name)
        if (problem := version_name_problem(version)) is not None:
            raise ConfigError(f"{source}: {problem}")
        model = deployment_name(name, version)
        # As in the fleet file, the section says what differs: merged over the stable version's.
        stable = self.plan.fleet.models[deployment_name(name, config.stable)].model_dump(mode="json", exclude_unset=True)
        section = merge_section(stable, section)
        try:
            ModelConfig.model_validate(dict(section))
        except ValidationError as exc:
            prefix = f"models.{name}.versions.{version}."
            raise config_error(source, validation_problems(exc, source, ModelConfig, prefix=prefix)) from None
        versions = config.versions if version in config.versions else [*config.versions, version]
        fleet_data = self.plan.fleet.model_dump()
        fleet_data["models"] = {**fleet_data["models"], model: dict(section)}
        fleet_data["routes"] = {**fleet_data["routes"], name: {**config.model_dump(), "versions": versions}}
        plan = self._resolve_models(self._validate(fleet_data, source), [model], source)
        self._check_users(model, plan)
        outcome = await self._apply(model, plan)
        if outcome != "unchanged":
            self._set_route(name, plan.fleet.routes[name])
        return outcome

    async def _delete_version(self, name: str, version: str) -> VersionRoute:
        config = self._route_config(name)
        if version not in config.versions:
            raise ModelNotFound(f"model {name!r} has no version {brief(version, 40)}; versions: "
                                f"{', '.join(config.versions)}")
        if (problem := removal_problem(config, version)) is not None:
            raise Conflict(f"model {name!r}: {problem}")
        self._set_route(name, RouteConfig.model_validate({
            **config.model_dump(), "versions": [v for v in config.versions if v != version],
            "traffic": {v: w for v, w in config.traffic.items() if v != version}}))
        await self._remove(deployment_name(name, version), "removed from the fleet")
        log.info("model %s: version %s removed", name, version, extra={"model": name})
        return self.plan.routes[name]

    async def _put_routed(self, name: str, section: dict[str, Any], source: str) -> str:
        """A model with versions, put whole: its versions added, changed or removed, and its route swapped."""
        if name in self._fleet.deployments:
            raise Conflict(f"model {name!r} has no versions: give it versions: in the fleet file and reload")
        if not set(section) & set(ROUTE_KEYS):
            raise Conflict(f"model {name!r} has versions: put its section with versions:, or one version as "
                           f"the model {name}@<version>")
        fleet_data = self.plan.fleet.model_dump()
        fleet_data["models"] = {**{k: v for k, v in fleet_data["models"].items() if split_name(k)[0] != name},
                                name: section}
        fleet_data["routes"] = {k: v for k, v in fleet_data["routes"].items() if k != name}
        fleet = self._validate(fleet_data, source)
        plan = self._resolve_models(fleet, [deployment_name(name, v) for v in fleet.routes[name].versions], source)
        self._check_users(name, plan)
        outcome, _ = await self._apply_route(name, plan, source)
        return outcome

    async def _apply_route(self, name: str, target: FleetPlan, source: str) -> tuple[str, dict[str, str]]:
        """Bring a model with versions to `target`'s: each version added or changed (a failure takes
        back the versions just added and leaves the route as it was), then the route swapped, then
        the versions it no longer has removed. Returns its outcome and each version's."""
        config, current = target.fleet.routes[name], self.plan.fleet.routes.get(name)
        outcomes: dict[str, str] = {}
        for version in config.versions:
            model = deployment_name(name, version)
            plan = replace(self.plan, fleet=self.plan.fleet.model_copy(update={"models": {
                **self.plan.fleet.models, model: target.fleet.models[model]}}),
                models={**self.plan.models, model: target.models[model]})
            try:
                self._check_devices(model, target.fleet, source)
                outcomes[model] = await self._apply(model, plan)
            except Exception:
                for added in (m for m, outcome in outcomes.items() if outcome == "added"):
                    await self._remove(added, f"not added: another version of {name!r} failed")
                raise
        self._set_route(name, config)
        gone = [v for v in (current.versions if current else []) if v not in config.versions]
        for version in gone:
            await self._remove(deployment_name(name, version), "removed from the fleet")
            outcomes[deployment_name(name, version)] = "removed"
        if name in self._fleet.deployments:  # it served without versions until now
            await self._remove(name, "replaced by its versions")
            outcomes[name] = "removed"
        changed = current != config or any(outcome != "unchanged" for outcome in outcomes.values())
        return ("added" if current is None else "changed" if changed else "unchanged"), outcomes

    def _set_route(self, name: str, config: RouteConfig | None) -> None:
        """Swap a name's route whole (None: it has none now); a changed one gets the next generation."""
        routes = {k: v for k, v in self.plan.fleet.routes.items() if k != name or config is not None}
        served = {k: v for k, v in self.plan.routes.items() if k != name}
        if config is not None:
            if self.plan.fleet.routes.get(name) == config and name in self.plan.routes:
                return
            generation = self._route_generations.get(name, 0) + 1
            self._route_generations[name] = generation
            routes[name] = config
            served[name] = version_route(name, config, generation)
        self._replan(replace(self.plan, fleet=self.plan.fleet.model_copy(update={"routes": routes}), routes=served))

    # -- the fleet file ---------------------------------------------------------------------------

    async def reload(self, path: Path) -> ReloadReport:
        """Apply the difference between the fleet file and what serves."""
        async with self._lock:
            target = load_plan(path)
            report = ReloadReport(warnings=self._device_warnings(target.fleet))
            gone = sorted(set(self.plan.pipelines) - set(target.pipelines))  # before the models they use
            self._set_pipelines({k: v for k, v in self.plan.pipelines.items() if k in target.pipelines})
            report.pipelines.update((name, "removed") for name in gone)
            await self._reload_removals(target, report)
            self._replan(replace(self.plan, source=target.source))
            for name in target.models:
                if split_name(name)[0] in target.fleet.routes:
                    continue  # a version: with its route, below
                try:
                    self._check_devices(name, target.fleet, target.source)
                    plan = replace(self.plan, fleet=self.plan.fleet.model_copy(update={"models": {
                        **self.plan.fleet.models, name: target.fleet.models[name]}}),
                        models={**self.plan.models, name: target.models[name]})
                    outcome = await self._apply(name, plan)
                except Exception as exc:  # noqa: BLE001  # one model's failure never stops the others
                    log.error("reload: model %s: %s", name, exc, extra={"model": name})
                    report.errors[name] = str(exc)
                    continue
                getattr(report, outcome).append(name)
                if name in self.plan.routes:  # it had versions; it serves without them now
                    report.removed.extend(await self._drop_route(name, "its model has no versions in the fleet file"))
                    report.routes[name] = "removed"
            await self._reload_routes(target, report)
            self._reload_pipelines(target, report)
            return report

    async def _reload_removals(self, target: FleetPlan, report: ReloadReport) -> None:
        """Remove the models, and the models with versions, whose names the fleet file no longer has.
        A name that changes between with and without versions is replaced later, once the other form serves."""
        names = {split_name(model)[0] for model in target.models}
        for name in [name for name in self.plan.routes if name not in names]:
            report.removed.extend(await self._drop_route(name, "removed from the fleet file"))
            report.routes[name] = "removed"
        for name in sorted(self._fleet.deployments):
            if split_name(name)[1] is None and name not in names:
                await self._remove(name, "removed from the fleet file")
                report.removed.append(name)

    async def _reload_routes(self, target: FleetPlan, report: ReloadReport) -> None:
        for name in target.fleet.routes:
            try:
                outcome, models = await self._apply_route(name, target, target.source)
            except Exception as exc:  # noqa: BLE001  # one model's failure never stops the others
                log.error("reload: model %s: %s", name, exc, extra={"model": name})
                report.errors[name] = str(exc)
                continue
            report.routes[name] = outcome
            for model, model_outcome in models.items():
                getattr(report, model_outcome).append(model)

    def _device_warnings(self, fleet: FleetConfig) -> list[str]:
        warnings = []
        for device, config in fleet.devices.items():
            current = self.plan.fleet.devices.get(device)
            if current is None and device not in self._fleet.schedulers:
                warnings.append(f"device {device} is new: add it with a restart")
            elif current is not None and current != config:
                warnings.append(f"device {device}'s settings changed: they take effect at the next restart")
        return warnings

    def _resolve(self, name: str, section: dict[str, Any], source: str) -> FleetPlan:
        """Validate one model's section against the serving fleet's settings and resolve its plugin."""
        fleet_data = self.plan.fleet.model_dump()
        fleet_data["models"] = {**fleet_data["models"], name: section}
        return self._resolve_models(self._validate(fleet_data, source), [name], source)

    @staticmethod
    def _validate(fleet_data: dict[str, Any], source: str) -> FleetConfig:
        try:
            return FleetConfig.model_validate(fleet_data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, source, FleetConfig)) from exc

    def _resolve_models(self, fleet: FleetConfig, names: list[str], source: str) -> FleetPlan:
        """The serving plan with `fleet` and these of its models' plugins resolved (their devices must serve here)."""
        for name in names:
            self._check_devices(name, fleet, source)
        subset = fleet.model_copy(update={"models": {name: fleet.models[name] for name in names}, "routes": {}})
        registry = PluginRegistry.from_entry_points(only={fleet.models[name].plugin for name in names})
        resolved = resolve_fleet(subset, registry, source)
        return replace(self.plan, fleet=fleet, models={**self.plan.models, **resolved.models})

    def _check_devices(self, name: str, fleet: FleetConfig, source: str) -> None:
        for device in fleet.models[name].instance_devices:
            if device not in self._fleet.schedulers:
                raise ConfigError(f"{source}: models.{name}: device {device} is not serving here "
                                  "(devices start with the process: add it to the fleet file and restart)")

    async def _apply(self, name: str, plan: FleetPlan) -> str:
        current = self._fleet.deployments.get(name)
        wanted = plan.models[name]
        if current is not None and current.config == plan.fleet.models[name] and current.options == wanted.options:
            return "unchanged"
        before = self.plan
        self._replan(replace(self.plan, fleet=self.plan.fleet.model_copy(update={"models": {
            **self.plan.fleet.models, name: plan.fleet.models[name]}}), models={**self.plan.models, name: wanted}))
        generation = self._generations.get(name, 0) + 1
        self._generations[name] = generation
        new = self._build(name, self.plan, generation)
        if current is None:
            self._fleet.apply(Serve(new))
            if not new.on_demand:
                try:
                    await self._load(new)
                except Exception as exc:  # not added: a model that cannot load must not hold readiness down
                    await self._withdraw_added(new, before)
                    raise ModelUnavailable(f"model {name!r} failed to load, and was not added: {exc}") from exc
                new.residency.let_go()
            log.info("model %s added", name, extra={"model": name})
            return "added"
        await self._replace(current, new)
        log.info("model %s changed: generation %d serves", name, generation, extra={"model": name})
        return "changed"

    async def _withdraw_added(self, new: Deployment, before: FleetPlan) -> None:
        """Take back a model just added whose load failed: the fleet is as it was before."""
        self._fleet.apply(Withdraw(new.name, before))
        await self._unload(new, "removed", "not added: its load failed")
        self._fleet.apply(Forget(new))
        log.error("model %s not added: its load failed (%s)", new.name, new.error, extra={"model": new.name})

    async def _replace(self, old: Deployment, new: Deployment) -> None:
        """Swap in a new version with no request failing; fall back to the old one on failure."""
        self._fleet.apply(Stage(new))
        if any(i.loaded for i in old.instances) and not new.on_demand:
            beside = await self._load_beside(new)
            if beside is True:
                self._fleet.apply(Serve(new))
                await self._retire(old, "replaced", "replaced by a new version")
                return
            if beside is not None:  # the new version failed; the old one never stopped serving
                self._fleet.apply(Forget(new))
                raise ModelUnavailable(f"the new version of model {new.name!r} failed to load ({beside}); "
                                       "the old version keeps serving")
        # No room beside the old version (or nothing to keep warm): the old one finishes and goes first.
        self._fleet.apply(Serve(new))
        await self._retire(old, "replaced", "replaced by a new version", forget=False)
        if new.on_demand:
            self._fleet.apply(Forget(old))
            return
        try:
            await self._load(new)
            new.residency.let_go()
        except Exception as exc:
            log.error("model %s: the new version failed to load (%s); bringing the old one back", new.name, exc,
                      extra={"model": new.name})
            self._fleet.apply(Serve(old))
            self._fleet.apply(Forget(new))
            old.residency.allow_loads()
            await self._load(old)
            old.residency.let_go()
            raise ModelUnavailable(f"the new version of model {new.name!r} failed to load ({exc}); "
                                   "the old version serves again") from exc
        self._fleet.apply(Forget(old))

    async def _load_beside(self, new: Deployment) -> bool | str | None:
        """Load the new version's instances while the old one serves. True when done, None when
        there is no room beside the old one, else the error."""
        for instance in new.instances:
            scheduler = self._fleet.schedulers[instance.device]
            ok = await load_instance(new, instance, scheduler, may_wait=True)
            if ok:
                continue
            for loaded in (i for i in new.instances if i.loaded):
                await self._residency.unload_instance(new, loaded, "replaced: not enough room beside the old version")
            if instance.state is InstanceState.UNLOADED:
                return None
            return instance.error or "load failed"
        return True

    async def _retire(self, deployment: Deployment, kind: str, why: str, *, forget: bool = True) -> None:
        """Let a model that no longer takes requests (withdrawn or replaced) answer what it
        accepted, then unload it; with `forget`, it leaves the fleet for good."""
        limit = self._clock() + (deployment.config.queue.timeout_ms + deployment.config.execution.timeout_ms) / 1000
        while deployment.residency.holders > 0 and self._clock() < limit:
            await asyncio.sleep(POLL_S)
        await self._unload(deployment, kind, why)
        if forget:
            self._fleet.apply(Forget(deployment))


def _route_lines(error: RouteProblems | ValidationError, source: str, name: str) -> list[str]:
    """One line per problem of a changed route, under the key the fleet file gives it (`models.{name}.traffic.3`)."""
    found = [error] if isinstance(error, RouteProblems) else [
        e for item in error.errors() if isinstance(e := (item.get("ctx") or {}).get("error"), RouteProblems)]
    if not found:
        return validation_problems(error, source, RouteConfig, prefix=f"models.{name}.")  # type: ignore[arg-type]
    return [f"{source}: models.{name}.{'.'.join(key)}: {message}" for problems in found for key, message in problems.problems]
