"""Shared fixtures: a real router process on a loopback port, and fleet files in tmp dirs."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.cli import parser as cli_parser

REPO = Path(__file__).resolve().parents[1]
#: The only wall-clock bound a test may assert: long enough that a machine with a core kept busy
#: never reaches it, short enough to tell a hang from a slow answer. Speed is `make bench`'s to measure.
HANG_S = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RouterProcess:
    """A `model-router serve` child process and its log."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    grpc_address: str = ""  # host:port of its gRPC endpoint

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def log_records(self) -> list[dict[str, object]]:
        """The JSON lines written so far; a last line the writer thread has not finished is left out."""
        text = self.log()
        records = []
        for line in text[:text.rfind("\n") + 1].splitlines():
            if line.startswith("{"):
                records.append(json.loads(line))
        return records

    def access_lines(self, request_id: str, timeout: float = 5.0) -> list[dict[str, object]]:
        """The request's access lines, once the log's writer thread has written them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = [r for r in self.log_records() if r.get("request_id") == request_id and r["message"] == "request"]
            if lines:
                return lines
            time.sleep(0.05)
        return []

    def until_model(self, name: str, condition: Callable[[dict[str, Any]], bool], timeout: float = 30.0) -> dict[str, Any]:
        """Poll `GET /models/{name}` until `condition` holds of it: ordering by state, not by sleeping."""
        deadline = time.monotonic() + timeout
        while True:
            model: dict[str, Any] = httpx.get(f"{self.url}/models/{name}", timeout=10).json()
            if condition(model):
                return model
            assert time.monotonic() < deadline, f"model {name} never reached the expected state: {model}"
            time.sleep(0.01)

    def connect(self, timeout: float = 10.0) -> socket.socket:
        """A raw TCP connection to the server, for requests no HTTP client would send."""
        host, port = self.url.removeprefix("http://").split(":")
        return socket.create_connection((host, int(port)), timeout=timeout)

    def rss(self) -> int:
        """The server process's resident memory, in bytes."""
        import psutil

        return int(psutil.Process(self.process.pid).memory_info().rss)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
            raise AssertionError(f"server did not exit within {timeout}s after signal {sig}:\n{self.log()[-3000:]}")


@contextmanager
def serve(
    tmp_path: Path, fleet: str, *, env: dict[str, str] | None = None, wait_ready: bool = True, timeout: float = 90.0,
    memory_limit: int | None = None, args: Sequence[str] = (),
) -> Iterator[RouterProcess]:
    """Write `fleet` to a file, start `python -m router serve` on a free port (and gRPC on another:
    never the shared default 8001, which SO_REUSEPORT would let two test servers split), wait until
    ready. With `memory_limit` (bytes of address space, as `prlimit --as`), a regression that makes
    the server balloon fails its test instead of exhausting the machine. `args`: flags after `serve`;
    the server is looked for where its `--host`, `--port` and `--grpc-port` say."""
    config = tmp_path / "fleet.yaml"
    config.write_text(fleet, encoding="utf-8")
    port, grpc_port = free_port(), free_port()
    log_path = tmp_path / f"server-{port}.log"
    child_env = {**os.environ, "MODEL_ROUTER_HOST": "127.0.0.1", "MODEL_ROUTER_PORT": str(port),
                 "MODEL_ROUTER_GRPC_PORT": str(grpc_port), "MODEL_ROUTER_CONFIG": str(config), **(env or {})}
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen([*_limited(memory_limit), sys.executable, "-m", "router", "serve", *args], cwd=REPO,
                                   env=child_env, stdout=log_file, stderr=subprocess.STDOUT)
    flags = cli_parser().parse_args(["serve", *args])
    host = flags.host or child_env["MODEL_ROUTER_HOST"]
    host = f"[{host}]" if ":" in host else host
    port = child_env["MODEL_ROUTER_PORT"] if flags.port is None else flags.port
    grpc_port = child_env["MODEL_ROUTER_GRPC_PORT"] if flags.grpc_port is None else flags.grpc_port
    server = RouterProcess(f"http://{host}:{port}", process, log_path, f"{host}:{grpc_port}")
    try:
        _wait_for(server, "/health/ready" if wait_ready else "/health/live", timeout)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


@dataclass(frozen=True)
class Probe:
    status: int  # 0: no answer
    seconds: float


@contextmanager
def liveness_watched(server: RouterProcess, every_s: float = 0.05) -> Iterator[list[Probe]]:
    """Ask /health/live in a thread, one probe every `every_s`, while the block runs; the probes,
    for the test to assert on after it (at least one is taken)."""
    probes: list[Probe] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while not stop.is_set() or not probes:
                started = time.monotonic()
                try:
                    status = client.get("/health/live").status_code
                except httpx.HTTPError:
                    status = 0
                probes.append(Probe(status, time.monotonic() - started))
                stop.wait(every_s)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        yield probes
    finally:
        stop.set()
        prober.join()


def _limited(memory_limit: int | None) -> list[str]:
    """`prlimit --as=N` before the command (it execs it: the pid stays the server's), or nothing."""
    if memory_limit is None:
        return []
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        pytest.skip("prlimit (util-linux) is needed to run this server under a memory limit")
    return [prlimit, f"--as={memory_limit}"]


def _wait_for(server: RouterProcess, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(f"server exited with {server.process.returncode}:\n{server.log()[-3000:]}")
        try:
            if httpx.get(server.url + path, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"server not up at {path} after {timeout}s:\n{server.log()[-3000:]}")


def read_records(path: Path) -> list[dict[str, object]]:
    """Batches the scripted plugin recorded (warm-up batches left out)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [row for row in rows if "warmup" not in row["ids"]]  # type: ignore[operator]


def metric_value(text: str, name: str, **labels: str) -> float:
    """One sample from Prometheus text output, whatever the order of its labels (0 if absent)."""
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        metric, _, rest = series.partition("{")
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))
        if metric == name and found == labels:
            return float(value)
    return 0.0


@pytest.fixture
def record_file(tmp_path: Path) -> Path:
    return tmp_path / "batches.jsonl"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests skip cleanly, with the reason printed, where there is no CUDA device."""
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
