"""A split host (`workers: 2`) with real processes: the parent, one engine, two fronts on one port.

Each test starts `model-router serve` with MODEL_ROUTER_WORKERS=2 and drives it over HTTP on
loopback: what a client sees, what `ps` shows, what the processes do when one of them dies, on
SIGTERM and SIGHUP, and that a front refuses from the engine's board without a round trip.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import HANG_S, RouterProcess, metric_value, read_records, serve

pytestmark = pytest.mark.e2e

SPLIT = {"MODEL_ROUTER_WORKERS": "2"}


def fleet(fixed_ms: float = 2, max_batch: int = 8, queue: int = 256, extra: str = "", name: str = "m") -> str:
    return (f"models:\n  {name}:\n    plugin: scripted\n    options: {{fixed_ms: {fixed_ms}}}\n"
            f"    queue: {{max_size: {queue}, timeout_ms: 10000}}\n    batch: {{max_size: {max_batch}, max_delay_ms: 1}}\n"
            f"{extra}")


def roles(server: RouterProcess) -> dict[str, int]:
    """The children's titles (as `ps` shows them) and pids."""
    found = {}
    for child in psutil.Process(server.process.pid).children():
        try:
            title = " ".join(child.cmdline()).strip("\0 ")
        except psutil.Error:  # one that just died, not yet reaped
            continue
        if title.startswith("model-router: "):
            found[title.removeprefix("model-router: ")] = child.pid
    return found


@contextmanager
def serve_split(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> Iterator[RouterProcess]:
    """`serve` of a split host, given back once every front has started its server and taken its
    title: the first front to answer /health/ready is not all of them."""
    env = {**SPLIT, **(env or {})}
    fronts = {f"front {i}" for i in range(1, int(env["MODEL_ROUTER_WORKERS"]) + 1)}
    with serve(tmp_path, text, env=env) as server:
        until(lambda: fronts <= set(roles(server)) and fronts <= {
            r.get("role") for r in server.log_records() if r.get("message") == "Application startup complete."},
            what="every front started")
        yield server


def until(condition: Callable[[], object], timeout_s: float = 30.0, what: str = "the condition") -> None:
    limit = time.monotonic() + timeout_s
    while time.monotonic() < limit:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not hold within {timeout_s} s")


def predict(conn: http.client.HTTPConnection, ident: str, model: str = "m") -> http.client.HTTPResponse:
    conn.request("POST", f"/models/{model}/predict", body=json.dumps({"id": ident}),
                 headers={"content-type": "application/json"})
    response = conn.getresponse()
    response.read()
    return response


@dataclass
class Client:
    """One client thread on its own keep-alive connection, sending until told to stop."""

    port: int
    name: str
    results: list[tuple[float, int, bool]] = field(default_factory=list)  # (time, status or 0, Retry-After)
    local_ports: list[int] = field(default_factory=list)  # of each connection it opened, in order
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        conn = self._connect()
        count = 0
        while not self.stop.is_set():
            count += 1
            try:
                response = predict(conn, f"{self.name}-{count}")
                self.results.append((time.monotonic(), response.status, response.getheader("retry-after") is not None))
            except (OSError, http.client.HTTPException):
                self.results.append((time.monotonic(), 0, False))
                conn.close()
                conn = self._connect()

    def _connect(self) -> http.client.HTTPConnection:
        while True:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
            try:
                conn.connect()
            except OSError:
                time.sleep(0.05)
                continue
            self.local_ports.append(conn.sock.getsockname()[1])
            return conn


def run_clients(server: RouterProcess, count: int) -> tuple[list[Client], list[threading.Thread]]:
    port = int(server.url.rsplit(":", 1)[1])
    clients = [Client(port, f"c{i}") for i in range(count)]
    threads = [threading.Thread(target=c.run, daemon=True) for c in clients]
    for thread in threads:
        thread.start()
    return clients, threads


def stop_clients(clients: list[Client], threads: list[threading.Thread]) -> None:
    for client in clients:
        client.stop.set()
    for thread in threads:
        thread.join(30)


def client_ports_of(pid: int, server_port: int) -> set[int]:
    return {c.raddr.port for c in psutil.Process(pid).net_connections("tcp")
            if c.laddr and c.laddr.port == server_port and c.raddr}


def test_two_fronts_and_an_engine_serve_like_one_process(tmp_path: Path) -> None:
    with serve_split(tmp_path, fleet()) as server:
        assert set(roles(server)) == {"engine", "front 1", "front 2"}
        answers = []
        for _ in range(20):  # a new connection each: the kernel spreads them over both fronts
            with httpx.Client(base_url=server.url, timeout=20) as client:
                answers.append(client.post("/models/m/predict", json={"id": "x"}))
        assert [a.status_code for a in answers] == [200] * 20 and answers[0].json()["result"]["id"] == "x"
        served_by = Counter(r["role"] for r in server.log_records() if r.get("message") == "request"
                            and r.get("path") == "/models/m/predict")
        assert set(served_by) == {"front 1", "front 2"}, served_by
        model = httpx.get(server.url + "/models/m").json()
        assert model["state"] == "ready" and model["requests"]["ok"] == 20  # every front's count
        text = httpx.get(server.url + "/metrics").text
        assert metric_value(text, "model_router_requests_total", model="m", outcome="ok") == 20
        assert metric_value(text, "model_router_batch_size_sum", model="m") == 20  # the engine's batches
        assert metric_value(text, "model_router_queue_capacity", model="m") == 256  # the engine's state, once
        assert httpx.post(server.url + "/models/m/unload").status_code == 200  # forwarded to the engine
        unloaded = httpx.post(server.url + "/models/m/predict", json={"id": "y"})
        assert unloaded.status_code == 503 and "unloaded by an operator" in unloaded.json()["detail"]
        assert httpx.post(server.url + "/models/m/load", timeout=30).json()["state"] == "ready"
        assert httpx.post(server.url + "/models/m/predict", json={"id": "z"}).status_code == 200
        assert httpx.get(server.url + "/ui/state").json()["models"][0]["name"] == "m"
        assert server.stop() == 0


def test_a_front_killed_under_load_loses_only_its_own_requests(tmp_path: Path) -> None:
    with serve_split(tmp_path, fleet(fixed_ms=5)) as server:
        port = int(server.url.rsplit(":", 1)[1])
        clients, threads = run_clients(server, 8)
        until(lambda: all(len(c.results) > 5 for c in clients), what="every client served")
        victim = roles(server)["front 1"]
        on_victim = client_ports_of(victim, port)
        assert on_victim, "the kernel gave front 1 none of the 8 connections"
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        until(lambda: roles(server).get("front 1", victim) != victim, what="front 1 restarted")
        until(lambda: all(any(t > killed_at + 1 and s == 200 for t, s, _ in c.results) for c in clients),
              what="every client served again")
        stop_clients(clients, threads)
    for client in clients:
        failed = [status for _, status, _ in client.results if status != 200]
        if client.local_ports[0] in on_victim:
            assert set(failed) <= {0} and len(failed) <= 2, f"{client.name} on the killed front: {failed}"
        else:
            assert failed == [], f"{client.name} on the surviving front lost requests: {failed}"
    assert sum(1 for c in clients for _, s, _ in c.results if s == 0) >= 1  # the killed front's open requests


def test_the_engine_killed_under_load_answers_503_with_retry_after_then_serves_again(tmp_path: Path) -> None:
    with serve_split(tmp_path, fleet(fixed_ms=20)) as server:
        clients, threads = run_clients(server, 6)
        until(lambda: all(len(c.results) > 3 for c in clients), what="every client served")
        engine = roles(server)["engine"]
        killed_at = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        until(lambda: all(any(t > killed_at and s == 200 for t, s, _ in c.results) for c in clients), 60,
              what="service back after the engine's restart")
        stop_clients(clients, threads)
        assert roles(server)["engine"] != engine
    after = [(t - killed_at, s, retry) for c in clients for t, s, retry in c.results if t > killed_at]
    refused = [(t, s, retry) for t, s, retry in after if s != 200]
    assert refused, "no request met the engine's absence"
    assert {s for _, s, _ in refused} == {503} and all(retry for _, _, retry in refused), refused[:5]
    assert min(t for t, _, _ in refused) < 2.0  # at once, not after a timeout


def test_sigterm_answers_every_request_the_engine_had_queued(tmp_path: Path) -> None:
    with serve_split(tmp_path, fleet(fixed_ms=300, max_batch=1)) as server:
        results: list[int] = []

        def one(ident: str) -> None:
            with httpx.Client(base_url=server.url, timeout=30) as client:
                results.append(client.post("/models/m/predict", json={"id": ident}).status_code)

        threads = [threading.Thread(target=one, args=(f"q{i}",)) for i in range(6)]
        for thread in threads:
            thread.start()
        until(lambda: httpx.get(server.url + "/models/m").json()["queue"]["depth"] >= 3, 10,
              what="requests queued in the engine")
        server.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(30)
        assert server.process.wait(60) == 0
    assert results == [200] * 6


def test_a_front_refuses_a_surge_from_the_board_without_asking_the_engine(tmp_path: Path) -> None:
    with serve_split(tmp_path, fleet(fixed_ms=2000, max_batch=1, queue=2)) as server:
        def hold() -> None:
            """One request that takes its place; again if a front refused it while the others were
            still being prepared there (a front counts what it prepares against the queue's room)."""
            deadline = time.monotonic() + HANG_S
            while httpx.post(server.url + "/models/m/predict", json={"id": "h"}, timeout=30).status_code == 503:
                assert time.monotonic() < deadline, "a holder was refused until the hang bound"

        holders = [threading.Thread(target=hold) for _ in range(3)]
        for thread in holders:
            thread.start()
        until(lambda: httpx.get(server.url + "/models/m").json()["queue"]["depth"] == 2, what="the queue full")

        def submits() -> float:
            return metric_value(httpx.get(server.url + "/metrics").text, "model_router_engine_messages_total",
                                kind="submit")

        until(lambda: submits() == 3, what="the engine's count of the three holders' submits")
        with httpx.Client(base_url=server.url, timeout=10) as client:
            surge = [client.post("/models/m/predict", json={"id": f"s{i}"}) for i in range(40)]
        for thread in holders:
            thread.join(30)
        # One more request after the surge, admitted now the queue has room: once the engine's count
        # shows it, the count is of everything sent before it too, the 40 refused ones included.
        assert httpx.post(server.url + "/models/m/predict", json={"id": "after"}, timeout=30).status_code == 200
        until(lambda: submits() >= 4, what="the engine's count of the request after the surge")
        after = submits()
    assert [r.status_code for r in surge] == [503] * 40 and all("retry-after" in r.headers for r in surge)
    assert "queue is full" in surge[0].json()["detail"]
    assert after == 4, f"the engine received {after - 4} of the 40 refused requests"
    refused_early = [r for r in server.log_records() if r.get("refused") == "before the app"]
    assert len(refused_early) == 40  # answered by the fronts' connections, from the board


def test_sighup_reaches_the_engine_and_every_front_learns_the_new_model(tmp_path: Path) -> None:
    with serve_split(tmp_path, fleet()) as server:
        config = tmp_path / "fleet.yaml"
        config.write_text(fleet() + fleet(name="b").removeprefix("models:\n"), encoding="utf-8")
        server.process.send_signal(signal.SIGHUP)
        until(lambda: {m["name"]: m["state"] for m in httpx.get(server.url + "/models").json()["models"]}.get("b")
              == "ready", what="b ready")
        for _ in range(6):  # a new connection each: both fronts
            with httpx.Client(base_url=server.url, timeout=20) as client:
                assert client.post("/models/b/predict", json={"id": "x"}).status_code == 200


def test_an_engine_that_keeps_dying_stops_the_server_with_status_1(tmp_path: Path) -> None:
    with serve_split(tmp_path, fleet()) as server:
        (tmp_path / "fleet.yaml").write_text("models: {}\n", encoding="utf-8")  # the next engine cannot start
        os.kill(roles(server)["engine"], signal.SIGKILL)
        assert server.process.wait(60) == 1
    assert "the engine died 5 times" in server.log()


def test_hooks_that_need_the_model_run_in_the_engine(tmp_path: Path) -> None:
    text = ("models:\n  unsplit: {plugin: unsplit, batch: {max_size: 4}}\n"
            "  engine-hooks: {plugin: engine-hooks, batch: {max_size: 4}}\n")
    with serve_split(tmp_path, text) as server:
        engine = roles(server)["engine"]
        answers = {}
        for model in ("unsplit", "engine-hooks"):
            for i in range(6):  # a new connection each: both fronts
                with httpx.Client(base_url=server.url, timeout=20) as client:
                    reply = client.post(f"/models/{model}/predict", json={"id": f"x{i}"})
                assert reply.status_code == 200, reply.text
                answers.setdefault(model, []).append(reply.json()["result"])
        switched = [r for r in server.log_records() if "its hooks run in the engine from now on" in str(r["message"])]
    for model, results in answers.items():
        assert [r["id"] for r in results] == [f"x{i}-served" for i in range(6)]
        assert {r["postprocessed_by"] for r in results} == {engine}, (model, results)  # never a front
    assert {r["role"] for r in switched} <= {"front 1", "front 2"} and 1 <= len(switched) <= 2
    assert all(r["model"] == "unsplit" for r in switched)  # the other one said so itself: no failure first


def test_v2_shared_memory_registered_through_one_front_is_read_through_every_front(tmp_path: Path) -> None:
    """A client registers a region on one connection, then sends requests that read it on fresh
    connections (the kernel spreads them over both fronts), over HTTP and gRPC; unregistered
    through one front, it is gone for both."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import InferenceServerException, serialize_byte_tensor

    name, key = "split-region", f"/model-router-split-{os.getpid()}"
    handle = shm.create_shared_memory_region(name, key, 64)
    try:
        document = serialize_byte_tensor(np.array([b'{"id": "from-shm"}'], dtype=np.object_)).item()
        shm.set_shared_memory_region(handle, [np.array(document, dtype=np.object_)])
        with serve_split(tmp_path, fleet(), env={"MODEL_ROUTER_LOG_FORMAT": "json"}) as server:
            address = server.url.removeprefix("http://")
            httpclient.InferenceServerClient(address).register_system_shared_memory(name, key, len(document))

            def infer(protocol: str, request_id: str) -> list[str]:
                tc = grpcclient if protocol == "grpc" else httpclient
                triton = tc.InferenceServerClient(server.grpc_address if protocol == "grpc" else address)  # a new connection
                tensor = tc.InferInput("JSON", [1], "BYTES")
                tensor.set_shared_memory(name, len(document))
                result = triton.infer("m", [tensor], request_id=request_id)
                return [json.loads(element)["id"] for element in result.as_numpy("OUTPUT")]

            for i in range(12):
                assert infer("http" if i % 3 else "grpc", f"shm-{i}") == ["from-shm"]
            def served_by() -> set[str]:  # the fronts whose access lines show an infer (written a burst at a time)
                return {str(r["role"]) for r in server.log_records()
                        if r["message"] == "request" and "infer" in str(r.get("path", "")).lower()}

            until(lambda: served_by() == {"front 1", "front 2"}, what=f"both fronts serving (so far: {served_by()})")
            httpclient.InferenceServerClient(address).unregister_system_shared_memory(name)
            for i in range(6):
                with pytest.raises(InferenceServerException) as gone:
                    infer("http" if i % 2 else "grpc", f"gone-{i}")
                assert f"no shared memory region named '{name}' is registered" in gone.value.message()
    finally:
        shm.destroy_shared_memory_region(handle)


def test_a_trace_joins_the_front_and_the_engine(tmp_path: Path) -> None:
    """Tracing on a split host: each request's server span and phases come from its front, the
    batch span from the engine, linked both ways, with the same checks as in one process."""
    from tests.e2e.test_tracing import FLEET as TRACED
    from tests.e2e.test_tracing import Sent, check_traces, send, wait_for_traces
    from tests.otlp_receiver import receiver

    record = tmp_path / "batches.jsonl"
    with receiver() as otlp:
        env = {**SPLIT, "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url, "OTEL_BSP_SCHEDULE_DELAY": "50",
               "MODEL_ROUTER_LOG_FORMAT": "json"}
        with serve_split(tmp_path, TRACED.format(record=record), env=env) as server:
            ids = [f"split-{i}" for i in range(6)]
            sent: dict[str, Sent] = {}
            together = threading.Barrier(len(ids))

            def one(request_id: str) -> None:
                together.wait(10)
                sent[request_id] = send(server, "batched", request_id)  # httpx: a new connection each

            threads = [threading.Thread(target=one, args=(rid,)) for rid in ids]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            assert sorted(sent) == ids and all(s.status == 200 for s in sent.values()), sent
            served_by = {line["role"] for rid in ids for line in server.access_lines(rid)}
        batches = [b for b in read_records(record) if set(b["ids"]) & set(ids)]  # type: ignore[arg-type]
        spans = wait_for_traces(otlp, ids, batches)
    check_traces(spans, sent, batches)
    assert served_by <= {"front 1", "front 2"}  # which fronts took them is the kernel's; the checks hold for each
