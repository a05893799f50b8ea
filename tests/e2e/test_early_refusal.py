"""A request that will be refused is answered from its path and headers, before its body is read:
by the connection itself (router.http.early), which then discards the body and serves the next
request on the connection, in the same words as the app."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import HANG_S, metric_value, serve

pytestmark = pytest.mark.e2e

FLEET = """
models:
  slow:
    plugin: scripted
    options: {fixed_ms: 1500}
    queue: {max_size: 1, timeout_ms: 10000}
    batch: {max_size: 1, max_delay_ms: 0}
    warmup: {enabled: false}
  fast:
    plugin: scripted
    options: {fixed_ms: 1}
    warmup: {enabled: false}
"""
BEFORE_THE_APP = "before the app"  # the access line's `refused` field when the connection answered


def _headers_only(url: str, path: str, announced: int) -> bytes:
    """Send a request's headers announcing `announced` body bytes, and no body: the reply. An answer
    can then only come from the headers (the server's body timeout is 60 s, far past HANG_S)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=HANG_S) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {announced}\r\n\r\n".encode()
        )
        reply = sock.recv(65536)
        head, _, body = reply.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
        return head + b"\r\n\r\n" + body


@contextmanager
def _full_queue(server: Any) -> Iterator[None]:
    """Model `slow` with one request running (1.5 s) and one filling its queue of one."""

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
    try:
        yield
    finally:
        for worker in workers:
            worker.join()


def test_a_full_queue_refuses_before_the_body_arrives(tmp_path: Path) -> None:
    with serve(tmp_path, FLEET) as server:
        with _full_queue(server):
            reply = _headers_only(server.url, "/models/slow/predict", 10_000_000)  # under the body limit
        metrics = httpx.get(f"{server.url}/metrics").text

    status_line = reply.split(b"\r\n", 1)[0]
    assert status_line == b"HTTP/1.1 503 Service Unavailable", reply[:300]
    assert b"retry-after" in reply.lower()
    assert b"queue is full" in reply
    assert metric_value(metrics, "model_router_requests_total", model="slow", outcome="rejected_full") == 1


def test_an_unknown_model_is_refused_before_the_body_arrives(tmp_path: Path) -> None:
    with serve(tmp_path, FLEET) as server:
        reply = _headers_only(server.url, "/models/nope/predict", 50_000_000)
    assert reply.startswith(b"HTTP/1.1 404"), reply[:300]


# -- on a kept-alive connection ---------------------------------------------------------------------


def _read_response(stream: Any) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response from a socket's file: status, headers (lower-case names), body."""
    status_line = stream.readline()
    assert status_line, "the connection closed before a response"
    headers: dict[str, str] = {}
    while (line := stream.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, stream.read(int(headers.get("content-length", "0")))


def _post(path: str, body: bytes, *headers: str, chunked: bool = False) -> bytes:
    """A raw POST with a body, by Content-Length or in chunks."""
    extra = "".join(f"{header}\r\n" for header in headers)
    if chunked:
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 65536]), body[i:i + 65536])
                          for i in range(0, len(body), 65536))
        return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nTransfer-Encoding: chunked\r\n"
                f"{extra}\r\n").encode() + chunks + b"0\r\n\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: {len(body)}\r\n"
            f"{extra}\r\n").encode() + body


def _access_lines_of(server: Any, request_id: str, count: int) -> list[dict[str, object]]:
    """The access lines of requests with this id, once the log's writer thread has written `count`."""
    deadline = time.monotonic() + 5
    while True:
        lines = [r for r in server.log_records() if r.get("message") == "request" and r.get("request_id") == request_id]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


GET_FAST = b"GET /models/fast HTTP/1.1\r\nHost: x\r\n\r\n"
PREDICT_FAST = b'POST /models/fast/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"id": "a"}'


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_refusal_from_the_headers_discards_the_body_and_serves_the_next_request(tmp_path: Path,
                                                                                 chunked: bool) -> None:
    """The 503 of a full queue comes from the connection (the access line says so), with the app's
    status, Retry-After, request id and words; the 300 KB body behind it is discarded, and the
    connection then serves a predict and a read in order."""
    body = bytes(range(256)) * 1200
    with serve(tmp_path, FLEET) as server, _full_queue(server), server.connect() as sock:
        sock.sendall(_post("/models/slow/predict", body, "X-Request-ID: early-1", chunked=chunked))
        stream = sock.makefile("rb")
        status, headers, answer = _read_response(stream)
        sock.sendall(PREDICT_FAST + GET_FAST)
        after = [_read_response(stream), _read_response(stream)]
        lines = server.access_lines("early-1")

    assert status == 503
    assert int(headers["retry-after"]) >= 1
    assert headers["x-request-id"] == "early-1" and headers["content-type"] == "application/json"
    assert "connection" not in headers  # kept alive
    decoded = json.loads(answer)
    assert decoded["request_id"] == "early-1" and "queue is full" in decoded["detail"]
    assert [line["refused"] for line in lines] == [BEFORE_THE_APP], lines
    assert lines[0]["status"] == 503 and lines[0]["model"] == "slow"
    assert [s for s, _, _ in after] == [200, 200]
    assert json.loads(after[0][2])["model"] == "fast"
    assert json.loads(after[1][2])["name"] == "fast"


@pytest.mark.parametrize(("path", "header", "status", "words"), [
    ("/models/nope/predict", "X-Priority: 1", 404, "nope"),
    ("/models/fast/predict", "X-Priority: soon", 400, "X-Priority must be an integer, got 'soon'"),
    ("/models/fast/predict", "X-Timeout-Ms: never", 400, "X-Timeout-Ms must be a number"),
])
def test_the_connection_and_the_app_refuse_in_the_same_words(tmp_path: Path, path: str, header: str, status: int,
                                                             words: str) -> None:
    """The same refused request twice: alone on an idle connection (answered by the connection),
    then pipelined behind a predict (its answer must wait its turn, so the app gives it)."""
    refused = _post(path, b"x" * 1000, header, "X-Request-ID: same-words")
    with serve(tmp_path, FLEET) as server, server.connect() as sock:
        stream = sock.makefile("rb")
        sock.sendall(refused)
        early = _read_response(stream)
        sock.sendall(PREDICT_FAST + refused)  # in one write: the second arrives while the first runs
        in_order = [_read_response(stream), _read_response(stream)]
        lines = _access_lines_of(server, "same-words", count=2)

    by_app = in_order[1]
    assert in_order[0][0] == 200, in_order[0]
    assert early[0] == by_app[0] == status
    early_body, app_body = json.loads(early[2]), json.loads(by_app[2])
    assert words in early_body["detail"]
    assert early_body["detail"] == app_body["detail"]
    assert early[2].startswith(b'{"detail":') and by_app[2].startswith(b'{"detail":')
    assert [line.get("refused") for line in lines] == [BEFORE_THE_APP, None], lines


def test_expect_100_continue_gets_its_refusal_and_a_closed_connection(tmp_path: Path) -> None:
    """A client that waits for 100 Continue may never send its body: after the refusal the
    connection closes, so no body bytes can be read as the next request."""
    with serve(tmp_path, FLEET) as server, server.connect() as sock:
        sock.sendall(b"POST /models/nope/predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
                     b"Content-Length: 5000000\r\nExpect: 100-continue\r\n\r\n")
        stream = sock.makefile("rb")
        status, headers, _ = _read_response(stream)
        rest = stream.read()  # until the server closes
    assert status == 404
    assert headers["connection"] == "close"
    assert rest == b""


def test_with_keys_required_only_a_key_holder_is_refused_by_the_connection(tmp_path: Path) -> None:
    """Without a valid key the app answers 401 in its own words; with one, the connection answers
    the refusal itself."""
    with serve(tmp_path, FLEET, env={"MODEL_ROUTER_API_KEYS": "k-early-0123456789abcdef"}) as server:
        no_key = httpx.post(f"{server.url}/models/nope/predict", content=b"x", headers={"X-Request-ID": "no-key"})
        with_key = httpx.post(f"{server.url}/models/nope/predict", content=b"x",
                              headers={"X-Request-ID": "with-key", "Authorization": "Bearer k-early-0123456789abcdef"})
        lines = server.access_lines("no-key") + server.access_lines("with-key")
    assert no_key.status_code == 401
    assert with_key.status_code == 404
    assert [line.get("refused") for line in lines] == [None, BEFORE_THE_APP], lines
