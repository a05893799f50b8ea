"""Every `model-router serve` flag has the same effect in one process and on a split host.

Each test runs `serve` with `--workers 1` and `--workers 2` and looks from outside: which addresses
listen (HTTP and gRPC), which fleet serves, which limits hold, and what a port another process
already has does. A split host's parent resolves the settings once and hands them to the engine
and every front (`router.host.handover`); before, it passed on a few chosen ones, and `--grpc-port`
was not among them.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import HANG_S, REPO, RouterProcess, free_port, serve
from tests.e2e.test_split_host import roles, until

pytestmark = pytest.mark.e2e

LIMIT = 64 * 1024  # MODEL_ROUTER_MAX_BODY_BYTES: bodies and gRPC messages
HEADERS = 20  # MODEL_ROUTER_MAX_HEADERS
WORKERS = ["1", "2"]
OTHER = {"1": "2", "2": "1"}  # what the environment says, for the flag to override


def fleet(model: str) -> str:
    return f"models:\n  {model}:\n    plugin: scripted\n    batch: {{max_size: 4, max_delay_ms: 1}}\n"


def listens(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=HANG_S):
            return True
    except TimeoutError:
        raise
    except OSError:  # refused, or no such address here (a host without IPv6)
        return False


def grpc_lines(server: RouterProcess) -> list[str]:
    return [str(r["message"]) for r in server.log_records() if str(r.get("message", "")).startswith("serving gRPC")]


def fronts(server: RouterProcess) -> set[str]:
    return {role for role in roles(server) if role.startswith("front")}


def big_infer(address: str) -> None:
    """A gRPC request over LIMIT: RESOURCE_EXHAUSTED from the server's message limit."""
    client = grpcclient.InferenceServerClient(address)
    tensor = grpcclient.InferInput("INPUT", [2 * LIMIT], "UINT8")
    tensor.set_data_from_numpy(np.zeros(2 * LIMIT, dtype=np.uint8))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("flagged", [tensor], client_timeout=HANG_S)
    assert caught.value.status() == "StatusCode.RESOURCE_EXHAUSTED", caught.value


@pytest.mark.parametrize("workers", WORKERS)
def test_flags_win_over_the_environment_in_every_process(tmp_path: Path, workers: str) -> None:
    """--config, --host, --port, --grpc-port and --workers over MODEL_ROUTER_* saying otherwise, and
    the limits from the environment: the same listeners, fleet and refusals in both layouts."""
    env_port, env_grpc, port, grpc_port = free_port(), free_port(), free_port(), free_port()
    env_fleet = tmp_path / "env.yaml"
    env_fleet.write_text(fleet("from_env"), encoding="utf-8")
    env = {"MODEL_ROUTER_HOST": "::1", "MODEL_ROUTER_CONFIG": str(env_fleet), "MODEL_ROUTER_PORT": str(env_port),
           "MODEL_ROUTER_GRPC_PORT": str(env_grpc), "MODEL_ROUTER_WORKERS": OTHER[workers],
           "MODEL_ROUTER_MAX_BODY_BYTES": str(LIMIT), "MODEL_ROUTER_MAX_HEADERS": str(HEADERS)}
    args = ["--config", str(tmp_path / "fleet.yaml"), "--host", "127.0.0.1", "--port", str(port), "--grpc-port",
            str(grpc_port), "--workers", workers]
    with serve(tmp_path, fleet("flagged"), env=env, args=args) as server:
        assert server.url == f"http://127.0.0.1:{port}"
        assert [m["name"] for m in httpx.get(f"{server.url}/models", timeout=HANG_S).json()["models"]] == ["flagged"]
        for host, taken in (("::1", port), ("::1", grpc_port), ("127.0.0.1", env_port), ("::1", env_port),
                            ("127.0.0.1", env_grpc), ("::1", env_grpc)):
            assert not listens(host, taken), f"{host}:{taken} listens"
        client = grpcclient.InferenceServerClient(server.grpc_address)
        assert client.is_server_ready(client_timeout=HANG_S) and client.is_model_ready("flagged", client_timeout=HANG_S)
        assert fronts(server) == ({"front 1", "front 2"} if workers == "2" else set())
        until(lambda: len(grpc_lines(server)) == int(workers), what="every front's gRPC server logged")
        assert set(grpc_lines(server)) == {f"serving gRPC on 127.0.0.1:{grpc_port}"}
        # the limits, in every front and on both protocols
        headers = {f"x-h{i}": "v" for i in range(HEADERS + 5)}
        assert httpx.get(f"{server.url}/health/live", headers=headers, timeout=HANG_S).status_code == 431
        body = b"{" + b" " * (2 * LIMIT) + b"}"
        reply = httpx.post(f"{server.url}/models/flagged/predict", content=body,
                           headers={"content-type": "application/json"}, timeout=HANG_S)
        assert reply.status_code == 413, reply.text
        big_infer(server.grpc_address)


@pytest.mark.parametrize("workers", WORKERS)
def test_grpc_port_0_turns_grpc_off_in_every_process(tmp_path: Path, workers: str) -> None:
    env_grpc = free_port()
    with serve(tmp_path, fleet("flagged"), env={"MODEL_ROUTER_GRPC_PORT": str(env_grpc)},
               args=["--grpc-port", "0", "--workers", workers]) as server:
        assert httpx.get(f"{server.url}/health/ready", timeout=HANG_S).status_code == 200
        assert fronts(server) == ({"front 1", "front 2"} if workers == "2" else set())
        assert not listens("127.0.0.1", env_grpc)
        assert grpc_lines(server) == []


@contextmanager
def foreign_server() -> Iterator[int]:
    """Another server on a port, with SO_REUSEPORT as gRPC and many servers set it: the kernel would let
    a process of the same user join it and split its connections."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_a_port_another_process_has_is_a_start_up_error(tmp_path: Path, workers: str, flag: str) -> None:
    """The server does not start, and says which port; before, a split host shared it silently."""
    config = tmp_path / "fleet.yaml"
    config.write_text(fleet("flagged"), encoding="utf-8")
    with foreign_server() as taken:
        ports = {"--port": str(free_port()), "--grpc-port": str(free_port()), flag: str(taken)}
        command = [sys.executable, "-m", "router", "serve", "--config", str(config), "--host", "127.0.0.1",
                   "--workers", workers, *(item for pair in ports.items() for item in pair)]
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            served = _exits_or_serves(process, int(ports["--port"]))
            output = process.stdout.read().decode() if process.stdout else ""
        finally:
            if process.poll() is None:
                process.kill()
            process.wait(30)
        assert not served, f"served on a port another process has:\n{output[-3000:]}"
        assert process.returncode != 0
        assert f"127.0.0.1:{taken}" in output or f"'127.0.0.1', {taken}" in output, output[-3000:]


def _exits_or_serves(process: subprocess.Popen[bytes], port: int, timeout_s: float = 90.0) -> bool:
    """Whether the server answered readiness on `port` before it exited (a hang bound, not a speed)."""
    limit = time.monotonic() + timeout_s
    while process.poll() is None:
        assert time.monotonic() < limit, "the server neither served nor exited"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return False


def test_readiness_comes_once_every_front_listens_on_grpc(tmp_path: Path) -> None:
    """Over a split host, the first 200 of /health/ready: a gRPC ServerReady and health.Check on a fresh
    channel answer at once (before, readiness came from the first front, whatever the others did)."""
    with serve(tmp_path, fleet("flagged"), wait_ready=False, args=["--workers", "2"]) as server:
        limit = time.monotonic() + 90.0
        while httpx.get(f"{server.url}/health/ready", timeout=HANG_S).status_code != 200:
            assert time.monotonic() < limit, "never ready"
            time.sleep(0.01)
        client = grpcclient.InferenceServerClient(server.grpc_address)
        assert client.is_server_ready(client_timeout=HANG_S)
        with grpc.insecure_channel(server.grpc_address) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=HANG_S)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
