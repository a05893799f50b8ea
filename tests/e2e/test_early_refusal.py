"""A request that will be refused is answered from its path and headers, before its body is read."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import metric_value, serve

pytestmark = pytest.mark.e2e

FLEET = """
models:
  slow:
    plugin: scripted
    options: {fixed_ms: 1500}
    queue: {max_size: 1, timeout_ms: 10000}
    batch: {max_size: 1, max_delay_ms: 0}
    warmup: {enabled: false}
"""


def _headers_only(url: str, path: str, announced: int) -> tuple[float, bytes]:
    """Send a request's headers announcing `announced` body bytes, send no body; the reply and its delay."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as sock:
        started = time.monotonic()
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {announced}\r\n\r\n".encode()
        )
        reply = sock.recv(65536)
        delay = time.monotonic() - started
        head, _, body = reply.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
        return delay, head + b"\r\n\r\n" + body


def test_a_full_queue_refuses_before_the_body_arrives(tmp_path: Path) -> None:
    with serve(tmp_path, FLEET) as server:
        # One request runs (1.5 s), one fills the queue of one.
        def send(index: int) -> None:
            httpx.post(f"{server.url}/models/slow/predict", json={"id": f"r{index}"}, timeout=10)

        def until(condition: Callable[[dict[str, Any]], bool]) -> None:
            deadline = time.monotonic() + 10
            while not condition(httpx.get(f"{server.url}/models/slow").json()):
                assert time.monotonic() < deadline, "the model never reached the expected state"
                time.sleep(0.01)

        workers = [threading.Thread(target=send, args=(i,)) for i in range(2)]
        workers[0].start()
        until(lambda model: model["instances"][0]["busy"])  # one running...
        workers[1].start()
        until(lambda model: model["queue"]["depth"] == 1)  # ...one queued: the queue of one is full
        delay, reply = _headers_only(server.url, "/models/slow/predict", 10_000_000)  # under the body limit
        for worker in workers:
            worker.join()
        metrics = httpx.get(f"{server.url}/metrics").text

    status_line = reply.split(b"\r\n", 1)[0]
    assert status_line == b"HTTP/1.1 503 Service Unavailable", reply[:300]
    assert b"retry-after" in reply.lower()
    assert b"queue is full" in reply
    assert delay < 0.5, f"the refusal took {delay:.2f} s: it waited for the body"
    assert metric_value(metrics, "model_router_requests_total", model="slow", outcome="rejected_full") == 1


def test_an_unknown_model_is_refused_before_the_body_arrives(tmp_path: Path) -> None:
    with serve(tmp_path, FLEET) as server:
        delay, reply = _headers_only(server.url, "/models/nope/predict", 50_000_000)
    assert reply.startswith(b"HTTP/1.1 404"), reply[:300]
    assert delay < 0.5
