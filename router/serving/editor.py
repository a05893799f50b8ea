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
- `reload`: the difference between the fleet file and what serves, applied model by model, then
  pipeline by pipeline.

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

from router.config import FleetConfig, format_validation_error
from router.errors import ConfigError, Conflict, ModelDoesNotFit, ModelNotFound, ModelUnavailable, brief
from router.scheduling.queue import reject
from router.serving.deployment import Deployment
from router.serving.fleet_state import FleetState
from router.serving.instance import InstanceState
from router.serving.loading import load_instance
from router.serving.plan import FleetPlan, PipelinePlan, load_plan, pipeline_transforms, resolve_fleet, resolve_pipelines
from router.serving.registry import PluginRegistry
from router.serving.residency_executor import ResidencyExecutor, UnloadReport

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


class FleetEditor:
    """The fleet editor: the admin verbs. They change the fleet (through `FleetState`'s methods)
    and drive the residency executor."""

    def __init__(
        self,
        plan: FleetPlan,
        fleet: FleetState,
        residency: ResidencyExecutor,
        build: Builder,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.plan = plan
        self._fleet = fleet
        self._residency = residency
        self._build = build
        self._clock = clock
        self._lock = asyncio.Lock()
        self._generations = {d.name: d.generation for d in fleet}

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
        """Add or change one model from its fleet-file section. Returns added, changed or unchanged."""
        async with self._lock:
            if name in self.plan.pipelines:
                raise Conflict(f"a pipeline is named {name!r}; models and pipelines share one name: choose another")
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
        async with self._lock:
            if users := self.plan.users_of(self._deployment(name).name):
                raise Conflict(f"model {name!r} is used by pipeline(s) {', '.join(users)}: delete them "
                               "(DELETE /pipelines/{name}) or change them first")
            deployment = self._fleet.remove(self._deployment(name).name)
            self.plan = replace(self.plan, models={k: v for k, v in self.plan.models.items() if k != name},
                                fleet=self.plan.fleet.model_copy(update={"models": {
                                    k: v for k, v in self.plan.fleet.models.items() if k != name}}))
            await self._retire(deployment, "removed", "removed from the fleet")

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
            self.plan = replace(self.plan, fleet=fleet, pipelines=pipelines)
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
        self.plan = replace(self.plan, fleet=fleet, pipelines=pipelines)

    def _reload_pipelines(self, target: FleetPlan, report: ReloadReport) -> None:
        """The file's pipelines whose models all serve; the others are reported, not served."""
        served = {}
        for name, plan in target.pipelines.items():
            missing = [m for m in plan.models if m not in self._fleet.deployments]
            if missing:
                report.pipelines[name] = f"not served: model(s) {', '.join(missing)} did not come in"
                continue
            current = self.plan.pipelines.get(name)
            report.pipelines[name] = ("added" if current is None else
                                      "unchanged" if current.config == plan.config else "changed")
            served[name] = plan
        self._set_pipelines(served)

    # -- the fleet file ---------------------------------------------------------------------------

    async def reload(self, path: Path) -> ReloadReport:
        """Apply the difference between the fleet file and what serves."""
        async with self._lock:
            target = load_plan(path)
            report = ReloadReport(warnings=self._device_warnings(target.fleet))
            gone = sorted(set(self.plan.pipelines) - set(target.pipelines))  # before the models they use
            self._set_pipelines({k: v for k, v in self.plan.pipelines.items() if k in target.pipelines})
            report.pipelines.update((name, "removed") for name in gone)
            for name in sorted(set(self._fleet.deployments) - set(target.models)):
                deployment = self._fleet.remove(name)
                await self._retire(deployment, "removed", "removed from the fleet file")
                report.removed.append(name)
            self.plan = replace(self.plan, source=target.source, models={
                k: v for k, v in self.plan.models.items() if k in target.models})
            for name in target.models:
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
            self._reload_pipelines(target, report)
            return report

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
        try:
            fleet = FleetConfig.model_validate(fleet_data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, source, FleetConfig)) from exc
        self._check_devices(name, fleet, source)
        subset = fleet.model_copy(update={"models": {name: fleet.models[name]}})
        registry = PluginRegistry.from_entry_points(only={fleet.models[name].plugin})
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
        self.plan = replace(self.plan, fleet=self.plan.fleet.model_copy(update={"models": {
            **self.plan.fleet.models, name: plan.fleet.models[name]}}), models={**self.plan.models, name: wanted})
        generation = self._generations.get(name, 0) + 1
        self._generations[name] = generation
        new = self._build(name, self.plan, generation)
        self._fleet.attach(new)
        if current is None:
            self._fleet.put(new)
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
        self._fleet.remove(new.name)
        self.plan = before
        await self._unload(new, "removed", "not added: its load failed")
        self._fleet.detach(new)
        log.error("model %s not added: its load failed (%s)", new.name, new.error, extra={"model": new.name})

    async def _replace(self, old: Deployment, new: Deployment) -> None:
        """Swap in a new version with no request failing; fall back to the old one on failure."""
        self._fleet.retire(old)
        if any(i.loaded for i in old.instances) and not new.on_demand:
            beside = await self._load_beside(new)
            if beside is True:
                self._fleet.put(new)
                await self._retire(old, "replaced", "replaced by a new version")
                return
            if beside is not None:  # the new version failed; the old one never stopped serving
                self._fleet.detach(new)
                raise ModelUnavailable(f"the new version of model {new.name!r} failed to load ({beside}); "
                                       "the old version keeps serving")
        # No room beside the old version (or nothing to keep warm): the old one finishes and goes first.
        self._fleet.put(new)
        await self._retire(old, "replaced", "replaced by a new version", detach=False)
        if new.on_demand:
            self._fleet.detach(old)
            return
        try:
            await self._load(new)
            new.residency.let_go()
        except Exception as exc:
            log.error("model %s: the new version failed to load (%s); bringing the old one back", new.name, exc,
                      extra={"model": new.name})
            self._fleet.put(old)
            self._fleet.detach(new)
            old.residency.allow_loads()
            await self._load(old)
            old.residency.let_go()
            raise ModelUnavailable(f"the new version of model {new.name!r} failed to load ({exc}); "
                                   "the old version serves again") from exc
        self._fleet.detach(old)

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

    async def _retire(self, deployment: Deployment, kind: str, why: str, *, detach: bool = True) -> None:
        """Let a model that no longer takes requests answer what it accepted, then unload it."""
        self._fleet.retire(deployment)
        limit = self._clock() + (deployment.config.queue.timeout_ms + deployment.config.execution.timeout_ms) / 1000
        while deployment.residency.holders > 0 and self._clock() < limit:
            await asyncio.sleep(POLL_S)
        await self._unload(deployment, kind, why)
        if detach:
            self._fleet.detach(deployment)
