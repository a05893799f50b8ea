"""The engine's heartbeat on the board, as a front reads it (`Heartbeat`) and the settings that bound it."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from router.config import ServerSettings
from router.errors import EngineUnavailable
from router.host.board import BoardReader, BoardWriter, silent_s
from router.host.heartbeat import Heartbeat


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_an_engine_silent_past_the_bound_is_hung_until_it_publishes_again() -> None:
    writer = BoardWriter()
    reader = BoardReader(os.dup(writer.fd))
    clock = Clock(100.0)
    heartbeat = Heartbeat(1, 3.0, clock)
    assert silent_s(reader.header(), clock()) is None  # no engine has published yet: loading, not silent
    assert heartbeat.silence(reader) is None and heartbeat.look(reader) is None
    writer.header(1, True, False, 100.0)
    clock.now = 103.0  # at the bound: still trusted
    assert heartbeat.look(reader) is None and not heartbeat.hung
    clock.now = 103.5
    fresh = heartbeat.look(reader)
    assert isinstance(fresh, EngineUnavailable) and fresh.status_code == 503 and fresh.headers["Retry-After"] == "2"
    assert "3.5 s" in fresh.detail and heartbeat.hung
    assert heartbeat.look(reader) is None  # the open requests were answered once, at the change
    assert isinstance(heartbeat.silence(reader), EngineUnavailable)  # new requests keep meeting it
    writer.header(1, True, False, 103.6)
    assert heartbeat.look(reader) is None and not heartbeat.hung and heartbeat.silence(reader) is None


def test_the_hang_bound_must_be_longer_than_the_stale_bound_or_off() -> None:
    assert (ServerSettings().engine_stale_s, ServerSettings().engine_hang_s) == (3.0, 30.0)
    assert ServerSettings(engine_stale_s=1, engine_hang_s=0).engine_hang_s == 0  # never restarted for silence
    with pytest.raises(ValidationError, match="engine_hang_s 2.0 must be longer than engine_stale_s 3.0"):
        ServerSettings(engine_hang_s=2)
    with pytest.raises(ValidationError, match="engine_stale_s"):
        ServerSettings(engine_stale_s=0)
