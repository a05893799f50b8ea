"""The predict route's request headers, read the same way by the app and by the connection's
early refusal (`router.http.early`): one parser, so both give the same answer and the same words."""

from __future__ import annotations

import math
import re

from router.errors import InputError, brief
from router.logs import REQUEST_ID_PATTERN, incoming_or_new

__all__ = ["REQUEST_ID_PATTERN", "announced_length", "incoming_or_new", "number_header", "priority_header"]

#: A decimal number as people write it: no '1_0', no 'inf', no hex.
DECIMAL = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
INTEGER = re.compile(r"^[+-]?\d{1,6}$")


def number_header(name: str, raw: str | None) -> float | None:
    """A finite number (X-Timeout-Ms), or None when the header is absent; InputError otherwise."""
    if raw is None:
        return None
    value = float(raw.strip()) if DECIMAL.match(raw.strip()) else math.nan
    if not math.isfinite(value):
        raise InputError(f"{name} must be a number, like 500 or 2.5, got {brief(raw, 40)}")
    return value


def priority_header(raw: str | None) -> int | None:
    """X-Priority as an integer, or None when absent; InputError otherwise."""
    if raw is None:
        return None
    if not INTEGER.match(raw.strip()):
        raise InputError(f"X-Priority must be an integer, got {brief(raw, 40)}")
    return int(raw.strip())


def announced_length(raw: str | None) -> int | None:
    """The body's Content-Length, or None when it is not announced (chunked) or unreadable."""
    return int(raw) if raw is not None and raw.isdigit() else None
