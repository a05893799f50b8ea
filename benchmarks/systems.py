"""The contenders as processes: start one on a free loopback port, wait for it, sample its memory, stop it.

Every system runs in its own process tree, apart from the harness and the load generator.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.workloads import REPO, Workload

__all__ = ["SYSTEMS", "RssSampler", "Server", "free_port", "launch", "request_target", "serve", "serve_router"]

SYSTEMS = ("router", "single_queue", "litserve")
BOUNDARY = "benchmarkboundary7d1f"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    system: str
    url: str
    path: str  # the predict path
    process: subprocess.Popen[bytes]
    log_path: Path


def _command(system: str, workload: Workload, port: int, store: Path, scratch: Path) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if system == "router":
        config = scratch / f"fleet-{workload.name}.yaml"
        config.write_text(workload.fleet_yaml(store), encoding="utf-8")
        env |= {"MODEL_ROUTER_HOST": "127.0.0.1", "MODEL_ROUTER_PORT": str(port), "MODEL_ROUTER_CONFIG": str(config),
                "MODEL_ROUTER_GRPC_PORT": "0"}
        return [sys.executable, "-m", "router", "serve"], env
    module = {"single_queue": "benchmarks.single_queue", "litserve": "benchmarks.litserve_app"}[system]
    return [sys.executable, "-m", module, "--workload", workload.name, "--port", str(port), "--store", str(store)], env


def request_target(system: str, workload: Workload, scratch: Path) -> str:
    """The load generator's `--target` for this system: the same input bytes, in the form it takes."""
    body = workload.request_body()
    path = f"/models/{workload.name}/predict" if system == "router" else "/predict"
    content_type = workload.content_type
    if system == "litserve" and not content_type.startswith("application/json"):
        body = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"input\"\r\n"
                f"Content-Type: {content_type}\r\n\r\n").encode() + body + f"\r\n--{BOUNDARY}--\r\n".encode()
        content_type = f"multipart/form-data; boundary={BOUNDARY}"
    body_file = scratch / f"body-{system}-{workload.name}.bin"
    body_file.write_bytes(body)
    return f"{path}={content_type}:@{body_file}"


@contextmanager
def serve(system: str, workload: Workload, store: Path, scratch: Path, timeout_s: float = 120.0) -> Iterator[Server]:
    """Start `system` serving `workload`, wait until its health check answers 200, stop it afterwards."""
    port = free_port()
    command, env = _command(system, workload, port, store, scratch)
    path = f"/models/{workload.name}/predict" if system == "router" else "/predict"
    health = "/health/ready" if system == "router" else "/health"
    with launch(system, command, env, port, path, health, scratch / f"{system}-{workload.name}-{port}.log",
                timeout_s) as server:
        yield server


@contextmanager
def serve_router(fleet_yaml: str, scratch: Path, timeout_s: float = 300.0,
                 env_extra: dict[str, str] | None = None) -> Iterator[Server]:
    """A router serving a whole fleet file (several models on one device), with extra settings."""
    port = free_port()
    config = scratch / f"fleet-{port}.yaml"
    config.write_text(fleet_yaml, encoding="utf-8")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MODEL_ROUTER_HOST": "127.0.0.1",
           "MODEL_ROUTER_PORT": str(port), "MODEL_ROUTER_CONFIG": str(config), "MODEL_ROUTER_GRPC_PORT": "0",
           **(env_extra or {})}
    with launch("router", [sys.executable, "-m", "router", "serve"], env, port, "/models", "/health/ready",
                scratch / f"router-fleet-{port}.log", timeout_s) as server:
        yield server


@contextmanager
def launch(system: str, command: list[str], env: dict[str, str], port: int, path: str, health: str,
           log_path: Path, timeout_s: float, cwd: Path = REPO) -> Iterator[Server]:
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    server = Server(system, f"http://127.0.0.1:{port}", path, process, log_path)
    try:
        _wait_healthy(server, health, timeout_s)
        yield server
    finally:
        _stop(process)


def _wait_healthy(server: Server, path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{server.system} exited with {server.process.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(server.url + path, timeout=1.0) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{server.system} not healthy at {path} after {timeout_s}s; log: {server.log_path}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group (LitServe has workers), then SIGKILL after 15 s."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(5)
    try:  # stragglers of the group (LitServe's inference workers)
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class RssSampler(threading.Thread):
    """Peak resident memory of a process and its children, summed, sampled every 100 ms."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.peak = 0
        self.done = threading.Event()
        self._sample()

    def _sample(self) -> None:
        try:
            processes = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        total = 0
        for process in processes:
            try:
                total += process.memory_info().rss
            except psutil.Error:
                continue
        self.peak = max(self.peak, total)

    def run(self) -> None:
        while not self.done.wait(0.1):
            self._sample()

    def stop(self) -> int:
        self.done.set()
        self.join(2)
        return self.peak
