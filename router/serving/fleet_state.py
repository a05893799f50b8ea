"""The fleet's state: which deployments serve, on which device schedulers, and the old generations
still draining. One writer: every change is one of the methods below.

The runtime builds it, the fleet editor adds, replaces and removes models through it, and the
residency executor looks instances up in it; everyone else reads the mappings it hands out,
which are read-only views (a write through one raises `TypeError`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from types import MappingProxyType

from router.scheduling.scheduler import DeviceScheduler
from router.serving.deployment import Deployment, find_deployment
from router.serving.instance import ModelInstance

__all__ = ["FleetState"]

log = logging.getLogger("router.serving.fleet_state")


class FleetState:
    """Deployments by name, schedulers by device, devices that failed to start, retired generations."""

    def __init__(self) -> None:
        self._deployments: dict[str, Deployment] = {}
        self._schedulers: dict[str, DeviceScheduler] = {}
        self._device_errors: dict[str, str] = {}
        self._retired: dict[str, tuple[Deployment, ModelInstance]] = {}  # by instance key

    # -- reading ------------------------------------------------------------------------------

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

    # -- devices ------------------------------------------------------------------------------

    def add_device(self, device: str, scheduler: DeviceScheduler) -> None:
        self._schedulers[device] = scheduler

    def device_failed(self, device: str, error: str) -> None:
        self._device_errors[device] = error

    # -- deployments ----------------------------------------------------------------------------

    def put(self, deployment: Deployment) -> Deployment | None:
        """Serve `deployment` under its name from now on; returns the one it replaces, if any."""
        previous = self._deployments.get(deployment.name)
        self._deployments[deployment.name] = deployment
        return previous

    def remove(self, name: str) -> Deployment:
        """Stop serving the model called `name` (ModelNotFound if none): new requests get 404."""
        return self._deployments.pop(self.get(name).name)

    def attach(self, deployment: Deployment) -> None:
        """Give each instance to its device's scheduler (a device that failed to start has none)."""
        for instance in deployment.instances:
            scheduler = self._schedulers.get(instance.device)
            if scheduler is not None:
                scheduler.attach(deployment, instance)

    def detach(self, deployment: Deployment) -> None:
        """Take the instances away from their schedulers and forget them for good."""
        for instance in deployment.instances:
            scheduler = self._schedulers.get(instance.device)
            if scheduler is not None:
                scheduler.detach(instance)
            self._retired.pop(instance.key, None)

    def retire(self, deployment: Deployment) -> None:
        """Keep an old generation findable while it drains after being replaced or removed."""
        for instance in deployment.instances:
            self._retired[instance.key] = (deployment, instance)

    def notify(self, deployment: Deployment) -> None:
        """Wake the schedulers of the model's devices (a ticket arrived, its residency may need a decision)."""
        for device in {i.device for i in deployment.instances}:
            scheduler = self._schedulers.get(device)
            if scheduler is not None:
                scheduler.notify()
