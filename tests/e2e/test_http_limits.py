"""What one client can make the server hold or wait for, against a real server: header size and
count (431), slow headers and bodies (408, then the connection closes), idle connections, and
uvicorn's own 400 for a request it cannot parse (JSON, like every other error)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import HANG_S, RouterProcess, liveness_watched, serve

pytestmark = pytest.mark.e2e

FLEET = """
models:
  echo:
    plugin: scripted
    batch: {max_size: 4, max_delay_ms: 2}
"""
MB = 1024 * 1024
#: What the server may hold on to after the floods below: well under one flood's size.
RSS_GROWTH_BOUND = 30 * MB
ENV = {"MODEL_ROUTER_HEADER_TIMEOUT_S": "1", "MODEL_ROUTER_BODY_TIMEOUT_S": "1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("limits"), FLEET, env=ENV, memory_limit=8 * 1024 * MB) as process:
        yield process


def read_reply(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (or resets it)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def trickle(sock: socket.socket, pieces: Iterator[bytes], every_s: float = 0.3) -> bytes:
    """Send one piece every `every_s` until the server answers; the answer (read to the close)."""
    sock.settimeout(every_s)
    try:
        for piece in pieces:
            try:
                first = sock.recv(65536)
            except TimeoutError:
                sock.sendall(piece)
                continue
            sock.settimeout(10)
            return first + read_reply(sock)
    except (BrokenPipeError, ConnectionResetError):
        pass
    sock.settimeout(10)
    return read_reply(sock)


def flood(server: RouterProcess, head: bytes, chunks: Iterator[bytes]) -> bytes:
    """Send `head`, then as much of `chunks` as the server takes; the reply."""
    with server.connect() as sock:
        try:
            sock.sendall(head)
            for chunk in chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return read_reply(sock)


def status_and_body(reply: bytes) -> tuple[int, dict[str, str]]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def a_million_headers() -> Iterator[bytes]:
    block = b"".join(b"X-Header-%d: v\r\n" % i for i in range(10_000))
    for _ in range(100):
        yield block
    yield b"\r\n"


def test_a_million_headers_are_refused_without_memory_growth(server: RouterProcess) -> None:
    before = server.rss()
    replies: list[bytes] = []
    floods = [threading.Thread(target=lambda: replies.append(
        flood(server, b"GET /health/live HTTP/1.1\r\nHost: x\r\n", a_million_headers()))) for _ in range(8)]
    with liveness_watched(server) as probes:
        for thread in floods:
            thread.start()
        for thread in floods:
            thread.join()
    assert {probe.status for probe in probes} == {200}
    assert len(replies) == 8
    for reply in replies:
        status, body = status_and_body(reply)
        assert status == 431 and body == {"detail": "the request has more than 100 header fields"}
    assert server.rss() - before < RSS_GROWTH_BOUND
    assert max(probe.seconds for probe in probes) < HANG_S, "liveness hung during the floods"


@pytest.mark.parametrize("path", ["/models/echo/predict", "/v2/models/echo/infer"])
def test_a_50_mb_header_is_refused_early(server: RouterProcess, path: str) -> None:
    before = server.rss()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nX-Big: ".encode()
    reply = flood(server, head, iter([b"b" * MB] * 50 + [b"\r\n\r\n"]))
    status, body = status_and_body(reply)
    assert status == 431
    assert body == {"error" if path.startswith("/v2") else "detail": "the request line and headers exceed 65536 bytes"}
    assert server.rss() - before < RSS_GROWTH_BOUND


def test_slow_headers_are_dropped_after_the_header_timeout(server: RouterProcess) -> None:
    """50 connections sending one header line every 0.3 s (for 18 s if let): each answered 408 and
    closed after the 1 s header timeout."""
    results: list[tuple[float, bytes]] = []

    def slow_client() -> None:
        with server.connect() as sock:
            started = time.monotonic()
            sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n")
            reply = trickle(sock, (b"X-Slow-%d: v\r\n" % i for i in range(60)))
            results.append((time.monotonic() - started, reply))

    clients = [threading.Thread(target=slow_client) for _ in range(50)]
    for client in clients:
        client.start()
    for client in clients:
        client.join()

    assert len(results) == 50
    for elapsed, reply in results:
        assert status_and_body(reply) == (408, {"detail": "the request headers did not arrive within 1 s"})
        assert 0.9 < elapsed < HANG_S
    assert httpx.get(server.url + "/health/live").status_code == 200


def test_an_idle_connection_is_closed_after_the_header_timeout(server: RouterProcess) -> None:
    with server.connect(timeout=3 * HANG_S) as sock:  # a server that never closes it: a timeout past HANG_S
        started = time.monotonic()
        assert read_reply(sock) == b""  # closed without a word: it never began a request
        assert 0.9 < time.monotonic() - started < HANG_S


def test_a_trickling_body_is_answered_408_and_closed(server: RouterProcess) -> None:
    with server.connect() as sock:
        started = time.monotonic()
        sock.sendall(b"POST /models/echo/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Request-ID: slow-body-1\r\nContent-Length: 1000\r\n\r\n")
        reply = trickle(sock, iter([b" "] * 60))  # 18 s if let
        elapsed = time.monotonic() - started
    status, body = status_and_body(reply)
    assert status == 408 and body == {"detail": "the request body did not arrive within 1 s",
                                      "request_id": "slow-body-1"}
    assert b"connection: close" in reply.lower()
    assert 0.9 < elapsed < HANG_S
    assert [r["status"] for r in server.access_lines("slow-body-1")] == [408]


def test_a_body_left_unread_after_an_early_answer_is_cut_off(server: RouterProcess) -> None:
    """A 404 answered before the body: a client that keeps trickling the body is disconnected."""
    with server.connect() as sock:
        started = time.monotonic()
        sock.sendall(b"POST /models/nope/predict HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        assert trickle(sock, iter([b" "] * 30)).startswith(b"HTTP/1.1 404")  # answered before the body
        try:
            for _ in range(60):
                sock.sendall(b" ")
                time.sleep(0.3)
        except (BrokenPipeError, ConnectionResetError):
            pass
        elapsed = time.monotonic() - started
    assert elapsed < HANG_S  # cut off after the body timeout (1 s) and its grace second, not the 18 s it wanted


@pytest.mark.parametrize("request_bytes", [b"NOT HTTP AT ALL\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"])
def test_unparseable_requests_get_a_json_400(server: RouterProcess, request_bytes: bytes) -> None:
    with server.connect() as sock:
        sock.sendall(request_bytes)
        reply = read_reply(sock)
    status, body = status_and_body(reply)
    assert status == 400 and body["detail"].startswith("invalid HTTP request")
    assert b"content-type: application/json" in reply.lower()
