"""The fleet's state: the plan it serves, which deployments serve, on which device schedulers, and
the old deployments still draining. One writer, one verb: every change is a `FleetChange` value
given to `FleetState.apply`, which applies it whole and returns the fleet's new generation.

The runtime builds it, the fleet editor changes it (add, replace, remove a model; a new plan for
pipelines and routes), and the residency executor looks instances up in it; everyone else reads
the mappings it hands out, which are read-only views (a write through one raises `TypeError`).
Readers that copy the fleet elsewhere (a split host's fronts) compare generations, not contents:
a copy whose generation is the state's is current.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from router.scheduling.scheduler import DeviceScheduler
from router.serving.deployment import Deployment, find_deployment
from router.serving.instance import ModelInstance

if TYPE_CHECKING:
    from router.serving.plan import FleetPlan

__all__ = ["FleetChange", "FleetState", "Forget", "Replan", "Serve", "Stage", "Withdraw"]

log = logging.getLogger("router.serving.fleet_state")


@dataclass(frozen=True)
class Stage:
    """The deployment joins its devices' schedulers, to load before it serves (or, at start, once
    the devices run). Serving nothing yet."""

    deployment: Deployment


@dataclass(frozen=True)
class Serve:
    """The deployment serves its name from now on (staged if it was not). The one it replaces
    stops taking requests and drains, still findable by its instances, until it is forgotten."""

    deployment: Deployment


@dataclass(frozen=True)
class Withdraw:
    """The model called `name` serves no more (new requests get 404) and drains until forgotten.
    With `plan`, the plan without it, in the same change."""

    name: str
    plan: FleetPlan | None = None


@dataclass(frozen=True)
class Forget:
    """A deployment that serves no more leaves its schedulers and is no longer found."""

    deployment: Deployment


@dataclass(frozen=True)
class Replan:
    """The fleet plan (the models' sections, the pipelines, the routes) replaced whole."""

    plan: FleetPlan


FleetChange = Stage | Serve | Withdraw | Forget | Replan


class FleetState:
    """The plan, deployments by name, schedulers by device, devices that failed to start, the
    deployments draining; and the generation, which every change advances by one."""

    def __init__(self, plan: FleetPlan) -> None:
        self._plan = plan
        self._generation = 0
        self._deployments: dict[str, Deployment] = {}
        self._schedulers: dict[str, DeviceScheduler] = {}
        self._device_errors: dict[str, str] = {}
        self._retired: dict[str, tuple[Deployment, ModelInstance]] = {}  # by instance key
        self._attached: set[str] = set()  # instance keys on their device's scheduler

    # -- reading ------------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """How many changes were applied: equal generations, equal fleets."""
        return self._generation

    @property
    def plan(self) -> FleetPlan:
        return self._plan

    @property
    def deployments(self) -> Mapping[str, Deployment]:
        return MappingProxyType(self._deployments)

    @property
    def schedulers(self) -> Mapping[str, DeviceScheduler]:
        return MappingProxyType(self._schedulers)

    @property
    def device_errors(self) -> Mapping[str, str]:
        return MappingProxyType(self._device_errors)

    def get(self, name: str) -> Deployment:
        """The model called `name`; ModelNotFound (404) listing the models there are."""
        return find_deployment(self._deployments, name)

    def __iter__(self) -> Iterator[Deployment]:
        return iter(list(self._deployments.values()))

    def find_instance(self, key: str) -> tuple[Deployment, ModelInstance]:
        """An instance by key, in a serving deployment or a retired one still draining."""
        for deployment in self._deployments.values():
            for instance in deployment.instances:
                if instance.key == key:
                    return deployment, instance
        if key in self._retired:
            return self._retired[key]
        raise KeyError(f"no instance {key!r}")

    def scheduler_of(self, instance: ModelInstance) -> DeviceScheduler | None:
        return self._schedulers.get(instance.device)

    def notify(self, deployment: Deployment) -> None:
        """Wake the schedulers of the model's devices (a ticket arrived, its residency may need a decision)."""
        for device in {i.device for i in deployment.instances}:
            scheduler = self._schedulers.get(device)
            if scheduler is not None:
                scheduler.notify()

    # -- devices (at start, before any deployment is staged) ------------------------------------

    def add_device(self, device: str, scheduler: DeviceScheduler) -> None:
        self._schedulers[device] = scheduler

    def device_failed(self, device: str, error: str) -> None:
        self._device_errors[device] = error

    # -- changes ----------------------------------------------------------------------------------

    def apply(self, change: FleetChange) -> int:
        """Apply one change whole; the fleet's generation after it. Withdrawing a model that does
        not serve raises ModelNotFound and changes nothing."""
        match change:
            case Stage(deployment):
                self._stage(deployment)
            case Serve(deployment):
                self._stage(deployment)
                replaced = self._deployments.get(deployment.name)
                self._deployments[deployment.name] = deployment
                for instance in deployment.instances:  # serving again after a failed replacement
                    self._retired.pop(instance.key, None)
                if replaced is not None and replaced is not deployment:
                    self._retire(replaced)
            case Withdraw(name, plan):
                self._retire(self._deployments.pop(self.get(name).name))
                if plan is not None:
                    self._plan = plan
            case Forget(deployment):
                if self._deployments.get(deployment.name) is deployment:
                    raise ValueError(f"model {deployment.name!r} serves: withdraw or replace it before forgetting it")
                for instance in deployment.instances:
                    scheduler = self._schedulers.get(instance.device)
                    if scheduler is not None and instance.key in self._attached:
                        scheduler.detach(instance)
                    self._attached.discard(instance.key)
                    self._retired.pop(instance.key, None)
            case Replan(plan):
                self._plan = plan
        self._generation += 1
        return self._generation

    def _stage(self, deployment: Deployment) -> None:
        """Give each instance to its device's scheduler once (a device that failed to start has none)."""
        for instance in deployment.instances:
            scheduler = self._schedulers.get(instance.device)
            if scheduler is not None and instance.key not in self._attached:
                scheduler.attach(deployment, instance)
                self._attached.add(instance.key)

    def _retire(self, deployment: Deployment) -> None:
        """Keep a deployment that no longer serves findable by its instances while it drains."""
        for instance in deployment.instances:
            self._retired[instance.key] = (deployment, instance)
