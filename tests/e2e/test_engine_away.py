"""A split host whose engine is away (killed) or hung (stopped): one truth on every front.

While the engine is away, every HTTP surface (predict, a pipeline's predict, V2 infer, metadata and
readiness, the model routes, /health/ready) answers 503 with Retry-After, gRPC `ModelInfer` answers
UNAVAILABLE with `retry-after` in its trailing metadata, `ServerReady` and `ModelReady` say false
and `grpc.health.v1` NOT_SERVING; then everything recovers. An engine stopped with SIGSTOP is
taken as hung once the board is stale (`engine_stale_s`): readiness 503, requests 503 rather than
waiting out their deadlines; after `engine_hang_s` the parent kills it, says why, and a new engine
serves. Ordered by state (polls), every wait bounded.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2

from tests.conftest import HANG_S, RouterProcess
from tests.e2e.test_split_host import roles, serve_split, until

pytestmark = pytest.mark.e2e

SERVICE = "/inference.GRPCInferenceService/"
FLEET = """
models:
  m:
    plugin: scripted
    options: {fixed_ms: 2}
    queue: {max_size: 64, timeout_ms: 10000}
    batch: {max_size: 4, max_delay_ms: 1}
    warmup: {enabled: false}
pipelines:
  p:
    steps:
      - model: m
"""
V2_BODY = {"inputs": [{"name": "JSON", "datatype": "BYTES", "shape": [1], "data": ['{"id": "v2"}']}]}
#: Every HTTP surface the issue names: (method, path, body).
SURFACES = [
    ("POST", "/models/m/predict", {"id": "x"}),
    ("POST", "/models/p/predict", {"id": "x"}),
    ("POST", "/v2/models/m/infer", V2_BODY),
    ("GET", "/models/m", None),
    ("GET", "/models/p", None),
    ("GET", "/v2/models/m", None),
    ("GET", "/v2/models/m/ready", None),
    ("GET", "/v2/health/ready", None),
    ("GET", "/health/ready", None),
]


def http_answers(server: RouterProcess) -> dict[str, httpx.Response]:
    answers = {}
    with httpx.Client(base_url=server.url, timeout=HANG_S) as client:
        for method, path, body in SURFACES:
            answers[f"{method} {path}"] = client.request(method, path, json=body)
    return answers


def unary(channel: grpc.Channel, method: str, request: Any, response_type: Any) -> Any:
    call = channel.unary_unary(SERVICE + method, request_serializer=type(request).SerializeToString,
                               response_deserializer=response_type.FromString)
    return call(request, timeout=HANG_S)


def model_infer(channel: grpc.Channel) -> grpc.RpcError | None:
    item = b'{"id": "grpc"}'
    request = service_pb2.ModelInferRequest(
        model_name="m", inputs=[service_pb2.ModelInferRequest.InferInputTensor(name="JSON", datatype="BYTES", shape=[1])],
        raw_input_contents=[len(item).to_bytes(4, "little") + item])
    try:
        unary(channel, "ModelInfer", request, service_pb2.ModelInferResponse)
    except grpc.RpcError as exc:
        return exc
    return None


def grpc_answers(channel: grpc.Channel) -> dict[str, Any]:
    health = health_pb2_grpc.HealthStub(channel)
    return {
        "infer": model_infer(channel),
        "server ready": unary(channel, "ServerReady", service_pb2.ServerReadyRequest(),
                              service_pb2.ServerReadyResponse).ready,
        "model ready": unary(channel, "ModelReady", service_pb2.ModelReadyRequest(name="m"),
                             service_pb2.ModelReadyResponse).ready,
        "health": health.Check(health_pb2.HealthCheckRequest(service=""), timeout=HANG_S).status,
        "model health": health.Check(health_pb2.HealthCheckRequest(service="m"), timeout=HANG_S).status,
    }


def status_of(server: RouterProcess, path: str = "/health/ready") -> int:
    try:
        return httpx.get(server.url + path, timeout=HANG_S).status_code
    except httpx.TransportError:
        return 0


def recovered(server: RouterProcess, channel: grpc.Channel) -> bool:
    ready = unary(channel, "ServerReady", service_pb2.ServerReadyRequest(), service_pb2.ServerReadyResponse).ready
    return bool(ready) and status_of(server) == 200 and status_of(server, "/models/m") == 200


@contextmanager
def channel_to(server: RouterProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.grpc_address) as channel:
        yield channel


def assert_away(answers: dict[str, httpx.Response], rpc: dict[str, Any]) -> None:
    wrong = {name: (a.status_code, a.headers.get("retry-after"), a.text[:160]) for name, a in answers.items()
             if a.status_code != 503 or not a.headers.get("retry-after")}
    assert not wrong, f"surfaces that did not answer 503 with Retry-After while the engine was away: {wrong}"
    refusal = rpc["infer"]
    assert refusal is not None and refusal.code() == grpc.StatusCode.UNAVAILABLE, refusal
    trailing = dict(refusal.trailing_metadata() or ())
    assert int(trailing["retry-after"]) >= 1 and "engine" in refusal.details(), (trailing, refusal.details())
    assert rpc["server ready"] is False and rpc["model ready"] is False
    assert rpc["health"] == rpc["model health"] == health_pb2.HealthCheckResponse.NOT_SERVING


def assert_serving(answers: dict[str, httpx.Response], rpc: dict[str, Any]) -> None:
    assert {name: a.status_code for name, a in answers.items()} == dict.fromkeys(answers, 200)
    assert rpc["infer"] is None and rpc["server ready"] is True and rpc["model ready"] is True
    assert rpc["health"] == rpc["model health"] == health_pb2.HealthCheckResponse.SERVING


def test_while_the_killed_engine_is_away_every_front_says_so_then_all_recovers(tmp_path: Path) -> None:
    with serve_split(tmp_path, FLEET) as server, channel_to(server) as channel:
        assert_serving(http_answers(server), grpc_answers(channel))
        engine, parent = roles(server)["engine"], server.process.pid
        os.kill(parent, signal.SIGSTOP)  # holds the engine away: the parent starts the next one once it runs again
        try:
            os.kill(engine, signal.SIGKILL)
            until(lambda: status_of(server) == 503, HANG_S, "readiness 503 after the engine's death")
            answers, rpc = http_answers(server), grpc_answers(channel)
        finally:
            os.kill(parent, signal.SIGCONT)
        assert_away(answers, rpc)
        until(lambda: roles(server).get("engine") not in (None, engine), HANG_S, "a new engine started")
        until(lambda: recovered(server, channel), 3 * HANG_S, "serving again with the new engine")
        assert_serving(http_answers(server), grpc_answers(channel))


def test_a_stopped_engine_is_noticed_refused_around_killed_and_replaced(tmp_path: Path) -> None:
    env = {"MODEL_ROUTER_ENGINE_STALE_S": "1", "MODEL_ROUTER_ENGINE_HANG_S": "6"}
    with serve_split(tmp_path, FLEET, env) as server, channel_to(server) as channel:
        engine = roles(server)["engine"]
        open_answer: list[httpx.Response] = []
        os.kill(engine, signal.SIGSTOP)
        try:
            # Sent to the stopped engine: its queue timeout is 10 s, yet it is answered 503 once the board is stale.
            sender = threading.Thread(target=lambda: open_answer.append(httpx.post(
                server.url + "/models/m/predict", json={"id": "open"}, timeout=3 * HANG_S)), daemon=True)
            sender.start()
            until(lambda: status_of(server) == 503, HANG_S, "readiness 503 once the board is stale")
            answers, rpc = http_answers(server), grpc_answers(channel)
            assert roles(server).get("engine") == engine  # still the stopped one: the round fell within the stop
            sender.join(HANG_S)
            assert open_answer and open_answer[0].status_code == 503, open_answer and open_answer[0].text
            assert open_answer[0].headers["retry-after"] and "not answered" in open_answer[0].json()["detail"]
            assert_away(answers, rpc)
            until(lambda: roles(server).get("engine") not in (None, engine), 2 * HANG_S,
                  "the parent killed the stopped engine and started another")
        finally:
            try:
                os.kill(engine, signal.SIGCONT)  # were the parent's kill not to come, let the test's end stop it
            except ProcessLookupError:
                pass
        hung = [r for r in server.log_records() if r.get("event") == "engine_hung"]
        assert len(hung) == 1 and hung[0]["pid"] == engine and hung[0]["role"] == "parent", hung
        assert float(hung[0]["silent_s"]) >= 6 and hung[0]["limit_s"] == 6 and "published nothing" in hung[0]["message"]
        assert any(r.get("event") == "engine_silent" for r in server.log_records())
        until(lambda: recovered(server, channel), 3 * HANG_S, "serving again with the new engine")
        assert_serving(http_answers(server), grpc_answers(channel))
        answer = httpx.post(server.url + "/models/m/predict", json={"id": "after"}, timeout=HANG_S)
        assert answer.status_code == 200 and json.loads(answer.text)["result"]["id"] == "after"
