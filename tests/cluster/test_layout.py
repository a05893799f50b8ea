"""The cluster section of the fleet file, and what each replica runs (no Ray needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.cluster.layout import copy_policies, replica_fleet
from router.config import load_fleet
from router.errors import ConfigError

FLEET = """
devices:
  cuda:0: {memory_budget: 10GiB, probe: nvml}
models:
  det: {plugin: yolo, device: cuda:0}
  cls: {plugin: resnet, device: cuda:0, residency: on_demand}
cluster:
  node_types:
    gpu: {device: cuda, num_gpus: 0.5, replicas: {min: 1, max: 4}, memory_budget: 20GiB}
    cpu: {device: cpu, num_gpus: 0, num_cpus: 4, resources: {cpu_host: 1}, models: [cls]}
  copies: {max: 3}
  models: {cls: {min: 2, max: 2}}
"""


def test_a_replica_runs_its_node_types_models_on_demand_on_its_one_device(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET)
    fleet = load_fleet(path)
    gpu = replica_fleet(fleet, "gpu")
    assert list(gpu.devices) == ["cuda:0"] and gpu.devices["cuda:0"].memory_budget == 20 * 2**30
    assert gpu.devices["cuda:0"].probe == "nvml"
    assert {m.residency for m in gpu.models.values()} == {"on_demand"} and gpu.cluster is None
    cpu = replica_fleet(fleet, "cpu")
    assert list(cpu.models) == ["cls"] and cpu.models["cls"].instance_devices == ["cpu"]
    policies = copy_policies(fleet)
    assert (policies["det"].min, policies["det"].max) == (1, 3)  # always-resident: at least one copy
    assert (policies["cls"].min, policies["cls"].max) == (2, 2)
    assert policies["cls"].node_types == frozenset({"gpu", "cpu"}) and policies["det"].node_types == frozenset({"gpu"})


@pytest.mark.parametrize(("section", "fragment"), [
    ("cluster: {node_types: {gpu: {replicas: {min: 3, max: 2}}}}",
     "cluster.node_types.gpu.replicas: min 3 is above max 2; accepted: min <= max"),
    ("cluster: {node_types: {gpu: {device: cpu, num_gpus: 1}}}", "device cpu takes num_gpus: 0, got 1.0"),
    ("cluster: {models: {nope: {min: 1}}}", "cluster.models: no model named 'nope'; models: m"),
    ("cluster: {front: {prot: 1}}", "cluster.front.prot: unknown key; accepted: host, port, replicas"),
    ("cluster: {node_types: {}}", "node_types is empty"),
])
def test_cluster_errors_are_one_line_naming_the_key(tmp_path: Path, section: str, fragment: str) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("models:\n  m: {plugin: toy}\n" + section + "\n")
    with pytest.raises(ConfigError) as caught:
        load_fleet(path)
    assert fragment in str(caught.value)

