"""Structured logs: JSON lines, or readable text lines on a terminal, with the same fields either way.
Each record carries the request id of the request being served, if any, and its trace id when
tracing is on, so that a line leads to the request's trace. A line is bounded whatever a record
holds: its message and each text field at `MAX_FIELD_CHARS`, a traceback at `MAX_TRACEBACK_CHARS`
(a client's header quoted by a library's warning is cut, not copied whole)."""

from __future__ import annotations

import atexit
import contextvars
import functools
import itertools
import json
import logging
import os
import queue
import re
import secrets
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from logging.handlers import QueueHandler
from typing import Any, Literal, TextIO

import msgspec

__all__ = ["MAX_FIELD_CHARS", "MAX_TRACEBACK_CHARS", "REQUEST_ID_PATTERN", "JsonFormatter", "LogFormat", "TextFormatter", "configure_logging", "formatter_for",
           "incoming_or_new", "info_line", "new_request_id", "record_fields", "request_id_var", "trace_id_var"]

_JSON = msgspec.json.Encoder(enc_hook=str)

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
trace_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("trace_id", default=None)
#: The most characters a line keeps of a message or a text field, and of a traceback.
MAX_FIELD_CHARS = 2_000
MAX_TRACEBACK_CHARS = 16_000
#: A request id a client may choose (X-Request-ID, gRPC's x-request-id metadata).
REQUEST_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def incoming_or_new(incoming: str | None, new: str | None = None) -> str:
    """The caller's request id when it is sane, else `new` (a fresh one by default)."""
    if incoming and REQUEST_ID_PATTERN.match(incoming):
        return incoming
    return new or new_request_id()


class _RequestIds:
    """32 hex digits per request, as a uuid4's hex: a random prefix drawn once per process (again
    in a forked child) and a counter. A uuid4 reads the system's random source each time, a system
    call per request; an id only has to be unique, not unguessable (nothing is granted by one)."""

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self.prefix = secrets.token_hex(8)
        self.counter = itertools.count()

    def __call__(self) -> str:
        return f"{self.prefix}{next(self.counter):016x}"


new_request_id = _RequestIds()

# Record attributes that are not fields; uvicorn's `color_message` repeats the message with ANSI codes.
_RESERVED = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "color_message"}


LogFormat = Literal["auto", "json", "text"]
# Shown first on a text line, in this order, when present: who, what, how long.
_LEADING = ("model", "request_id", "trace_id", "method", "path", "status", "duration_ms", "queue_wait_ms", "execution_ms",
            "batch_size")


@functools.lru_cache(maxsize=4)
def _second(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


def _cut(text: str, limit: int) -> str:
    """`text`, or its start and end around a note of how much was cut from its middle."""
    if len(text) <= limit:
        return text
    keep = limit // 2
    return f"{text[:keep]} [... {len(text) - 2 * keep} characters cut ...] {text[-keep:]}"


def record_fields(record: logging.LogRecord, formatter: logging.Formatter) -> dict[str, Any]:
    """Time, level, logger, message, request_id and any `extra` fields of one record, text cut
    to `MAX_FIELD_CHARS` (a traceback to `MAX_TRACEBACK_CHARS`)."""
    entry = _head(record.created, record.levelname.lower(), record.name, record.getMessage(),
                  getattr(record, "request_id", None) or request_id_var.get(),
                  getattr(record, "trace_id", None) or trace_id_var.get())
    _add_fields(entry, {key: value for key, value in record.__dict__.items()
                        if key not in _RESERVED and not key.startswith("_")})
    if record.exc_info:
        entry["exception"] = _cut(formatter.formatException(record.exc_info), MAX_TRACEBACK_CHARS)
    return entry


def _head(created: float, level: str, logger: str, message: str, request_id: str | None,
          trace_id: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"ts": f"{_second(int(created))}.{int(created % 1 * 1000):03d}Z", "level": level,
                             "logger": logger, "message": _cut(message, MAX_FIELD_CHARS)}
    if request_id:
        entry["request_id"] = request_id
    if trace_id:
        entry["trace_id"] = trace_id
    return entry


def _add_fields(entry: dict[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """`fields` after the head, none replacing it, text cut to `MAX_FIELD_CHARS`."""
    for key, value in fields.items():
        if key not in entry:
            entry[key] = _cut(value, MAX_FIELD_CHARS) if isinstance(value, str) else value
    return entry


@dataclass(slots=True)  # not frozen: a frozen dataclass is slower to make
class _Line:
    """An INFO line handed to the writer whole (`info_line`): what a record would carry, without
    the record."""

    created: float
    logger: str
    message: str
    fields: Mapping[str, Any]
    request_id: str | None
    trace_id: str | None
    role: str | None

    def entry(self) -> dict[str, Any]:
        entry = _add_fields(_head(self.created, "info", self.logger, self.message, self.request_id, self.trace_id),
                            self.fields)
        if self.role is not None:
            entry.setdefault("role", self.role)
        return entry


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see `record_fields`); what JSON cannot hold is shown as text."""

    def format(self, record: logging.LogRecord) -> str:
        return self.format_entry(record_fields(record, self))

    def format_entry(self, fields: dict[str, Any]) -> str:
        try:
            return _JSON.encode(fields).decode()
        except (TypeError, ValueError, OverflowError):  # keys msgspec will not write (a tuple, a huge int)
            return json.dumps(fields, default=str)


class TextFormatter(logging.Formatter):
    """One readable line: time, level, logger and message, then `key=value` for every other field,
    the request's model, id, status and timings first. A traceback follows on its own lines."""

    def format(self, record: logging.LogRecord) -> str:
        return self.format_entry(record_fields(record, self))

    def format_entry(self, entry: dict[str, Any]) -> str:
        exception = entry.pop("exception", None)
        head = f"{entry.pop('ts')} {entry.pop('level').upper():<7} {entry.pop('logger')}: {entry.pop('message')}"
        keys = [k for k in _LEADING if k in entry] + [k for k in entry if k not in _LEADING]
        line = " ".join([head, *(f"{key}={_text_value(entry[key])}" for key in keys)])
        return f"{line}\n{exception}" if exception else line


def _text_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return json.dumps(text) if text == "" or any(c in text for c in ' "=\n') else text


def formatter_for(fmt: LogFormat, stream: TextIO) -> JsonFormatter | TextFormatter:
    """`auto`: readable text on a terminal, JSON lines otherwise (a file, a pipe, a log collector)."""
    if fmt == "auto":
        isatty = getattr(stream, "isatty", None)
        fmt = "text" if isatty is not None and isatty() else "json"
    return TextFormatter() if fmt == "text" else JsonFormatter()


class _DeferredHandler(QueueHandler):
    """Hands records to a background thread, which formats and writes them: the event loop only
    enqueues. The request and trace ids are captured here, since the context does not follow the record."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        if getattr(record, "request_id", None) is None and (request_id := request_id_var.get()):
            record.request_id = request_id
        if getattr(record, "trace_id", None) is None and (trace_id := trace_id_var.get()):
            record.trace_id = trace_id
        return record


class _Writer(threading.Thread):
    """The background writer: it wakes when a record comes, waits `FLUSH_EVERY_S` for more, then
    formats everything queued and writes it in one write. One wake-up per record (what the
    standard library's QueueListener does, with a write and a flush each) cost a busy front a
    context switch per request; batched, records cost their formatting and a share of one write."""

    def __init__(self, records: queue.SimpleQueue[logging.LogRecord | _Line | None], stream: TextIO,
                 formatter: JsonFormatter | TextFormatter) -> None:
        super().__init__(name="router-log-writer", daemon=True)
        self.records, self.stream, self.formatter = records, stream, formatter
        self._stopped = False

    def run(self) -> None:
        while True:
            first = self.records.get()
            if first is not None and not self._stopped:
                time.sleep(FLUSH_EVERY_S)  # let the burst gather
            batch = [first]
            while True:
                try:
                    batch.append(self.records.get_nowait())
                except queue.Empty:
                    break
            done = None in batch
            self._write([r for r in batch if r is not None])
            if done:
                return

    def _write(self, records: list[logging.LogRecord | _Line]) -> None:
        lines = []
        for record in records:
            try:
                if isinstance(record, _Line):
                    lines.append(self.formatter.format_entry(record.entry()))
                else:
                    lines.append(self.formatter.format(record))
            except Exception:  # noqa: BLE001  # a record that does not format: say so, keep the others
                what = record.message if isinstance(record, _Line) else record.msg
                lines.append(f"model-router: a log record did not format: {what!r}")
        if not lines:
            return
        try:
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # stderr closed (the parent went away): nothing to write to
            pass

    def stop(self) -> None:
        """Write what is queued, then end (at exit, or when logging is configured again)."""
        if self.is_alive():
            self._stopped = True
            self.records.put(None)
            self.join(5)


#: How long the writer lets records gather after the first one wakes it.
FLUSH_EVERY_S = 0.01
_listener: _Writer | None = None
_handler: _DeferredHandler | None = None
_role: str | None = None


class _Role(logging.Filter):
    """Adds the process's role (`front 2`, `engine`) to every record of a split host's process."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = self.role
        return True


def configure_logging(level: str = "info", fmt: LogFormat = "auto", role: str | None = None) -> None:
    """Lines on stderr in `fmt` (see `formatter_for`), written by a background thread; flushed when the
    process exits. With `role`, every line says which process of a split host wrote it."""
    global _listener, _handler, _role
    if _listener is not None:
        _listener.stop()
    records: queue.SimpleQueue[logging.LogRecord | _Line | None] = queue.SimpleQueue()
    _listener = _Writer(records, sys.stderr, formatter_for(fmt, sys.stderr))
    _listener.start()
    atexit.register(_listener.stop)
    root = logging.getLogger()
    handler = _DeferredHandler(records)
    if role is not None:
        handler.addFilter(_Role(role))
    root.handlers[:] = [handler]
    _handler, _role = handler, role
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True  # the router writes its own access line


def info_line(logger: logging.Logger, message: str, fields: Mapping[str, Any], request_id: str | None = None) -> None:
    """Log `message` at INFO with `fields`, as `logger.info(message, extra=fields)` would, with the
    request and trace ids of the context (or `request_id`). Where the router's own handler is the
    only one the line reaches (`configure_logging`) and `logger` has no filter, the line goes to the
    writer whole, without a `LogRecord` (making and filtering one cost a busy front a tenth of a
    request's CPU time); anywhere else, as a record, for whatever handlers and filters there are."""
    if not logger.isEnabledFor(logging.INFO):
        return
    handler = _handler
    if (handler is not None and not logger.filters and _only_handler(logger, handler)
            and all(isinstance(f, _Role) for f in handler.filters)):
        handler.queue.put_nowait(_Line(time.time(), logger.name, message, fields, request_id or request_id_var.get(),
                                       trace_id_var.get(), _role))
        return
    extra = dict(fields) if request_id is None else {**fields, "request_id": request_id}
    logger.handle(logger.makeRecord(logger.name, logging.INFO, "(unknown file)", 0, message, (), None, extra=extra))


def _only_handler(logger: logging.Logger, handler: logging.Handler) -> bool:
    """Whether `handler` is the one handler that a line of `logger` reaches."""
    current: logging.Logger | None = logger
    while current is not None:
        if current.disabled or (current.handlers and current.handlers != [handler]):
            return False
        if current.handlers or not current.propagate:
            return current.handlers == [handler]
        current = current.parent
    return False
