"""Hostile input against a real server: malformed bodies and headers, huge URLs and headers, bodies
over the limit. Every answer is a 4xx (never a 500 or a dropped connection) and the server lives on."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import RouterProcess, serve

pytestmark = pytest.mark.e2e

FLEET = """
models:
  toy:
    plugin: toy
    batch: {max_size: 4, max_delay_ms: 2}
"""
VECTOR = b'{"x": [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]}'
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with serve(tmp_path_factory.mktemp("hostile"), FLEET, env={"MODEL_ROUTER_MAX_BODY_BYTES": str(LIMIT)}) as process:
        yield process


def raw_exchange(server: RouterProcess, request: bytes, *, read_timeout: float = 5.0) -> bytes:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout) as sock:
        sock.sendall(request)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
                if response_complete(data):
                    break
        except (TimeoutError, ConnectionResetError):
            pass
    return data


def response_complete(data: bytes) -> bool:
    head, separator, body = data.partition(b"\r\n\r\n")
    if not separator:
        return False
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    return False


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def still_serving(server: RouterProcess) -> None:
    ok = httpx.post(server.url + "/models/toy/predict", content=VECTOR, headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(("content_type", "body", "words"), [
    ("multipart/form-data; boundary=xyz", b"--xyz\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nabc", ""),
    ("multipart/form-data", b"--xyz\r\n\r\n", "boundary"),
    ("multipart/form-data; boundary=xyz", b"garbage without any boundary", ""),
    ("application/json", b'{"x": [1, 2', "JSON like"),
    ("application/json", b'{"x": "not a list"}', "list of 16 numbers"),
    ("application/json", b'{"x": [1, 2, 3]}', "list of 16 numbers"),
    ("application/json", b'[1, 2, 3]', "JSON like"),
    ("application/json", b"\xff\xfe\x00garbage", "JSON like"),
    ("text/html", b"<html>", "does not accept text/html"),
    ("", VECTOR, "does not accept"),
])
def test_malformed_bodies_are_4xx(server: RouterProcess, content_type: str, body: bytes, words: str) -> None:
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(server.url + "/models/toy/predict", content=body, headers=headers)
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    assert words in response.json()["detail"]
    still_serving(server)


@pytest.mark.parametrize("value", ["abc", "", "1e400", "nan", "-1", "0", "12ms"])
def test_bad_timeout_header_is_400(server: RouterProcess, value: str) -> None:
    response = httpx.post(server.url + "/models/toy/predict", content=VECTOR,
                          headers={"content-type": "application/json", "X-Timeout-Ms": value})
    assert response.status_code == 400 and "X-Timeout-Ms" in response.json()["detail"]


def test_body_over_the_limit_is_413_without_reading_it_all(server: RouterProcess) -> None:
    announced = 50 * 1024 * 1024  # 50 MB announced; only the headers and a few bytes are sent
    request = (b"POST /models/toy/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n{\"x\": [" % announced)
    response = raw_exchange(server, request)  # no body follows: only the headers can have been read
    assert status_of(response) == 413, response[:200]
    chunked = httpx.post(server.url + "/models/toy/predict", content=iter([b"x" * 32768] * 8),
                         headers={"content-type": "application/json"})  # chunked, no Content-Length
    assert chunked.status_code == 413
    still_serving(server)


@pytest.mark.parametrize("size", [8 * 1024, 100 * 1024])
def test_very_long_urls_and_headers_are_refused_cleanly(server: RouterProcess, size: int) -> None:
    long_url = raw_exchange(server, b"GET /models/" + b"a" * size + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    long_header = raw_exchange(server, b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Junk: " + b"b" * size + b"\r\n\r\n")
    many_headers = raw_exchange(server, b"GET /health/live HTTP/1.1\r\nHost: x\r\n"
                                + b"".join(b"X-H%d: v\r\n" % i for i in range(size // 8)) + b"\r\n")
    for response in (long_url, long_header, many_headers):
        assert response, "the connection was dropped without an answer"
        assert status_of(response) < 500, response[:200]
    still_serving(server)


def test_unknown_model_and_method(server: RouterProcess) -> None:
    assert httpx.post(server.url + "/models/../../etc/passwd/predict", content=VECTOR).status_code == 404
    assert httpx.get(server.url + "/models/toy/predict").status_code == 405
    still_serving(server)
