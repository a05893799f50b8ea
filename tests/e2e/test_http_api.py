"""The HTTP surface against a real server: inputs, errors, headers, metrics, model listing, OpenAPI."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, RouterProcess, free_port, metric_value, serve

pytestmark = pytest.mark.e2e

FLEET = """
models:
  toy:
    plugin: toy
    batch: {max_size: 4, max_delay_ms: 2}
    queue: {priority_levels: 3}
  echo:
    plugin: scripted
    batch: {max_size: 4, max_delay_ms: 2}
  tiny:
    plugin: scripted
    options: {fixed_ms: 400}
    queue: {max_size: 1}
    batch: {max_size: 1}
"""

VECTOR = {"x": [0.5] * 16}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("api"), FLEET, env={"MODEL_ROUTER_MAX_BODY_BYTES": "4096"}) as process:
        yield process


def post(server: RouterProcess, path: str, **kwargs: object) -> httpx.Response:
    return httpx.post(server.url + path, timeout=10, **kwargs)  # type: ignore[arg-type]


def test_json_input_and_response_shape(server: RouterProcess) -> None:
    response = post(server, "/models/toy/predict", json=VECTOR, headers={"X-Request-ID": "req-42"})
    assert response.status_code == 200
    body = response.json()
    assert response.headers["x-request-id"] == "req-42" == body["request_id"]
    assert body["model"] == "toy" and len(body["result"]["logits"]) == 4
    assert set(body["timing"]) == {"queue_ms", "execution_ms", "batch_size"}


def test_multipart_file_field(server: RouterProcess) -> None:
    files = {"file": ("v.json", json.dumps(VECTOR).encode(), "application/json")}
    response = post(server, "/models/toy/predict", files=files)
    assert response.status_code == 200, response.text
    missing = post(server, "/models/toy/predict", files={"other": ("v.json", b"{}", "application/json")})
    assert missing.status_code == 400 and "'file'" in missing.json()["detail"]


@pytest.mark.parametrize(
    ("path", "kwargs", "status", "words"),
    [
        ("/models/nope/predict", {"json": VECTOR}, 404, "no model named 'nope'"),
        ("/models/toy/predict", {"content": b"hello", "headers": {"content-type": "text/plain"}}, 415,
         "accepted: application/json"),
        ("/models/toy/predict", {"content": b"", "headers": JSON}, 400, "empty"),
        ("/models/toy/predict", {"content": b"{not json", "headers": JSON}, 400, "JSON like"),
        ("/models/toy/predict", {"json": VECTOR, "headers": {"X-Timeout-Ms": "soon"}}, 400, "X-Timeout-Ms must be a number"),
        ("/models/toy/predict", {"json": VECTOR, "headers": {"X-Timeout-Ms": "-5"}}, 400, "positive"),
        ("/models/toy/predict", {"json": VECTOR, "headers": {"X-Priority": "9"}}, 400, "from 1 to 3"),
        ("/models/toy/predict", {"json": VECTOR, "headers": {"X-Priority": "1.5"}}, 400, "integer"),
        ("/models/toy/predict", {"content": b"x" * 10_000, "headers": JSON}, 413, ""),
    ],
)
def test_bad_requests_get_clear_json_errors(
    server: RouterProcess, path: str, kwargs: dict[str, object], status: int, words: str
) -> None:
    response = post(server, path, **kwargs)
    assert response.status_code == status, response.text
    assert words in response.json()["detail"]
    assert response.headers["x-request-id"]
    assert post(server, "/models/toy/predict", json=VECTOR).status_code == 200  # still serving


def test_full_queue_answers_503_with_retry_after_at_once(server: RouterProcess) -> None:
    import asyncio

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            return await asyncio.gather(*(client.post("/models/tiny/predict", json={"id": str(i)}) for i in range(6)))

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 1 and codes.count(503) >= 3
    rejected = next(r for r in responses if r.status_code == 503)
    assert int(rejected.headers["retry-after"]) >= 1
    assert "queue is full" in rejected.json()["detail"]  # refused on arrival: a wait would end in a 504


def test_models_listing_and_detail(server: RouterProcess) -> None:
    models = httpx.get(server.url + "/models").json()["models"]
    assert {m["name"] for m in models} == {"toy", "echo", "tiny"}
    toy = httpx.get(server.url + "/models/toy").json()
    assert toy["state"] == "ready" and toy["plugin"]["distribution"] == "vision-model-router-testkit"
    assert toy["queue"]["capacity"] == 64 and toy["batch"]["max_size"] == 4
    assert toy["memory"]["weights_bytes"] > 0 and toy["memory"]["source"] == "estimate"
    assert httpx.get(server.url + "/models/nope").status_code == 404


def test_metrics_expose_queues_batches_outcomes_and_devices(server: RouterProcess) -> None:
    post(server, "/models/echo/predict", json={"id": "m"})
    text = httpx.get(server.url + "/metrics").text
    for name in ("model_router_queue_depth", "model_router_queue_wait_seconds_bucket", "model_router_batch_size_bucket",
                 "model_router_batch_execution_seconds_bucket", "model_router_requests_total",
                 "model_router_ledger_reserved_bytes", "model_router_device_memory_used_bytes",
                 "model_router_device_memory_total_bytes"):
        assert name in text, name
    assert metric_value(text, "model_router_requests_total", model="echo", outcome="ok") >= 1
    assert metric_value(text, "model_router_device_memory_total_bytes", device="cpu") > 0


def test_health_and_openapi(server: RouterProcess) -> None:
    assert httpx.get(server.url + "/health/live").json() == {"status": "live"}
    assert httpx.get(server.url + "/health/ready").status_code == 200
    schema = httpx.get(server.url + "/schema/openapi.json").json()
    assert "/models/{name}/predict" in schema["paths"]
    unknown_route = httpx.get(server.url + "/no/such/route")
    assert unknown_route.status_code == 404 and "detail" in unknown_route.json()


def test_unknown_plugin_fails_before_the_port_opens(tmp_path: Path) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text("models:\n  m: {plugin: not-installed}\n", encoding="utf-8")
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "router", "serve", "--config", str(config), "--port", str(port)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,  # its exit status is the point
    )
    assert result.returncode == 2
    assert "models.m.plugin" in result.stderr and "installed plugins: " in result.stderr
    assert "scripted" in result.stderr and "toy" in result.stderr
