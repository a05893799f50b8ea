"""JSON from clients, with its nesting, its parsed size and its text bounded before it is parsed:
the one JSON loader of the router's own parsers and of plugins (`loads_bounded`, in the SDK).

- *Nesting*: `json.loads` recurses once per level, so `[` x 100,000 raises RecursionError (a 500
  and a traceback before this module), and whatever walks the parsed value recurses too.
- *Parsed size*: text that parses into millions of small objects costs far more than its bytes:
  a 20 MB `[{},{},...]` took about 27 times that as Python objects, eight at once 5.7 GB. What the
  parsed value will take is estimated from the text (arrays and objects, strings, other values)
  and refused (413) above `COST_RATIO` times the text's size (and `COST_FLOOR`), before parsing.
- *Unicode*: a lone surrogate (`"\\ud800"`, or its raw UTF-8 bytes) parses into a str that nothing
  can encode again (RFC 8259 §8.2); it is refused (400) rather than failing later as a 500.

Nesting and counts are measured on the text in one pass, in linear time and bounded memory:
escape pairs are cut out, then numpy counts quotes (inside a string or not), brackets, braces and
commas outside strings, and the running depth, a megabyte at a time.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from router.errors import InputError, PayloadTooLarge

__all__ = [
    "COST_FLOOR",
    "COST_RATIO",
    "MAX_JSON_DEPTH",
    "JsonCounts",
    "allowed_bytes",
    "count_json",
    "loads_bounded",
    "lone_surrogate",
    "measure_json",
    "nesting_exceeds",
]

#: Arrays and objects inside one another. A V2 request needs 3 + the tensor's rank (at most 64).
MAX_JSON_DEPTH: Final = 100
#: The parsed value may take this many times the text's bytes (a flat list of numbers takes 4-5,
#: a nested image tensor about 12, `[{},{},...]` about 30), or COST_FLOOR, whichever is more.
COST_RATIO: Final = 16
COST_FLOOR: Final = 64 * 1024 * 1024
#: Estimated bytes of one parsed value, CPython on 64 bits, with its slot in its parent.
CONTAINER_BYTES, STRING_BYTES, VALUE_BYTES = 64, 56, 32
_CHUNK: Final = 1 << 20
_STEP: Final = np.zeros(256, np.int8)  # +1 opens a level, -1 closes one
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1
_IS_QUOTE: Final = np.zeros(256, np.uint8)
_IS_QUOTE[ord('"')] = 1
_IS_COMMA: Final = np.zeros(256, np.uint8)
_IS_COMMA[ord(",")] = 1
#: A \\u escape of a surrogate, after an even run of backslashes (an odd one escapes the first).
_SURROGATE_ESCAPE: Final = re.compile(rb"(?<!\\)(?:\\\\)*\\u([dD][89a-fA-F][0-9a-fA-F]{2})")
_LOW_ESCAPE: Final = re.compile(rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_RAW_SURROGATE: Final = re.compile(rb"\xed[\xa0-\xbf]")  # UTF-8 bytes of U+D800..U+DFFF: never valid UTF-8


@dataclass(frozen=True)
class JsonCounts:
    """What JSON text holds outside its strings (exact for valid JSON)."""

    depth: int  # deepest nesting of arrays and objects
    containers: int  # arrays and objects
    strings: int
    commas: int

    def parsed_bytes(self) -> int:
        """About what the parsed value takes as Python objects."""
        values = self.commas + self.containers
        return CONTAINER_BYTES * self.containers + STRING_BYTES * self.strings + VALUE_BYTES * values


def count_json(text: bytes) -> JsonCounts:
    """Nesting, arrays and objects, strings and commas of JSON text, in one linear pass."""
    unescaped = text.replace(b"\\\\", b"").replace(b'\\"', b"")  # left to right, as JSON pairs escapes
    codes = np.frombuffer(unescaped, dtype=np.uint8)
    in_string = depth = deepest = containers = quotes = commas = 0
    for start in range(0, len(codes), _CHUNK):
        chunk = codes[start:start + _CHUNK]
        is_quote = _IS_QUOTE[chunk]
        inside = np.bitwise_xor.accumulate(is_quote) ^ in_string  # 1 after an opening quote
        outside = ~inside.view(bool)
        steps = _STEP[chunk]
        steps[~outside] = 0  # brackets in strings do not nest
        running = np.cumsum(steps, dtype=np.int32)
        deepest = max(deepest, depth + int(running.max()))
        depth += int(running[-1])
        containers += int(np.count_nonzero(steps > 0))
        commas += int(np.count_nonzero(_IS_COMMA[chunk] & outside))
        quotes += int(np.count_nonzero(is_quote))
        in_string = int(inside[-1])
    return JsonCounts(deepest, containers, quotes // 2, commas)


def nesting_exceeds(text: bytes, limit: int) -> bool:
    """Whether JSON text nests arrays and objects more than `limit` levels deep. Exact for valid
    JSON; for other text json.loads reports the error."""
    if text.count(b"[") + text.count(b"{") <= limit:
        return False
    return count_json(text).depth > limit


def measure_json(text: bytes, limit: int) -> tuple[bool, int]:
    """(nests more than `limit` levels, about what it takes once parsed), with at most one pass:
    none when plain byte counts already show both small."""
    containers = text.count(b"[") + text.count(b"{")
    rough = JsonCounts(0, containers, text.count(b'"') // 2 + 1, text.count(b",")).parsed_bytes()
    if containers <= limit and rough <= allowed_bytes(len(text)):
        return False, rough
    counts = count_json(text)
    return counts.depth > limit, counts.parsed_bytes()


def allowed_bytes(size: int) -> int:
    """What the parsed value of `size` bytes of JSON text may take."""
    return max(COST_RATIO * size, COST_FLOOR)


def lone_surrogate(text: bytes) -> str | None:
    """The first lone surrogate in JSON text, as `\\udXXX` (escaped, or raw UTF-8 bytes), or None."""
    if (raw := _RAW_SURROGATE.search(text) if b"\xed" in text else None) is not None:
        try:
            return f"\\u{ord(text[raw.start():raw.start() + 3].decode('utf-8', 'surrogatepass')):04x}"
        except UnicodeDecodeError:  # cut short: invalid UTF-8 either way
            return "a surrogate's UTF-8 bytes"
    if b"\\u" not in text:
        return None
    paired = -1  # where a high surrogate's low half begins
    for match in _SURROGATE_ESCAPE.finditer(text):
        code = int(match.group(1), 16)
        begins = match.end() - 6
        if code >= 0xDC00:  # a low half: fine right after a high one
            if begins == paired:
                continue
            return f"\\u{code:04x}"
        if _LOW_ESCAPE.match(text, match.end()):
            paired = match.end()
            continue
        return f"\\u{code:04x}"
    return None


def _too_deep(where: str, max_depth: int) -> InputError:
    return InputError(f"{where} nests arrays and objects more than {max_depth} levels deep")


def loads_bounded(text: bytes | str, where: str = "the input", *, expected: str = "JSON",
                  max_depth: int = MAX_JSON_DEPTH, max_bytes: int | None = None) -> Any:
    """Parse JSON text, refusing text that is over `max_bytes` (413), is not JSON, nests more than
    `max_depth` levels (400), would take more than COST_RATIO times its size once parsed (413), or
    holds a lone surrogate (400): '{where} must be {expected}: {why}'."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if max_bytes is not None and len(data) > max_bytes:
        raise PayloadTooLarge(f"{where} is {len(data)} bytes of JSON; at most {max_bytes} are accepted")
    deep, cost = measure_json(data, max_depth)
    if deep:
        raise _too_deep(where, max_depth)
    if cost > allowed_bytes(len(data)):
        raise PayloadTooLarge(f"{where} would take about {cost // 2**20} MB once parsed ({len(data)} bytes of "
                              f"text); send tensor data as flat lists, or in binary (binary_data_size)")
    if (surrogate := lone_surrogate(data)) is not None:
        raise InputError(f"{where} holds a lone surrogate ({surrogate}), which is not Unicode text")
    try:
        return json.loads(data)
    except RecursionError:
        raise _too_deep(where, max_depth) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{where} must be {expected}: {exc}") from None
