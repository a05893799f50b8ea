"""Log lines: JSON off a terminal, readable text on one (or as MODEL_ROUTER_LOG_FORMAT says), with
the same fields either way."""

from __future__ import annotations

import io
import json
import logging
import os
import pty
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from router.logs import (
    MAX_FIELD_CHARS,
    MAX_TRACEBACK_CHARS,
    JsonFormatter,
    TextFormatter,
    configure_logging,
    formatter_for,
    info_line,
    record_fields,
    request_id_var,
)
from tests.conftest import serve

ACCESS = {"method": "POST", "path": "/models/m/predict", "status": 200, "duration_ms": 12.5, "model": "m",
          "input_bytes": 14, "queue_wait_ms": 1.25, "batch_size": 4, "execution_ms": 8.0, "note": "two words"}


def access_record() -> logging.LogRecord:
    record = logging.LogRecord("router.access", logging.INFO, __file__, 1, "request", None, None)
    record.__dict__.update(ACCESS)
    return record


def parse_text(line: str) -> dict[str, object]:
    """A text line back into fields: `TS LEVEL LOGGER: MESSAGE key=value ...` (values JSON-quoted when needed)."""
    head = re.match(r"^(\S+) (\w+)\s+(\S+): (\S+)", line)
    assert head, line
    fields: dict[str, object] = dict(zip(("ts", "level", "logger", "message"), head.groups(), strict=True))
    fields["level"] = str(fields["level"]).lower()
    for key, value in re.findall(r' (\w+)=("(?:[^"\\]|\\.)*"|\S+)', line[head.end():]):
        fields[key] = json.loads(value) if value.startswith('"') else value
    return fields


def test_text_and_json_carry_the_same_fields() -> None:
    record = access_record()
    token = request_id_var.set("req-42")
    try:
        as_json = json.loads(JsonFormatter().format(record))
        text = TextFormatter().format(record)
    finally:
        request_id_var.reset(token)
    assert text.split(": request ", 1)[1].startswith("model=m request_id=req-42 method=POST path=/models/m/predict "
                                                      "status=200 duration_ms=12.5 queue_wait_ms=1.25 execution_ms=8.0")
    assert parse_text(text) == {key: value if isinstance(value, str) else json.dumps(value)
                                for key, value in as_json.items()}


def test_an_exception_follows_its_text_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("router", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    first, *rest = TextFormatter().format(record).splitlines()
    assert first.endswith("router: failed") and rest[-1] == "ValueError: boom"


def test_auto_means_text_on_a_terminal_and_json_elsewhere() -> None:
    leader, follower = pty.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as terminal:
            assert isinstance(formatter_for("auto", terminal), TextFormatter)
            assert isinstance(formatter_for("json", terminal), JsonFormatter)
    finally:
        os.close(leader)
        os.close(follower)
    assert isinstance(formatter_for("auto", io.StringIO()), JsonFormatter)
    assert isinstance(formatter_for("text", io.StringIO()), TextFormatter)


@pytest.mark.e2e
def test_a_server_writes_readable_lines_when_asked(tmp_path: Path) -> None:
    with serve(tmp_path, "models:\n  m: {plugin: scripted}\n", env={"MODEL_ROUTER_LOG_FORMAT": "text"}) as server:
        answer = httpx.post(f"{server.url}/models/m/predict", json={"id": "a"}, headers={"X-Request-ID": "text-1"})
        assert answer.status_code == 200
        server.stop()
    lines = server.log().splitlines()
    assert not any(line.startswith("{") for line in lines)
    (access,) = [parse_text(line) for line in lines if "request_id=text-1" in line and ": request " in line]
    assert access["status"] == "200" and access["model"] == "m" and access["level"] == "info"
    assert {"duration_ms", "queue_wait_ms", "execution_ms", "batch_size"} <= access.keys()


def test_a_line_is_bounded_whatever_its_record_holds() -> None:
    """A library's warning that quotes a client's 60 KB header, a long field, a long traceback:
    each cut in its middle, saying how much was cut."""
    try:
        raise ValueError("x" * 60_000)
    except ValueError as exc:
        error = exc
    record = logging.LogRecord("lib", logging.WARNING, __file__, 1, "header `%s` too long", ("h" * 60_000,),
                               (type(error), error, error.__traceback__))
    record.field = "f" * 60_000
    for formatter in (JsonFormatter(), TextFormatter()):
        line = formatter.format(record)
        assert len(line) < 3 * MAX_FIELD_CHARS + MAX_TRACEBACK_CHARS
        assert line.count("characters cut ...]") == 3, line[:300]
    fields = record_fields(record, JsonFormatter())
    assert fields["message"].startswith("header `hhh") and fields["message"].endswith("hhh` too long")
    assert len(fields["field"]) < MAX_FIELD_CHARS + 40 and fields["exception"].startswith("Traceback")


@pytest.fixture
def router_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """A buffer for the router's own logging (`configure_logging`, called in the test, once the
    test's capture has set `sys.stderr`: this swaps it); the test's logging after."""
    from router import logs

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    before = logs._listener, logs._handler, logs._role
    stream = io.StringIO()
    yield stream
    if logs._listener is not None and logs._listener is not before[0]:
        logs._listener.stop()
    logs._listener, logs._handler, logs._role = before
    root.handlers[:], root.level = handlers, level


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_an_access_line_without_a_record_reads_as_one_made_from_a_record(
        fmt: str, router_logging: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    """`info_line` hands the writer the line whole when the router's handler is the only one: the
    same line as the record the standard call makes (the time aside), role included; no record made."""
    from router import logs

    monkeypatch.setattr(sys, "stderr", router_logging)
    configure_logging("info", fmt, role="front 2")  # type: ignore[arg-type]
    log = logging.getLogger("router.access")
    made = []
    real = logging.Logger.makeRecord
    monkeypatch.setattr(logging.Logger, "makeRecord", lambda *a, **k: made.append(a) or real(*a, **k))
    token = request_id_var.set("req-7")
    try:
        info_line(log, "request", ACCESS)
        assert made == []
        log.info("request", extra=ACCESS)
        assert len(made) == 1
    finally:
        request_id_var.reset(token)
    assert logs._listener is not None
    logs._listener.stop()
    direct, recorded = router_logging.getvalue().splitlines()
    parse = json.loads if fmt == "json" else parse_text
    first, second = parse(direct), parse(recorded)
    assert first.pop("ts") and second.pop("ts")
    assert first == second and first["role"] == "front 2" and first["request_id"] == "req-7"
    assert first["message"] == "request" and first["model"] == "m"


def test_an_access_line_reaches_every_other_handler_as_a_record(
        router_logging: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a handler of the user's (or a test's) on the way, the line is a record with the fields,
    and the router's writer gets it too; a disabled logger writes nothing."""
    from router import logs

    monkeypatch.setattr(sys, "stderr", router_logging)
    configure_logging("info", "json")
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    log = logging.getLogger("router.access")
    log.addHandler(keep := Keep())
    try:
        info_line(log, "request", ACCESS, request_id="req-8")
    finally:
        log.removeHandler(keep)
    assert logs._listener is not None
    logs._listener.stop()
    (record,) = seen
    assert record.getMessage() == "request" and record.status == 200 and record.request_id == "req-8"  # type: ignore[attr-defined]
    assert json.loads(router_logging.getvalue())["request_id"] == "req-8"
    log.disabled = True
    try:
        info_line(log, "request", ACCESS)
    finally:
        log.disabled = False
    assert seen == [record]


def test_a_filter_on_the_access_logger_still_sees_every_line(
        router_logging: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator's filter on `router.access` (leaving out health checks, say) decides as it would
    for any record: the line it refuses is not written, the one it lets through is."""
    from router import logs

    monkeypatch.setattr(sys, "stderr", router_logging)
    configure_logging("info", "json")

    class NoHealth(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not str(getattr(record, "path", "")).startswith("/health")

    log = logging.getLogger("router.access")
    log.addFilter(keep := NoHealth())
    try:
        info_line(log, "request", {**ACCESS, "path": "/health/ready"})
        info_line(log, "request", ACCESS)
    finally:
        log.removeFilter(keep)
    assert logs._listener is not None
    logs._listener.stop()
    (line,) = router_logging.getvalue().splitlines()
    assert json.loads(line)["path"] == ACCESS["path"]


def test_lines_that_come_while_the_writer_waits_go_out_in_one_write(
        router_logging: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer wakes at the first line, lets `FLUSH_EVERY_S` pass, then writes what came in one
    write: a burst of access lines costs the stream one write, not one each (the event loop gives
    up the GIL each time the writer wakes). The first line wakes it; the rest come 10 ms later,
    well within the wait."""
    from router import logs

    writes: list[str] = []

    class Counting(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return super().write(text)

    stream = Counting()
    monkeypatch.setattr(sys, "stderr", stream)
    configure_logging("info", "json")
    log = logging.getLogger("router.access")
    for i in range(50):
        info_line(log, "request", {**ACCESS, "batch_size": i})
        if i == 0:
            time.sleep(0.01)  # the writer has woken, and waits FLUSH_EVERY_S
    assert logs._listener is not None
    logs._listener.stop()
    assert len(writes) == 1
    assert [json.loads(line)["batch_size"] for line in stream.getvalue().splitlines()] == list(range(50))
