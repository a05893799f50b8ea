"""A rollout on a split host: the fronts route and observe, the engine owns the rollout and decides.

Two fronts serve a model whose candidate version fails a fifth of its items; every front sends what
it saw to the engine, whose rollout rolls the candidate back; the users see no failure, since the
stable version answers each item the candidate failed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_split_host import serve_split, until

pytestmark = [pytest.mark.e2e]

FLEET = """
models:
  m:
    plugin: scripted
    batch: {max_size: 4, max_delay_ms: 2}
    versions:
      "1": {options: {label: a}}
      "2": {options: {label: a, fail: marked}}
    rollout: {candidate: "2", steps: [20, 100], step_min_s: 0, min_samples: 40}
"""
LIMIT = 3000  # requests at most: the rule decides within a few hundred


def rollout_of(url: str) -> dict[str, Any]:
    answer = httpx.get(f"{url}/models/m", timeout=30)
    assert answer.status_code == 200, answer.text
    return dict(answer.json()["rollout"] or {})


def test_the_engine_rolls_back_a_failing_candidate_from_every_front_s_observations(tmp_path: Path) -> None:
    with serve_split(tmp_path, FLEET) as server:
        assert rollout_of(server.url)["status"] == "running"
        statuses: list[int] = []
        versions: set[str] = set()
        for i in range(LIMIT):
            # A new connection each: the kernel spreads them over both fronts.
            with httpx.Client(base_url=server.url, timeout=30) as client:
                body = json.dumps({"id": f"fail-{i}" if i % 5 == 0 else f"ok-{i}"})
                answer = client.post("/models/m/predict", content=body, headers={"content-type": "application/json"})
            statuses.append(answer.status_code)
            versions.add(answer.headers.get("x-model-version", ""))
            if i % 20 == 19 and rollout_of(server.url).get("status") != "running":
                break
        until(lambda: rollout_of(server.url).get("status") == "rolled_back", what="the rollback")
        ended = rollout_of(server.url)
        assert ended["decisions"] == {"rollback": 1} and ended["step"] == 0, ended
        assert set(statuses) == {200}, f"a user saw {sorted(set(statuses))}"  # the stable version answered
        assert versions <= {"1", "2"} and "1" in versions
        decided = [r for r in server.log_records() if str(r.get("message", "")).startswith("rollout of m: rollback")]
        assert [r.get("role") for r in decided] == ["engine"], decided  # decided once, where the routes are
        served_by = {r.get("role") for r in server.log_records() if r.get("path") == "/models/m/predict"}
        assert served_by == {"front 1", "front 2"}, served_by  # both fronts observed for the one rollout
        until(lambda: 'model_router_route_weight{model="m",version="2"} 0.0' in httpx.get(f"{server.url}/metrics").text,
              what="the split back on the stable version")
