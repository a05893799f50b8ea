"""JSON nesting measured before parsing (router/http/kserve/bounded_json.py): exact on valid JSON,
blind to brackets inside strings, linear on hostile text."""

from __future__ import annotations

import json
import time

import pytest

from router.errors import InputError
from router.http.kserve.bounded_json import loads_bounded, nesting_exceeds
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
