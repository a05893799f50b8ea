"""One structured access line per request, whoever answered it: the app, or the connection itself
when it refused a request from its headers (`router.http.early`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from router.logs import info_line

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
    info_line(log, "request", line, request_id)
