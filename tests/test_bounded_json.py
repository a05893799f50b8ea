"""JSON measured before parsing (router/sdk/bounded_json.py): nesting exact on valid JSON,
blind to brackets inside strings, linear on hostile text; the parsed size estimated; lone
surrogates found."""

from __future__ import annotations

import json
import time

import pytest

from router.errors import InputError, PayloadTooLarge
from router.sdk.bounded_json import (
    JsonCounts,
    allowed_bytes,
    count_json,
    loads_bounded,
    lone_surrogate,
    measure_json,
    nesting_exceeds,
)
from tests.conftest import HANG_S


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(("text", "too_deep"), [
    (nested(100), False),
    (nested(101), True),
    (b'{"a": ' * 101 + b"1" + b"}" * 101, True),
    (b'{"a": ' * 50 + b"[" * 50 + b"1" + b"]" * 50 + b"}" * 50, False),
    (json.dumps(["[" * 500, "{" * 500]).encode(), False),  # brackets in strings do not nest
    (json.dumps(["\\" + "[" * 500, '"' + "[" * 500]).encode(), False),  # nor after escaped quotes and backslashes
    (json.dumps([[[1]]] * 10_000).encode(), False),  # many brackets, little depth
    (b"[" * 100_000, True),
])
def test_nesting_is_measured_exactly(text: bytes, too_deep: bool) -> None:
    assert nesting_exceeds(text, 100) is too_deep
    if not too_deep and text.count(b"[") == text.count(b"]"):
        json.loads(text)  # the cases are valid JSON


@pytest.mark.parametrize("text", [
    (b"[" * 99 + b"]" * 99) * 20_000,  # 4 MB of nesting just under the limit
    b'"' * 4_000_000,
    b"[" + b"\\\\" * 2_000_000,
])
def test_hostile_text_is_measured_in_linear_time(text: bytes) -> None:
    """4 MB each: linear is milliseconds, quadratic would be hours; the bound only tells them apart."""
    started = time.perf_counter()
    nesting_exceeds(text, 100)
    assert time.perf_counter() - started < HANG_S


@pytest.mark.parametrize("text", [b"[" * 100_000, nested(101), b"{" * 5_000])
def test_too_deep_or_unparseable_text_is_a_400(text: bytes) -> None:
    with pytest.raises(InputError) as error:
        loads_bounded(text, "the body")
    assert error.value.status_code == 400


def test_bad_json_names_what_was_expected() -> None:
    with pytest.raises(InputError, match="the body must be the JSON inference request: Expecting"):
        loads_bounded(b"{not json", "the body", expected="the JSON inference request")
    assert loads_bounded(b'{"a": [1, 2]}', "the body") == {"a": [1, 2]}


def test_a_plugins_limits_on_depth_and_size_are_its_own() -> None:
    """What the SDK offers plugins: a depth of their choosing, a size bound (413), text or bytes."""
    with pytest.raises(InputError, match="the input nests arrays and objects more than 2 levels deep"):
        loads_bounded('{"a": [[1]]}', max_depth=2)
    assert loads_bounded('{"a": [1]}', max_depth=2) == {"a": [1]}
    with pytest.raises(PayloadTooLarge, match="the item is 12 bytes of JSON; at most 11 are accepted") as error:
        loads_bounded('{"a": "bcd"}', "the item", max_bytes=11)
    assert error.value.status_code == 413
    assert loads_bounded('{"a": "bcd"}', "the item", max_bytes=12) == {"a": "bcd"}
    assert loads_bounded('["\u00e9"]', max_bytes=6) == ["\u00e9"]  # a str counts as its UTF-8 bytes
    with pytest.raises(InputError, match=r"lone surrogate \(\\ud800\)"):
        loads_bounded('["\ud800"]')  # a str holding one, not only its escape


@pytest.mark.parametrize(("text", "found"), [
    (b'"\\ud800"', "\\ud800"),
    (b'"\\udc00"', "\\udc00"),  # a low half alone
    (b'"\\ud83d\\ude00"', None),  # a pair
    (b'"\\\\ud800"', None),  # an escaped backslash, then text
    (b'"\\\\\\ud800"', "\\ud800"),  # an escaped backslash, then the escape
    (b'"\xed\xa0\x80"', "\\ud800"),  # the surrogate's own UTF-8 bytes
    ("\u00e9t\u00e9 \u2603".encode(), None),
])
def test_lone_surrogates_are_found_in_the_text(text: bytes, found: str | None) -> None:
    assert lone_surrogate(text) == found
    if found is not None:
        with pytest.raises(InputError, match="lone surrogate"):
            loads_bounded(text, "the body")


@pytest.mark.parametrize(("text", "refused"), [
    (b"[" + b"{}," * 8_000_000 + b"{}]", True),  # 24 MB of empty objects: about 40 times its size
    (b"[" + b"[]," * 8_000_000 + b"[]]", True),
    (json.dumps([0.5] * 3_000_000).encode(), False),  # flat numbers: about 3 times
    (json.dumps([[[[255, 255, 255]] * 320] * 320]).encode(), False),  # a nested image: about 11 times
    (json.dumps(["[{}]" * 1000] * 1000).encode(), False),  # brackets in strings cost nothing
])
def test_what_the_parsed_value_would_take_is_bounded_before_parsing(text: bytes, refused: bool) -> None:
    deep, cost = measure_json(text, 100)
    assert not deep
    assert (cost > allowed_bytes(len(text))) is refused
    if refused:
        with pytest.raises(PayloadTooLarge, match="once parsed"):
            loads_bounded(text, "the body")


def test_counts_are_taken_outside_strings() -> None:
    assert count_json(b'["a,[b", {"x": [1, 2]}, "\\"]"]') == JsonCounts(depth=3, containers=3, strings=3, commas=3)
