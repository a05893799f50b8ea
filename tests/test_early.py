"""The connection's early refusal: the screen as a function of (method, URL, headers) over a
recording façade, and the protocol's fallback to the app when a screen fails, on a real uvicorn;
and the answer's head and body written as one."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn

from router.errors import ModelNotFound, QueueFull, RouterError
from router.http.auth import AccessPolicy
from router.http.early import EarlyRefusals
from router.http.protocol import SCREENED, EarlyAnswer, HttpLimits, guarded_protocol
from tests.conftest import free_port

KEY = b"k-0123456789abcdef"


#: What the recording façade's screen makes of a request it lets through.
LET_THROUGH = object()


class Facade:
    """Records each screen; raises `refusal` when set, else lets the request through."""

    def __init__(self, refusal: RouterError | None = None) -> None:
        self.refusal = refusal
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def screen(self, model: str, **kwargs: Any) -> object:
        self.calls.append((model, kwargs))
        if self.refusal is not None:
            raise self.refusal
        return LET_THROUGH


def screen(refusal: RouterError | None = None, policy: AccessPolicy | None = None) -> tuple[EarlyRefusals, Facade]:
    facade = Facade(refusal)
    return EarlyRefusals(facade, policy or AccessPolicy()), facade  # type: ignore[arg-type]


def headers(*pairs: tuple[str, str]) -> list[tuple[bytes, bytes]]:
    return [(name.encode(), value.encode()) for name, value in pairs]


def test_a_refusal_is_the_apps_answer() -> None:
    early, facade = screen(QueueFull("the queue is full", retry_after_s=1.2))
    answer = early(b"POST", b"/models/m/predict", headers(("x-priority", "2"), ("x-timeout-ms", "250"),
                                                         ("content-length", "1000"), ("x-request-id", "r-1")))
    assert answer is not None and answer.status == 503
    assert dict(answer.headers) == {b"retry-after": b"2", b"content-type": b"application/json", b"x-request-id": b"r-1"}
    assert json.loads(answer.body) == {"detail": "the queue is full", "request_id": "r-1"}
    [(model, kwargs)] = facade.calls
    assert model == "m" and kwargs["priority"] == 2 and kwargs["timeout_ms"] == 250 and kwargs["body_bytes"] == 1000


def test_a_request_id_that_is_not_sane_is_replaced() -> None:
    early, _ = screen(ModelNotFound("no model 'm'"))
    answer = early(b"POST", b"/models/m/predict", headers(("x-request-id", "bad id with spaces")))
    assert answer is not None
    rid = dict(answer.headers)[b"x-request-id"].decode()
    assert rid != "bad id with spaces" and len(rid) == 32 and json.loads(answer.body)["request_id"] == rid


def test_a_bad_header_is_refused_before_the_runtime_is_asked() -> None:
    early, facade = screen()
    answer = early(b"POST", b"/models/m/predict", headers(("x-timeout-ms", "inf")))
    assert answer is not None and answer.status == 400
    assert json.loads(answer.body)["detail"] == "X-Timeout-Ms must be a number, like 500 or 2.5, got 'inf'"
    assert facade.calls == []


def test_an_admitted_request_goes_on_to_the_app_as_checked() -> None:
    early, facade = screen()
    assert early(b"POST", b"/models/m/predict", headers(("content-length", "10"))) is LET_THROUGH
    assert len(facade.calls) == 1


@pytest.mark.parametrize(("method", "url", "fields"), [
    (b"GET", b"/models/m/predict", []),  # not the predict route's method
    (b"POST", b"/models/m", []),
    (b"POST", b"/models/m/predict?x=1", []),  # a query: the app parses it
    (b"POST", b"/models/m%2Fx/predict", []),  # percent-encoded: the app decodes it
    (b"POST", b"http://host/models/m/predict", []),  # absolute form
    (b"POST", b"/v2/models/m/infer", []),
    (b"POST", b"/models/m/predict", [("x-priority", "1"), ("x-priority", "2")]),  # which one counts is the app's call
])
def test_what_the_screen_leaves_to_the_app(method: bytes, url: bytes, fields: list[tuple[str, str]]) -> None:
    early, facade = screen(QueueFull("full"))
    assert early(method, url, headers(*fields)) is None
    assert facade.calls == []


def test_without_a_valid_key_the_app_answers() -> None:
    policy = AccessPolicy(predict_keys=(KEY,))
    early, facade = screen(ModelNotFound("no model 'm'"), policy)
    assert early(b"POST", b"/models/m/predict", headers(("authorization", "Bearer wrong-key-0123456789"))) is None
    assert early(b"POST", b"/models/m/predict", []) is None
    assert facade.calls == []
    answer = early(b"POST", b"/models/m/predict", headers(("authorization", f"Bearer {KEY.decode()}")))
    assert answer is not None and answer.status == 404


# -- the protocol, on a real uvicorn ------------------------------------------------------------------


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body, answers 200 with its length and whether the screen checked it."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = json.dumps({"app": True, "bytes": size, "checked": scope["state"].get(SCREENED) is not None}).encode()
    if scope["path"] == "/big":  # an answer larger than a head is joined to
        body = json.dumps({"app": True, "bytes": size, "pad": "x" * 200_000}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def failing_screen(method: bytes, url: bytes, fields: Sequence[tuple[bytes, bytes]]) -> EarlyAnswer | None:
    raise RuntimeError("a bug in the screen")


def refusing_screen(method: bytes, url: bytes, fields: Sequence[tuple[bytes, bytes]]) -> object:
    """Refuses /refuse, passes /pass, leaves the rest."""
    if url == b"/refuse":
        return EarlyAnswer(503, ((b"retry-after", b"1"),), b'{"detail":"no"}')
    return LET_THROUGH if url == b"/pass" else None


@contextmanager
def running(screen_fn: Any, protocol: type[Any] | None = None) -> Iterator[str]:
    """uvicorn on a loopback port with the guarded protocol and `screen_fn` (or `protocol`), in a thread."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="off", access_log=False,
                            http=protocol or guarded_protocol(HttpLimits(), screen_fn), ws="none")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def exchange(address: str, raw: bytes, replies: int) -> list[tuple[int, bytes]]:
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(raw)
        return exchange_on(sock.makefile("rb"), replies)


def exchange_on(stream: Any, replies: int) -> list[tuple[int, bytes]]:
    """`replies` answers read from a connection's stream: (status, body) each."""
    out = []
    for _ in range(replies):
        status = int(stream.readline().split()[1])
        length = 0
        while (line := stream.readline()) != b"\r\n":
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        out.append((status, stream.read(length)))
    return out


def post(path: str, body: bytes) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def test_a_failing_screen_leaves_the_request_to_the_app(caplog: pytest.LogCaptureFixture) -> None:
    with running(failing_screen) as address:
        [(status, body)] = exchange(address, post("/refuse", b"x" * 5000), 1)
        assert status == 200 and json.loads(body) == {"app": True, "bytes": 5000, "checked": False}
    assert "the early refusal screen failed" in caplog.text


def test_an_early_answer_discards_exactly_its_body() -> None:
    """Refused with its 200 KB body in the same write as the next request: that request reaches
    the app whole, so not a byte too many or too few was discarded."""
    with running(refusing_screen) as address:
        replies = exchange(address, post("/refuse", b"y" * 200_000) + post("/next", b"z" * 777), 2)
    assert replies[0] == (503, b'{"detail":"no"}')
    assert replies[1][0] == 200 and json.loads(replies[1][1]) == {"app": True, "bytes": 777, "checked": False}


def test_a_request_the_screen_passed_reaches_the_app_marked_checked() -> None:
    with running(refusing_screen) as address:
        replies = exchange(address, post("/pass", b"p" * 10) + post("/other", b"o"), 2)
    assert [json.loads(body) for _, body in replies] == [{"app": True, "bytes": 10, "checked": True},
                                                         {"app": True, "bytes": 1, "checked": False}]


# -- the answer in one write ------------------------------------------------------------------------


class Recorded:
    """The connection's real transport, with each write recorded on its way through."""

    def __init__(self, transport: Any, writes: list[bytes]) -> None:
        self.transport, self.writes = transport, writes

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.transport.write(data)

    def writelines(self, parts: Sequence[bytes]) -> None:
        self.writes.append(b"".join(parts))
        self.transport.writelines(parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


def recording_protocol(writes: list[bytes]) -> type[Any]:
    class Recording(guarded_protocol(HttpLimits(), refusing_screen)):  # type: ignore[misc]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(Recorded(transport, writes))

    return Recording


def test_an_answers_head_and_body_go_out_in_one_write() -> None:
    """uvicorn writes a head, then the body: two writes, two segments, two wakes of the client.
    The guarded protocol holds the head for the body's write; pipelined answers stay in order."""
    writes: list[bytes] = []
    with running(None, recording_protocol(writes)) as address:
        replies = exchange(address, post("/a", b"1" * 10) + post("/b", b"2" * 20), 2)
    assert [json.loads(body)["bytes"] for _, body in replies] == [10, 20]
    assert len(writes) == 2, writes
    for write, size in zip(writes, (10, 20), strict=True):
        assert write.startswith(b"HTTP/1.1 200 OK\r\n") and write.endswith(b'"bytes": %d, "checked": false}' % size)


def test_a_large_answer_goes_out_whole_in_one_gathered_write() -> None:
    writes: list[bytes] = []
    with running(None, recording_protocol(writes)) as address:
        [(status, body)] = exchange(address, post("/big", b"123"), 1)
    assert status == 200 and json.loads(body) == {"app": True, "bytes": 3, "pad": "x" * 200_000}
    assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(body)


def test_a_head_requests_answer_is_its_head_alone() -> None:
    """No body is written for HEAD: its head goes out as it comes, and the next answer follows it."""
    writes: list[bytes] = []
    with running(None, recording_protocol(writes)) as address:
        host, port = address.split(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"HEAD /a HTTP/1.1\r\nHost: x\r\n\r\n" + post("/b", b"xyz"))
            stream = sock.makefile("rb")
            head = [stream.readline()]
            while head[-1] != b"\r\n":
                head.append(stream.readline())
            [(status, body)] = exchange_on(stream, 1)
    assert head[0].startswith(b"HTTP/1.1 200") and any(line.startswith(b"content-length: ") for line in head)
    assert status == 200 and json.loads(body)["bytes"] == 3
    assert writes[0].endswith(b"\r\n\r\n") and b"bytes" not in writes[0]
