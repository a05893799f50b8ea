"""From the fleet file to what each part of the cluster serves: the fleet a device replica runs,
and each model's copy policy."""

from __future__ import annotations

from typing import Any

from router.cluster.placement import CopyPolicy
from router.config import ClusterConfig, DeviceConfig, FleetConfig
from router.errors import ConfigError

__all__ = ["FRONT", "INGRESS", "PLACEMENT", "cluster_of", "copy_policies", "device_deployment", "fleet_document",
           "replica_device", "replica_fleet", "served_models"]

#: The Serve deployments of a cluster application.
PLACEMENT = "placement"
FRONT = "front"
INGRESS = "ingress"


def device_deployment(node_type: str) -> str:
    return f"device-{node_type}"


def cluster_of(fleet: FleetConfig, source: str = "fleet") -> ClusterConfig:
    if fleet.cluster is None:
        raise ConfigError(f"{source}: cluster: missing; add a cluster section (node_types, copies, front) to deploy on Ray")
    return fleet.cluster


def fleet_document(fleet: FleetConfig) -> dict[str, Any]:
    """The fleet as plain data, for Ray to ship to every replica (which validates it again)."""
    return fleet.model_dump(mode="json", exclude_none=True)


def replica_device(fleet: FleetConfig, node_type: str) -> str:
    """The device a replica of this node type drives: its GPU is cuda:0 inside it (Ray sets
    CUDA_VISIBLE_DEVICES to the one it reserved)."""
    return "cuda:0" if cluster_of(fleet).node_types[node_type].device == "cuda" else "cpu"


def served_models(fleet: FleetConfig, node_type: str) -> list[str]:
    listed = cluster_of(fleet).node_types[node_type].models
    return list(fleet.models) if listed is None else [m for m in fleet.models if m in listed]


def replica_fleet(fleet: FleetConfig, node_type: str) -> FleetConfig:
    """What one device replica runs: its node type's models, all on its one device and loaded on
    demand (placement holds the copies that must stay), under its node type's budget."""
    cluster = cluster_of(fleet)
    node = cluster.node_types[node_type]
    device = replica_device(fleet, node_type)
    base = fleet.devices.get(device) or DeviceConfig()
    if node.memory_budget is not None:
        base = base.model_copy(update={"memory_budget": node.memory_budget})
    models = {
        name: fleet.models[name].model_copy(update={"device": device, "devices": None, "residency": "on_demand",
                                                    "required": False})
        for name in served_models(fleet, node_type)
    }
    # Pipelines run in the fronts; a replica serves their steps as models.
    return fleet.model_copy(update={"devices": {device: base}, "models": models, "cluster": None, "pipelines": {},
                                    "routes": {}})


def copy_policies(fleet: FleetConfig) -> dict[str, CopyPolicy]:
    """Each model's copies: the cluster's (or its own) min and max; an always-resident model keeps at least one."""
    cluster = cluster_of(fleet)
    policies = {}
    for name, model in fleet.models.items():
        copies = cluster.copies_of(name)
        types = frozenset(t for t, node in cluster.node_types.items() if node.models is None or name in node.models)
        minimum = max(copies.min, 1 if model.residency == "always" else 0)
        policies[name] = CopyPolicy(min=minimum, max=max(copies.max, minimum),
                                    target_in_flight=cluster.autoscaling.copy_target_in_flight,
                                    idle_s=cluster.autoscaling.copy_idle_s, node_types=types)
    return policies
