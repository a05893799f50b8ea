"""V2 requests whose cost a client could blow up, against a real server: item counts refused as a
whole before any task exists, JSON nested without end, shapes of too many dimensions, and long
names echoed back. Each answers 4xx, logs no traceback, and leaves the server serving."""

from __future__ import annotations

import json
import struct
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import HANG_S, RouterProcess, metric_value, serve

pytestmark = pytest.mark.e2e

FLEET = """
models:
  echo:
    plugin: scripted
    batch: {max_size: 8, max_delay_ms: 2}
  wide:
    plugin: scripted
    queue: {max_size: 1000000}
    batch: {max_size: 8, max_delay_ms: 2}
  small:
    plugin: scripted
    queue: {max_size: 4}
    batch: {max_size: 1, max_delay_ms: 0}
"""
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("v2"), FLEET, memory_limit=8 * 1024**3) as process:
        yield process


def infer(server: RouterProcess, model: str, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}/v2/models/{model}/infer", content=body, headers=headers or JSON, timeout=30)


def bytes_request(count: int, item: str = "") -> bytes:
    """`count` BYTES items for the input `JSON` (the scripted plugin takes JSON documents)."""
    return json.dumps({"inputs": [{"name": "JSON", "datatype": "BYTES", "shape": [count], "data": [item] * count}]}).encode()


def binary_bytes_request(count: int) -> tuple[bytes, dict[str, str]]:
    blob = struct.pack("<I", 0) * count
    header = json.dumps({"inputs": [{"name": "JSON", "datatype": "BYTES", "shape": [count],
                                     "parameters": {"binary_data_size": len(blob)}}]}).encode()
    return header + blob, {"content-type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}


def no_tracebacks(server: RouterProcess) -> None:
    records = server.log_records()
    assert not [r for r in records if r.get("level") == "error" or "exception" in r], records[-3:]
    assert "Traceback" not in server.log()


@pytest.mark.parametrize(("model", "limit"), [("echo", 64), ("wide", 1024)])
@pytest.mark.parametrize("form", ["json", "binary"])
def test_a_hundred_thousand_items_are_refused_from_the_shape(server: RouterProcess, model: str, limit: int, form: str) -> None:
    """Over the model's queue size (echo) or MODEL_ROUTER_MAX_ITEMS (wide): 413 from the shape, with
    liveness answered throughout and no queue slot or counter touched."""
    body, headers = (bytes_request(100_000), JSON) if form == "json" else binary_bytes_request(100_000)
    before = httpx.get(server.url + "/metrics").text
    live: list[int] = []
    stop = threading.Event()

    def probe_liveness() -> None:
        with httpx.Client(base_url=server.url, timeout=HANG_S) as prober_session:
            while not stop.is_set():
                live.append(prober_session.get("/health/live").status_code)
                stop.wait(0.01)

    def until_probed(count: int) -> None:
        deadline = time.monotonic() + HANG_S
        while len(live) < count:
            assert prober.is_alive() and time.monotonic() < deadline, f"liveness stopped answering after {live}"
            time.sleep(0.01)

    prober = threading.Thread(target=probe_liveness)
    prober.start()
    until_probed(3)  # probing before, during and after
    try:
        with httpx.Client(base_url=server.url, timeout=HANG_S) as session:
            for _ in range(3):
                response = session.post(f"/v2/models/{model}/infer", content=body, headers=headers)
                assert response.status_code == 413, response.text
                assert response.json() == {"error": f"input 'JSON' has 100000 items (its first dimension); "
                                                    f"a request to this model may carry at most {limit}"}
        until_probed(len(live) + 3)
    finally:
        stop.set()
        prober.join()
    after = httpx.get(server.url + "/metrics").text

    assert set(live) == {200}, f"liveness answered {sorted(set(live))}"
    for outcome in ("rejected_full", "bad_input", "ok"):
        labels = {"model": model, "outcome": outcome}
        assert metric_value(after, "model_router_requests_total", **labels) - \
            metric_value(before, "model_router_requests_total", **labels) <= 1
    assert infer(server, model, bytes_request(3, '{"id": "after"}')).status_code == 200


def test_a_request_the_queue_can_never_hold_is_413_and_one_that_fits_runs_whole(server: RouterProcess) -> None:
    refused = infer(server, "small", bytes_request(5))
    assert refused.status_code == 413 and "at most 4" in refused.json()["error"]
    accepted = infer(server, "small", bytes_request(4, '{"id": "whole"}'))
    assert accepted.status_code == 200 and len(accepted.json()["outputs"][0]["data"]) == 4


@pytest.mark.parametrize(("path", "body"), [
    ("/v2/models/echo/infer", b"[" * 100_000),
    ("/v2/models/echo/infer", b'{"inputs": ' + b"[" * 150 + b"]" * 150 + b"}"),
    ("/v2/models/echo/infer", b'{"inputs": [{"name": "JSON", "datatype": "BYTES", "shape": [1], "data": '
     + b"[" * 5000 + b'""' + b"]" * 5000 + b"}]}"),
    ("/v2/repository/index", b"[" * 100_000),
    ("/v2/repository/index", b'{"ready": ' + b'{"a": ' * 200 + b"1" + b"}" * 200 + b"}"),
])
def test_deeply_nested_json_is_400(server: RouterProcess, path: str, body: bytes) -> None:
    response = httpx.post(server.url + path, content=body, headers=JSON, timeout=10)
    assert response.status_code == 400, response.text
    assert "more than 100 levels deep" in response.json()["error"]
    no_tracebacks(server)


def test_2000_nested_requests_write_no_traceback(server: RouterProcess) -> None:
    size_before = len(server.log())
    with httpx.Client(base_url=server.url, timeout=10) as session:
        for _ in range(200):  # the 2,000 in two seconds, scaled down for CI
            assert session.post("/v2/models/echo/infer", content=b"[" * 20_000, headers=JSON).status_code == 400
    no_tracebacks(server)
    assert len(server.log()) - size_before < 200 * 400  # an access line each, nothing more


def test_a_shape_of_65_dimensions_is_400(server: RouterProcess) -> None:
    body = json.dumps({"inputs": [{"name": "JSON", "datatype": "BYTES", "shape": [1] * 65, "data": [""]}]}).encode()
    response = infer(server, "echo", body)
    assert response.status_code == 400
    assert response.json() == {"error": "input 'JSON': shape has 65 dimensions; at most 64 are accepted"}
    huge = json.dumps({"inputs": [{"name": "JSON", "datatype": "BYTES", "shape": [2**62, 2**62], "data": [""]}]})
    assert infer(server, "echo", huge.encode()).status_code == 400
    no_tracebacks(server)


def test_long_names_are_truncated_in_echoes(server: RouterProcess) -> None:
    name = "n" * 10_000
    unknown_model = httpx.get(f"{server.url}/v2/models/{name}", timeout=10)
    assert unknown_model.status_code == 404 and len(unknown_model.text) < 400
    body = json.dumps({"inputs": [{"name": name, "datatype": "BYTES", "shape": [1], "data": [""]}]}).encode()
    unknown_input = infer(server, "echo", body)
    assert unknown_input.status_code == 400 and len(unknown_input.text) < 400
    wrong_type = json.dumps({"inputs": [{"name": "JSON", "datatype": name, "shape": [1], "data": [""]}]}).encode()
    assert len(infer(server, "echo", wrong_type).text) < 400
