"""What a client can do to the connection layer, round 2, against a real server: idle connections
by the hundred, chunked trailers (as headers, and huge), a request pipelined after a large body,
`Expect: 100-continue` answered early, trailers after an early answer, a half-closed socket, bad
framing after the app answered, a request without Host. Liveness answers throughout."""

from __future__ import annotations

import json
import re
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
  slow:
    plugin: scripted
    options: {fixed_ms: 3000}
    queue: {max_size: 64}
    batch: {max_size: 64, max_delay_ms: 100}
    warmup: {enabled: false}
"""
KEY = "k-0123456789abcdef"
AUTH = f"Authorization: Bearer {KEY}\r\n".encode()
MAX_CONNECTIONS = 24
MAX_HEADER_BYTES = 16 * 1024
ENV = {"MODEL_ROUTER_MAX_CONNECTIONS": str(MAX_CONNECTIONS), "MODEL_ROUTER_HEADER_TIMEOUT_S": "5",
       "MODEL_ROUTER_MAX_HEADER_BYTES": str(MAX_HEADER_BYTES),
       "MODEL_ROUTER_BODY_TIMEOUT_S": "2", "MODEL_ROUTER_API_KEYS": KEY, "MODEL_ROUTER_MAX_BODY_BYTES": str(1 << 20)}
PREDICT = b"POST /models/echo/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
LIVE = b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("connections"), FLEET, env=ENV, memory_limit=8 << 30) as process:
        yield process


def read_all(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything until the server closes the connection, or `timeout` passes without a byte."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def one_response(sock: socket.socket, timeout: float = 15.0) -> bytes:
    """One whole response (by its Content-Length), whether or not the connection stays open."""
    sock.settimeout(timeout)
    data = b""
    while True:
        head, separator, body = data.partition(b"\r\n\r\n")
        if separator:
            length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                           if line.startswith(b"content-length:")), 0)
            if len(body) >= length:
                return data
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(0.1)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def statuses(reply: bytes) -> list[int]:
    """The status of every final response in a reply (interim 1xx left out)."""
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", reply) if int(status) >= 200]


def body_of(reply: bytes) -> dict[str, str]:
    return json.loads(reply.rpartition(b"\r\n\r\n")[2])


def chunked(body: bytes, trailers: bytes = b"") -> bytes:
    return b"%x\r\n%s\r\n0\r\n%s\r\n" % (len(body), body, trailers)


def live(server: RouterProcess) -> int:
    return httpx.get(server.url + "/health/live", timeout=5).status_code


def no_tracebacks(server: RouterProcess) -> None:
    assert "Traceback" not in server.log()
    assert not [r for r in server.log_records() if r.get("level") == "error"]


def test_idle_connections_never_starve_served_requests(server: RouterProcess) -> None:
    """2.5 times max_connections opened and left silent: the longest-idle ones are closed for the
    new ones (as nginx reuses keep-alive connections), and liveness and predictions answer."""
    idle = [server.connect() for _ in range(MAX_CONNECTIONS * 5 // 2)]
    try:
        probes = [live(server) for _ in range(10)]
        predicted = httpx.post(server.url + "/models/echo/predict", json={"id": "served"},
                               headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
        closed = sum(closed_by_server(sock) for sock in idle[:MAX_CONNECTIONS])
        kept = sum(not closed_by_server(sock) for sock in idle[-MAX_CONNECTIONS // 2:])
    finally:
        for sock in idle:
            sock.close()
    assert probes == [200] * 10
    assert predicted.status_code == 200, predicted.text
    assert closed == MAX_CONNECTIONS  # the oldest ones made room
    assert kept == MAX_CONNECTIONS // 2  # the newest stay open (for their header timeout)
    assert [r for r in server.log_records() if "to make room" in str(r.get("message"))]


def test_running_requests_at_the_limit_get_503_and_liveness_still_answers(server: RouterProcess) -> None:
    body = b'{"id": "s"}'
    running = [server.connect() for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in running:
            sock.sendall(b"POST /models/slow/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + AUTH + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(1.0)  # let the server read them all: their batch runs for 3 s
        over = httpx.post(server.url + "/models/echo/predict", json={"id": "over"},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
        alive = live(server)
        answers = [statuses(one_response(sock)) for sock in running]
    finally:
        for sock in running:
            sock.close()
    assert over.status_code == 503 and over.headers["retry-after"] == "1", over.text
    assert alive == 200
    assert answers == [[200]] * MAX_CONNECTIONS


def test_a_trailer_never_becomes_a_header(server: RouterProcess) -> None:
    """An Authorization sent only as a trailer does not authorize (RFC 9110 section 6.5)."""
    with server.connect() as sock:
        sock.sendall(PREDICT + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(b'{"id": "t"}', AUTH))
        reply = one_response(sock)
    assert statuses(reply) == [401], reply[:300]


def test_trailers_count_toward_the_header_limits(server: RouterProcess) -> None:
    def huge_trailer() -> bytes:
        with server.connect() as sock:
            try:
                sock.sendall(PREDICT + AUTH + b"Transfer-Encoding: chunked\r\n\r\n" + b'b\r\n{"id": "t"}\r\n0\r\nX-Big: ')
                for _ in range(20):
                    sock.sendall(b"b" * (1 << 20))
            except (BrokenPipeError, ConnectionResetError):
                pass
            return read_all(sock)

    replies: list[bytes] = []
    floods = [threading.Thread(target=lambda: replies.append(huge_trailer())) for _ in range(8)]
    with liveness_watched(server) as probes:
        for flood in floods:
            flood.start()
        for flood in floods:
            flood.join()
    assert len(replies) == 8
    for reply in replies:
        assert statuses(reply) == [431], reply[:300]
        assert body_of(reply) == {"detail": f"the request's headers and trailers exceed {MAX_HEADER_BYTES} bytes"}
    with server.connect() as sock:  # and more than 100 fields, trailers included
        sock.sendall(PREDICT + AUTH + b"Transfer-Encoding: chunked\r\n\r\n"
                     + chunked(b'{"id": "t"}', b"".join(b"T-%d: v\r\n" % i for i in range(120))))
        assert statuses(read_all(sock)) == [431]
    assert {probe.status for probe in probes} == {200}
    assert max(probe.seconds for probe in probes) < HANG_S, "liveness hung"


def test_a_request_pipelined_after_a_large_body_is_served(server: RouterProcess) -> None:
    """The end of a 100 KB body (more than the 16 KB header limit of it) and the start of the next
    request arrive in one read: no false 431 for the next request, and both are answered."""
    body = b'{"id": "big"}' + b" " * 100_000
    with server.connect() as sock:
        sock.sendall(PREDICT + AUTH + b"Content-Length: %d\r\n\r\n" % len(body) + body[:-30_000])
        time.sleep(0.2)
        sock.sendall(body[-30_000:] + b"GET /health/live HTTP/1.1\r\nHost: x\r\n")  # the next head, begun
        time.sleep(0.2)
        sock.sendall(b"Connection: close\r\n\r\n")
        reply = read_all(sock)
    assert statuses(reply) == [200, 200], reply[:600]
    assert b'"id":"big"' in reply and b'"status":"live"' in reply


def test_an_early_final_answer_to_expect_100_continue_closes_the_connection(server: RouterProcess) -> None:
    """Answered 401 before its body was asked for, the client sends no body: its next request must
    not be read as one. The answer says `connection: close` and the connection closes."""
    with server.connect() as sock:
        sock.sendall(b"POST /models/echo/predict HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 38\r\n\r\n")
        first = one_response(sock)
        assert statuses(first) == [401] and b"connection: close" in first.lower(), first[:300]
        try:
            sock.sendall(LIVE)  # the client's next request
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert read_all(sock, timeout=3) == b""


def test_trailers_after_an_early_answer_get_no_second_answer(server: RouterProcess) -> None:
    with server.connect() as sock:
        sock.sendall(b"POST /models/nope/predict HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Transfer-Encoding: chunked\r\n\r\n"
                     + chunked(b"abc", b"".join(b"T-%d: v\r\n" % i for i in range(150))))
        reply = read_all(sock, timeout=3)
    assert statuses(reply) == [404], reply[:400]


def test_a_half_closed_client_gets_its_answer(server: RouterProcess) -> None:
    with server.connect() as sock:
        sock.sendall(PREDICT + AUTH + b"Content-Length: 15\r\nX-Request-ID: half-closed\r\n\r\n" + b'{"id": "half"} ')
        sock.shutdown(socket.SHUT_WR)
        reply = read_all(sock)
    assert statuses(reply) == [200], reply[:300]
    assert body_of(reply)["result"]["id"] == "half"
    assert [line["status"] for line in server.access_lines("half-closed")] == [200]


def test_bad_framing_after_the_apps_answer_is_one_answer_and_no_traceback(server: RouterProcess) -> None:
    """Bad chunk framing behind a request the app answers (401, no key): in the same packet the
    client sees the 400 and the access line says 400; a moment later, it sees only the app's 401.
    Never two answers, and no traceback (500 such requests logged 1.96 MB of them)."""
    head = PREDICT + b"Transfer-Encoding: chunked\r\n"
    for i in range(40):
        with server.connect() as sock:
            sock.sendall(head + b"X-Request-ID: framing-%d\r\n\r\n5\r\nabcde\r\nZZZ\r\n" % i)
            together = read_all(sock, timeout=3)
        assert statuses(together) == [400], together[:300]
    with server.connect() as sock:
        sock.sendall(head + b"X-Request-ID: framing-late\r\n\r\n5\r\nabcde\r\n")
        first = one_response(sock)
        sock.sendall(b"ZZZ\r\n")
        later = first + read_all(sock, timeout=3)
    assert statuses(later) == [401], later[:400]
    assert [line["status"] for line in server.access_lines("framing-0")] == [400]
    assert [line["status"] for line in server.access_lines("framing-late")] == [401]
    no_tracebacks(server)


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GET /health/live HTTP/1.1\r\n\r\n", 400),
    (b"GET /health/live HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    (b"GET /health/live HTTP/1.0\r\n\r\n", 200),
], ids=["no-host", "two-hosts", "http-1.0"])
def test_an_http_1_1_request_needs_one_host(server: RouterProcess, request_bytes: bytes, status: int) -> None:
    with server.connect() as sock:
        sock.sendall(request_bytes)
        reply = read_all(sock, timeout=3)
    assert statuses(reply) == [status], reply[:300]
