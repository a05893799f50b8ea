"""The request rules run at most once to screen a request and once to commit each of its items, on
every front (native predict, V2 over HTTP, gRPC, a pipeline) and in both layouts (one process, a
split host of two fronts and an engine): counted by `model_router_rule_evaluations_total{step}`,
which a split host sums over all its processes, read before and after each request."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import ultralytics

from tests.conftest import RouterProcess, metric_value, serve

pytestmark = pytest.mark.e2e

PHOTO = Path(ultralytics.__file__).parent / "assets" / "zidane.jpg"
FLEET = """
models:
  m: {plugin: scripted, options: {fixed_ms: 1}, batch: {max_size: 4, max_delay_ms: 1}}
  boxes: {plugin: boxes, options: {boxes: [[0, 0, 10, 10, 0.9], [10, 0, 30, 20, 0.8]]}}
  pixels: {plugin: pixels, batch: {max_size: 4, max_delay_ms: 1}}
pipelines:
  two-crops: {steps: [{model: boxes}, {transform: crop}, {model: pixels}]}
"""


@pytest.fixture(scope="module", params=["1", "2"], ids=["one process", "split host"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("rules"), FLEET, env={"MODEL_ROUTER_WORKERS": request.param}) as process:
        yield process


def evaluations(server: RouterProcess) -> tuple[float, float]:
    """(screens, commits) so far, over every process of the server."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return (metric_value(text, "model_router_rule_evaluations_total", step="screen"),
            metric_value(text, "model_router_rule_evaluations_total", step="commit"))


def native(server: RouterProcess) -> None:
    response = httpx.post(f"{server.url}/models/m/predict", json={"id": "native"}, timeout=30)
    assert response.status_code == 200, response.text


def native_pipelined(server: RouterProcess) -> None:
    """Two requests in one write: the second, behind the first on its connection, is left to the
    app by the connection's screen, and the app screens it."""
    body = b'{"id": "piped"}'
    one = (b"POST /models/m/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(one + one)
        received = b""
        while received.count(b"HTTP/1.1 ") < 2 or not received.endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    assert received.count(b"HTTP/1.1 200 OK") == 2, received


def documents(module: Any) -> Any:
    tensor = module.InferInput("JSON", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([json.dumps({"id": "v2"}).encode()], dtype=np.object_))
    return tensor


def v2_http(server: RouterProcess) -> None:
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    assert client.infer("m", [documents(httpclient)]).as_numpy("OUTPUT") is not None


def v2_grpc(server: RouterProcess) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_address)
    assert client.infer("m", [documents(grpcclient)]).as_numpy("OUTPUT") is not None


def pipeline(server: RouterProcess) -> None:
    response = httpx.post(f"{server.url}/models/two-crops/predict", content=PHOTO.read_bytes(),
                          headers={"content-type": "image/jpeg"}, timeout=30)
    assert response.status_code == 200, response.text
    assert [(s["step"], s["items"]) for s in response.json()["timing"]["steps"]][-1] == ("2:pixels", 2)


#: A request of each front, and (screens, commits) it must cost: one screen per request, one
#: commit per item (a pipeline: its first model's input and each of its two crops).
FRONTS: dict[Callable[[RouterProcess], None], tuple[int, int]] = {
    native: (1, 1), native_pipelined: (2, 2), v2_http: (1, 1), v2_grpc: (1, 1), pipeline: (1, 3),
}


@pytest.mark.parametrize("send", list(FRONTS), ids=lambda send: send.__name__)
def test_each_request_is_screened_once_and_committed_once_per_item(
    server: RouterProcess, send: Callable[[RouterProcess], None],
) -> None:
    before = evaluations(server)
    send(server)
    after = evaluations(server)
    assert (after[0] - before[0], after[1] - before[1]) == FRONTS[send]


def test_a_refusal_at_the_screen_commits_nothing(server: RouterProcess) -> None:
    before = evaluations(server)
    response = httpx.post(f"{server.url}/models/m/predict", json={"id": "x"}, headers={"x-priority": "9"}, timeout=30)
    assert response.status_code == 400, response.text
    after = evaluations(server)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)
