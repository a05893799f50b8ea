"""Pipelines on a cluster's front, no Ray needed: the front's pipeline runner sends each step to a
replica like any request, the crops' pixels and how they wait with them. The replicas here are a
runtime in this process behind the same `ReplicaCalls` interface Ray's handles implement."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from router.cluster.front import ClusterRuntime, PredictCall
from router.cluster.layout import replica_fleet
from router.cluster.reports import ErrorReply, ReplicaReport, Reply, model_loads
from router.config import load_fleet
from router.errors import DeadlineExceeded, InputError, RouterError
from router.pipelines import PipelineRunner
from router.sdk.plugin import Payload
from router.serving.facade import Serving
from router.serving.runtime import Runtime
from tests.test_pipelines import fleet, jpeg
from tests.test_runtime import make_runtime, running

CLUSTER = """
cluster:
  node_types:
    cpu: {device: cpu, num_gpus: 0, num_cpus: 1, replicas: {min: 1, max: 1}}
"""


class InProcessReplica:
    """`ReplicaCalls` over one runtime: what a device replica does with a call, and what it was sent."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.calls: list[PredictCall] = []

    async def predict(self, node_type: str, call: PredictCall, avoid: tuple[str, ...], wait_s: float) -> Reply:
        self.calls.append(call)
        payload = Payload(call.body, call.media_type, call.filename, pixels=call.pixels)
        try:
            answer = await self.runtime.submit(call.model, payload, priority=call.priority, timeout_ms=call.timeout_ms,
                                               request_id=call.request_id, wait_for_room=call.wait_for_room,
                                               must_finish=call.must_finish, shadow=call.shadow)
        except RouterError as exc:
            return Reply("r1", error=ErrorReply.of(exc))
        return Reply("r1", answer=answer)

    async def view(self) -> list[ReplicaReport]:
        models = self.runtime.models()
        return [ReplicaReport("r1", "cpu", "node", os.getpid(), "cpu", 1 << 30, 1 << 30, False, model_loads(models),
                              tuple(models), tuple(self.runtime.devices()), at=time.time())]

    async def admin(self, verb: str, model: str) -> None:
        raise AssertionError("not asked here")


async def test_a_clusters_front_runs_the_fleets_pipelines_through_its_replicas(tmp_path: Path) -> None:
    text = fleet(tmp_path / "r.jsonl") + CLUSTER
    (tmp_path / "cluster.yaml").write_text(text, encoding="utf-8")
    config = load_fleet(tmp_path / "cluster.yaml")
    assert replica_fleet(config, "cpu").pipelines == {}  # a replica serves the steps as models
    async with running(make_runtime(tmp_path, text.replace(CLUSTER, ""))) as runtime:
        replica = InProcessReplica(runtime)
        front = Serving(ClusterRuntime(config, replica))
        await front.core.refresh()
        runner = PipelineRunner(front)
        assert [p.name for p in front.pipelines()] == ["dc"] and runner.info("dc").state == "ready"
        answer = await runner.run("dc", jpeg(64, 48))
        assert [d["pixels"]["width"] for d in answer.output["detections"]] == [10, 20, 40]
        entry, *crops = replica.calls
        assert entry.model == "boxes" and entry.body and entry.pixels is not None and not entry.wait_for_room
        assert {c.model for c in crops} == {"pixels"} and all(c.wait_for_room and c.must_finish for c in crops)
        assert [c.pixels.shape[:2] for c in crops] == [(10, 10), (20, 20), (28, 40)] and not any(c.body for c in crops)
        with pytest.raises(InputError, match="deploying it again"):
            await front.put_pipeline("dc", {"steps": [{"model": "boxes"}]})


async def test_a_step_the_replica_cannot_finish_is_504_through_the_front(tmp_path: Path) -> None:
    text = fleet(tmp_path / "r.jsonl", pixels="fixed_ms: 1500", timeout_ms=1000) + CLUSTER
    (tmp_path / "cluster.yaml").write_text(text, encoding="utf-8")
    async with running(make_runtime(tmp_path, text.replace(CLUSTER, ""))) as runtime:
        front = Serving(ClusterRuntime(load_fleet(tmp_path / "cluster.yaml"), InProcessReplica(runtime)))
        await front.core.refresh()
        with pytest.raises(DeadlineExceeded, match="step 2:pixels: model 'pixels' cannot answer before the deadline"):
            await PipelineRunner(front).run("dc", jpeg(64, 48))
    assert runtime.model("pixels").requests == {"deadline": 3}
