"""The live page's routes and data, in process: the page and its files are open and ship with the
package; /ui/state is guarded like /models and follows the runtime and the metrics, models with
versions included."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from prometheus_client import Counter, Summary

from router.http.app import create_app
from router.http.auth import AccessPolicy
from router.http.metrics import RouterMetrics
from router.http.ui.state import route_states
from router.serving.versions import VersionRoute
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


VERSIONED = """
models:
  v:
    plugin: scripted
    options: {fixed_ms: 5}
    versions: {"1": {}, "2": {}}
    traffic: {"1": 90, "2": 10}
    mirror: {version: "2", percent: 100}
  plain: {plugin: scripted, options: {fixed_ms: 5}}
"""


def test_state_lists_each_model_with_versions(tmp_path: Path) -> None:
    runtime = make_runtime(tmp_path, VERSIONED)
    with TestClient(app=create_app(runtime)) as client:
        deadline = time.monotonic() + 30
        while not runtime.ready:
            assert time.monotonic() < deadline, "models did not load"
            time.sleep(0.05)
        state = client.get("/ui/state").json()
    (route,) = state["routes"]
    assert {key: route[key] for key in ("name", "stable", "weights", "mirror", "rollout")} == {
        "name": "v", "stable": "1", "weights": {"1": 90.0, "2": 10.0}, "mirror": {"version": "2", "percent": 100.0},
        "rollout": None}
    assert [(v["version"], v["deployment"], v["weight"], v["stable"], v["mirror"]) for v in route["versions"]] == [
        ("1", "v@1", 90.0, True, False), ("2", "v@2", 10.0, False, True)]
    assert {m["name"] for m in state["models"]} == {"v@1", "v@2", "plain"}


class _Routes:
    """A serving core with one routed name, as route_states reads it."""

    def __init__(self, rollout: dict[str, Any] | None) -> None:
        self._rollout = rollout

    def routes(self) -> dict[str, VersionRoute]:
        return {"r": VersionRoute("r", ("1", "2"), "1", {"1": 75.0, "2": 25.0}, mirror="2", mirror_percent=50.0,
                                  generation=3)}

    def rollout(self, name: str) -> dict[str, Any] | None:
        return self._rollout if name == "r" else None


def _metric(metrics: RouterMetrics, attribute: str, kind: Any, name: str, labels: list[str]) -> Any:
    """The router's metric `attribute`, or one of the same name and labels in its registry."""
    metric = getattr(metrics, attribute, None)
    if metric is None:
        metric = kind(name, "stand-in", labels, registry=metrics.registry)
        setattr(metrics, attribute, metric)
    return metric


def test_route_states_read_the_version_metrics() -> None:
    metrics = RouterMetrics()
    requests = _metric(metrics, "version_requests", Counter, "model_router_version_requests",
                       ["model", "version", "outcome"])
    agreement = _metric(metrics, "version_agreement", Summary, "model_router_version_agreement",
                        ["model", "version", "against"])
    mirrored = _metric(metrics, "mirror_requests", Counter, "model_router_mirror_requests", ["model", "outcome"])
    requests.labels(model="r", version="1", outcome="ok").inc(7)
    requests.labels(model="r", version="2", outcome="ok").inc(2)
    requests.labels(model="r", version="2", outcome="error").inc()
    requests.labels(model="other", version="2", outcome="ok").inc(5)
    for value in (1.0, 0.0, 1.0, 1.0):
        agreement.labels(model="r", version="2", against="1").observe(value)
    mirrored.labels(model="r@2", outcome="served").inc(3)
    mirrored.labels(model="r@2", outcome="shed").inc()
    mirrored.labels(model="r@1", outcome="served").inc(2)
    rollout = {"candidate": "2", "status": "running", "step": 1, "steps": [5.0, 25.0, 50.0, 100.0]}
    (route,) = route_states(_Routes(rollout), metrics)  # type: ignore[arg-type]
    assert route["rollout"] == rollout and route["generation"] == 3 and route["shadow"] == {"served": 5, "shed": 1}
    stable, candidate = route["versions"]
    assert stable["requests"] == {"ok": 7} and stable["agreement"] == {} and stable["shadow"] == {"served": 2}
    assert candidate["requests"] == {"ok": 2, "error": 1} and candidate["shadow"] == {"served": 3, "shed": 1}
    assert candidate["agreement"] == {"1": {"count": 4, "sum": 3.0}}
    assert (stable["weight"], stable["stable"], candidate["weight"], candidate["mirror"]) == (75.0, True, 25.0, True)


def test_route_states_without_the_version_metrics_show_the_routes() -> None:
    metrics = RouterMetrics()
    for attribute in ("version_requests", "version_agreement", "mirror_requests"):
        if hasattr(metrics, attribute):
            delattr(metrics, attribute)
    (route,) = route_states(_Routes(None), metrics)  # type: ignore[arg-type]
    assert route["rollout"] is None and route["shadow"] == {}
    assert [v["requests"] for v in route["versions"]] == [{}, {}]
