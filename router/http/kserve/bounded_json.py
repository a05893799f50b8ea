"""JSON from clients, with its nesting bounded before it is parsed.

`json.loads` recurses once per level, so `[` x 100,000 raises RecursionError (a 500 and a traceback
before this module), and whatever walks the parsed value recurses too. The depth is measured on
the text first, in linear time and bounded memory: escape pairs are cut out, then numpy counts
quotes (inside a string or not) and the running depth of brackets outside strings, a megabyte at
a time.
"""

from __future__ import annotations

import json
from typing import Any, Final

import numpy as np

from router.errors import InputError

__all__ = ["MAX_JSON_DEPTH", "loads_bounded", "nesting_exceeds"]

#: Arrays and objects inside one another. A V2 request needs 3 + the tensor's rank (at most 64).
MAX_JSON_DEPTH: Final = 100
_CHUNK: Final = 1 << 20
_STEP: Final = np.zeros(256, np.int8)  # +1 opens a level, -1 closes one
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1
_IS_QUOTE: Final = np.zeros(256, np.uint8)
_IS_QUOTE[ord('"')] = 1


def nesting_exceeds(text: bytes, limit: int) -> bool:
    """Whether JSON text nests arrays and objects more than `limit` levels deep. Exact for valid
    JSON; for other text json.loads reports the error."""
    if text.count(b"[") + text.count(b"{") <= limit:
        return False
    unescaped = text.replace(b"\\\\", b"").replace(b'\\"', b"")  # left to right, as JSON pairs escapes
    codes = np.frombuffer(unescaped, dtype=np.uint8)
    in_string = depth = 0
    for start in range(0, len(codes), _CHUNK):
        chunk = codes[start:start + _CHUNK]
        inside = np.bitwise_xor.accumulate(_IS_QUOTE[chunk]) ^ in_string  # 1 after an opening quote
        steps = _STEP[chunk]
        steps[inside.view(bool)] = 0  # brackets in strings do not nest
        running = np.cumsum(steps, dtype=np.int32)
        if depth + int(running.max()) > limit:
            return True
        depth += int(running[-1])
        in_string = int(inside[-1])
    return False


def loads_bounded(text: bytes, where: str, *, expected: str = "JSON", limit: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON text, refusing (InputError, 400) text that is not JSON or nests more than `limit`
    levels: '{where} must be {expected}: {why}'."""
    too_deep = InputError(f"{where} nests arrays and objects more than {limit} levels deep")
    if nesting_exceeds(text, limit):
        raise too_deep
    try:
        return json.loads(text)
    except RecursionError:
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{where} must be {expected}: {exc}") from None
