"""Structured JSON logs. Each record carries the request id of the request being served, if any."""

from __future__ import annotations

import atexit
import contextvars
import json
import logging
import queue
import sys
import time
from logging.handlers import QueueHandler, QueueListener
from typing import Any

__all__ = ["JsonFormatter", "configure_logging", "request_id_var"]

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id and any `extra` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id:
            entry["request_id"] = request_id
        for key, value in record.__dict__.items():
            if key not in _RESERVED and key not in entry and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class _DeferredHandler(QueueHandler):
    """Hands records to a background thread, which formats and writes them: the event loop only
    enqueues. The request id is captured here, since the context does not follow the record."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        if getattr(record, "request_id", None) is None and (request_id := request_id_var.get()):
            record.request_id = request_id
        return record


_listener: QueueListener | None = None


def configure_logging(level: str = "info") -> None:
    """JSON lines on stderr, written by a background thread; flushed when the process exits."""
    global _listener
    if _listener is not None:
        _listener.stop()
    writer = logging.StreamHandler(sys.stderr)
    writer.setFormatter(JsonFormatter())
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    _listener = QueueListener(records, writer, respect_handler_level=False)
    _listener.start()
    atexit.register(_listener.stop)
    root = logging.getLogger()
    root.handlers[:] = [_DeferredHandler(records)]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True  # the router writes its own access line
