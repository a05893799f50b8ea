"""The live page's routes and data, in process: the page and its files are open and ship with the
package; /ui/state is guarded like /models and follows the runtime and the metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from router.http.app import create_app
from router.http.auth import AccessPolicy
from tests.test_runtime import make_runtime

KEY = "state-test-key-0123456789"
FLEET = """
models:
  m: {plugin: scripted, options: {fixed_ms: 20}, batch: {max_size: 4, max_delay_ms: 20}}
  broken: {plugin: scripted, required: false, options: {load_error: "no weights"}}
"""


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient[Any]]:
    """The app in process; its lifespan (and the runtime) run on the test client's own event loop."""
    runtime = make_runtime(tmp_path, FLEET)
    app = create_app(runtime, access_policy=AccessPolicy(predict_keys=(KEY.encode(),)))
    with TestClient(app=app) as client:
        deadline = time.monotonic() + 30
        while not runtime.ready or not runtime.model("broken").error:
            assert time.monotonic() < deadline, "models did not load"
            time.sleep(0.05)
        yield client


def test_the_page_and_its_files_are_open_and_strict(client: TestClient[Any]) -> None:
    page = client.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/ui/static/ui.js"' in page.text and "http" not in page.text.split("<body>")[0]
    script = client.get("/ui/static/ui.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert client.get("/ui/static/ui.css").status_code == 200
    assert client.get("/ui/static/secrets.txt").status_code == 404


def test_state_needs_a_key_like_models(client: TestClient[Any]) -> None:
    assert client.get("/ui/state").status_code == 401
    assert client.get("/models").status_code == 401
    assert client.get("/ui/state", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_state_follows_the_runtime(client: TestClient[Any]) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda i: client.post("/models/m/predict", json={"id": f"r{i}"}, headers=auth), range(6)))
    assert [a.status_code for a in answers] == [200] * 6
    assert (client.post("/models/m/predict", content=b"{", headers={**auth, "Content-Type": "application/json"})
            ).status_code == 400
    state = client.get("/ui/state", headers=auth).json()
    listed = {m["name"]: m for m in client.get("/models", headers=auth).json()["models"]}
    models = {m["name"]: m for m in state["models"]}
    m = models["m"]
    assert m["requests"] == listed["m"]["requests"] == {"ok": 6, "bad_input": 1}
    assert m["within_deadline"] == 6 and m["state"] == "ready" and m["queue"] == {"depth": 0, "capacity": 64,
                                                                                  "timeout_ms": 10_000}
    latency, batches = m["histograms"]["latency"], m["histograms"]["batch_size"]
    assert latency["count"] == 6 and len(latency["counts"]) == len(state["buckets"]["latency"]) + 1
    assert sum(i["batches"] for i in m["instances"]) == batches["count"] < 6  # batched
    assert models["broken"]["state"] == "failed" and models["broken"]["histograms"]["latency"] is None
    (device,) = state["devices"]
    assert device["name"] == "cpu" and device["weights_bytes"] == 1_000_000 and device["budget_bytes"] > 0
    assert device["high_watermark"] == 0.9 and device["paused"] is False and device["probe_errors"] == 0


def test_a_dynamic_fleets_fields_pass_through(client: TestClient[Any]) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    state = client.get("/ui/state", headers=auth).json()
    listed = {m["name"]: m for m in client.get("/models", headers=auth).json()["models"]}
    m = next(model for model in state["models"] if model["name"] == "m")
    assert m["residency"] == listed["m"]["residency"]
    assert m["residency"]["mode"] == "always" and m["residency"]["resident"] is True
