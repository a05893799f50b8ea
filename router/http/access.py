"""One structured access line per request, whoever answered it: the app, or the connection itself
when it refused a request from its headers (`router.http.early`)."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["access_line"]

log = logging.getLogger("router.access")
MODEL_PATH = re.compile(r"^/models/([^/]+)")
#: Polled paths: not worth a line each.
QUIET_PATHS = frozenset({"/metrics", "/health/live", "/health/ready", "/ui/state"})


def access_line(method: str | None, path: str, status: int, seconds: float,
                fields: Mapping[str, Any] | None = None, request_id: str | None = None) -> None:
    """Log `request` with the method, path, status (499 when none was sent), duration, the model
    named in the path, and `fields` (what the handler recorded)."""
    if path in QUIET_PATHS:
        return
    line: dict[str, Any] = {"method": method, "path": path[:256], "status": status or 499,
                            "duration_ms": round(seconds * 1000, 3)}
    match = MODEL_PATH.match(path)
    if match:
        line["model"] = match.group(1)[:64]
    line.update(fields or {})
    if request_id is not None:
        line["request_id"] = request_id
    if log.isEnabledFor(logging.INFO):  # the record made directly: no search of the stack for the caller
        log.handle(_record(line))


#: A finished access record's attributes by (thread, process), with the names `extra` may not use.
_templates: dict[tuple[int, int], tuple[dict[str, Any], frozenset[str]]] = {}


def _record(line: dict[str, Any]) -> logging.LogRecord:
    """The access record `makeRecord` would make, from a template: `LogRecord.__init__` looks up the
    thread, the process and the file's name again for every request, and they do not change.
    (Python 3.11's record; from 3.12 a record also names its asyncio task, so each is made whole.)"""
    key = (threading.get_ident(), os.getpid())
    found = _templates.get(key)
    plain = logging.getLogRecordFactory() is logging.LogRecord and sys.version_info < (3, 12)
    if found is None or not plain or not found[1].isdisjoint(line):
        record = log.makeRecord(log.name, logging.INFO, __file__, 0, "request", (), None, extra=line)
        if found is None and plain:
            template = {k: v for k, v in record.__dict__.items() if k not in line}
            _templates[key] = (template, frozenset(template) | {"message", "asctime"})
        return record
    template = found[0]
    record = logging.LogRecord.__new__(logging.LogRecord)
    fields = record.__dict__
    fields.update(template)
    created = time.time()
    fields["created"] = created
    fields["msecs"] = int((created - int(created)) * 1000) + 0.0
    fields["relativeCreated"] = template["relativeCreated"] + (created - template["created"]) * 1000
    fields.update(line)
    return record
