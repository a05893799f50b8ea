"""The frames between fronts and the engine: whole messages out of any split of the stream."""

from __future__ import annotations

import msgspec
import pytest

from router.errors import QueueFull
from router.host.messages import (
    HEADER,
    MAX_FRAME,
    Cancel,
    EngineMessage,
    Failure,
    Frames,
    FrontMessage,
    Packed,
    Reply,
    Submit,
    encode_frame,
)
from router.scheduling.queue import BatchFacts
from router.serving.rules import Terms
from router.tracing.api import SpanRef


def test_messages_come_out_whole_whatever_the_reads_cut() -> None:
    out = bytearray()
    sent = [Submit(1, Terms("m", 1.5, 2, 100.0), "rid", 3, 14, Packed(b"x" * 300)), Cancel(1, True)]
    for message in sent:
        encode_frame(message, out)
    frames = Frames(FrontMessage)
    received = []
    for cut in range(0, len(out), 7):
        received += frames.feed(out[cut:cut + 7])
    assert received == sent


def test_the_request_paths_values_cross_as_they_are() -> None:
    """A request's terms and its batch's facts are the request path's own values, not copies."""
    out = bytearray()
    facts = BatchFacts(4, 2.0, 0.5, 2.5, -8, SpanRef(2**100 + 7, 2**63 + 1).to_bytes(), queue_wait_s=0.25)
    sent = [Submit(2, Terms("m", 1.0, items=3, must_finish=True, wait_for_room=True), "rid", 1, 0)]
    for message in sent:
        encode_frame(message, out)
    assert Frames(FrontMessage).feed(out) == sent
    out.clear()
    encode_frame(Reply(3, facts=facts), out)
    [reply] = Frames(EngineMessage).feed(out)
    assert reply.facts == facts and reply.facts.link == SpanRef(2**100 + 7, 2**63 + 1)


def test_a_failure_rebuilds_its_error_with_status_and_retry_hint() -> None:
    out = bytearray()
    encode_frame(Reply(9, failure=Failure.of(QueueFull("full", retry_after_s=2.5))), out)
    [reply] = Frames(EngineMessage).feed(out)
    error = reply.failure.error()
    assert isinstance(error, QueueFull) and error.status_code == 503 and error.headers["Retry-After"] == "3"


def test_an_oversized_or_garbled_frame_is_refused() -> None:
    with pytest.raises(ValueError, match="over the limit"):
        Frames(FrontMessage).feed(HEADER.pack(MAX_FRAME + 1) + b"x")
    with pytest.raises(msgspec.DecodeError):
        Frames(FrontMessage).feed(HEADER.pack(3) + b"\xc1\xc1\xc1")
