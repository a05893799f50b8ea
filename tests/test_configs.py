"""The fleet files in config/, the ones a newcomer starts from: `model-router check` accepts every
one of them, and the cluster fleet is the default fleet plus a cluster section that fits the
one-node Ray head its comments start.

`check` parses the file and every model's plugin options against the installed plugins; it opens
no device and loads no weights, so config/fleet.gpu.yaml is checked here, without a GPU, too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from router.cli import main
from tests.conftest import REPO

CONFIGS = sorted((REPO / "config").glob("*.yaml"))


def test_config_holds_the_default_the_gpu_and_the_cluster_fleet() -> None:
    assert {path.name for path in CONFIGS} >= {"fleet.yaml", "fleet.gpu.yaml", "fleet.cluster.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=[path.name for path in CONFIGS])
def test_model_router_check_accepts_every_file_in_config(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--config", str(path)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"{path} is valid" in err


def _load(name: str) -> dict[str, object]:
    document = yaml.safe_load((REPO / "config" / name).read_text(encoding="utf-8"))
    assert isinstance(document, dict)
    return document


def test_the_cluster_fleet_serves_the_default_fleet_unchanged() -> None:
    default, cluster = _load("fleet.yaml"), _load("fleet.cluster.yaml")
    assert "cluster" not in default and "cluster" in cluster
    assert {key: value for key, value in cluster.items() if key != "cluster"} == default


def test_the_cluster_fleet_fits_the_ray_head_its_comments_start() -> None:
    text = (REPO / "config" / "fleet.cluster.yaml").read_text(encoding="utf-8")
    head = re.search(r"ray start --head --num-cpus=(\d+)", text)
    assert head is not None, "the file should say how to start the Ray head it is sized for"
    cluster = _load("fleet.cluster.yaml")["cluster"]
    assert isinstance(cluster, dict)
    front, nodes = cluster["front"], cluster["node_types"]
    wanted = front["num_cpus"] * front["replicas"] + sum(n["num_cpus"] * n["replicas"]["max"] for n in nodes.values())
    assert wanted <= int(head.group(1)), f"the replicas want {wanted} CPUs of the head's {head.group(1)}"
    assert all(n.get("num_gpus", 1) == 0 and n["device"] == "cpu" for n in nodes.values()), "no GPU on that head"
    assert "model-router cluster deploy --config config/fleet.cluster.yaml" in text
