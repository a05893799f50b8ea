"""Versions on a cluster's front, no Ray needed: the front routes each request (split, pin, sticky
key, fallback, shadow copies) and the replicas serve each version as a model of its own."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

from router.cluster.front import ClusterRuntime
from router.cluster.layout import replica_fleet
from router.config import load_fleet
from router.pipelines import PipelineRunner
from router.sdk.plugin import Payload
from router.serving.facade import Serving
from router.serving.traffic import TrafficChange
from tests.cluster.test_front_pipelines import CLUSTER, InProcessReplica
from tests.test_runtime import make_runtime, running

FLEET = """
models:
  m:
    plugin: scripted
    batch: {max_size: 1}
    versions:
      "1": {options: {label: a}}
      "2": {options: {label: a, fail: marked}}
    traffic: {"1": 80, "2": 20}
"""


def ask(ident: str) -> Payload:
    return Payload(json.dumps({"id": ident}).encode(), "application/json")


async def test_a_cluster_front_routes_a_model_s_versions_through_its_replicas(tmp_path: Path) -> None:
    (tmp_path / "cluster.yaml").write_text(FLEET + CLUSTER, encoding="utf-8")
    config = load_fleet(tmp_path / "cluster.yaml")
    assert set(replica_fleet(config, "cpu").models) == {"m@1", "m@2"}  # a replica serves each version as a model
    async with running(make_runtime(tmp_path, FLEET)) as runtime:
        replica = InProcessReplica(runtime)
        front = Serving(ClusterRuntime(config, replica))
        await front.core.refresh()
        versions = PipelineRunner(front).versions
        versions.draw = random.Random(3).random
        seen = Counter([(await versions.submit("m", ask(f"r{i}"))).model for i in range(200)])
        assert abs(seen["m@2"] - 40) <= 4.5 * (200 * 0.2 * 0.8) ** 0.5 and set(seen) == {"m@1", "m@2"}
        assert (await versions.submit("m", ask("p"), version="2")).model == "m@2"
        sticky = {(await versions.submit("m", ask("s"), route_key="k-1")).model for _ in range(5)}
        assert len(sticky) == 1
        # A candidate's failure is answered by the stable version, through the replicas.
        route = await front.set_traffic("m", TrafficChange(weights={"1": 0, "2": 100}))
        assert route.generation == 2 and front.routes()["m"] is route
        answer = await versions.submit("m", ask("fail-1"))
        assert answer.model == "m@1" and answer.input_info["fallback_from"] == "m"
        assert [c.model for c in replica.calls[-2:]] == ["m@2", "m@1"]
        assert front.model("m@1").name == "m@1"
