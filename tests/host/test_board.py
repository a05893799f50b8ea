"""The board: the engine's figures, read back by a front exactly as written."""

from __future__ import annotations

import os

from router.errors import RouterError
from router.host.board import BoardReader, BoardWriter
from router.scheduling.service_time import Forecast
from router.serving.rules import ModelFigures, Refusal, Terms, admit


def figures(**changes: object) -> ModelFigures:
    forecast = Forecast(5.0, (5.1, 5.3), (8, 8), (0.2, 0.2), (0.1, 0.1), (0.01, 0.01), 0.001, 0.005)
    base = ModelFigures("m", 3, 1, 10_000, 64, 5, 1.5, None, forecast, False, 12.5, 0.5, None, 5.0)
    from msgspec.structs import replace

    return replace(base, **changes)


def test_a_front_reads_what_the_engine_published_and_decides_the_same() -> None:
    writer = BoardWriter()
    reader = BoardReader(os.dup(writer.fd))
    assert reader.figures(3, "m") is None and reader.header().epoch == 0
    published = figures()
    writer.publish(3, 2, published)
    writer.header(7, True, False, 5.0)
    generation, read = reader.figures(3, "m")  # type: ignore[misc]
    assert generation == 2 and read == published
    assert reader.header().epoch == 7 and reader.header().ready
    for timeout_ms in (150, 1000):  # refused (the forecast says 290 ms), then admitted
        terms = Terms("m", 5.0, timeout_ms=timeout_ms)
        assert decide(terms, read) == decide(terms, published)
    assert isinstance(decide(Terms("m", 5.0, timeout_ms=150), read), str)


def decide(terms: Terms, figures: ModelFigures) -> object:
    try:
        return admit(terms, figures, 5.01)
    except RouterError as exc:
        return exc.detail


def test_a_refusal_keeps_its_words_and_an_empty_slot_reads_empty() -> None:
    writer = BoardWriter()
    reader = BoardReader(os.dup(writer.fd))
    writer.publish(1, 1, figures(refusal=Refusal("ModelUnavailable", "model 'm' is loading", 5.0)))
    read = reader.figures(1, "m")
    assert read is not None and read[1].refusal == Refusal("ModelUnavailable", "model 'm' is loading", 5.0)
    writer.publish(1, 1, figures(refusal=Refusal("ModelUnavailable", "x" * 10_000)))
    long = reader.figures(1, "m")
    assert long is not None and long[1].refusal is not None and long[1].refusal.detail.endswith("...")
    writer.clear(1)
    assert reader.figures(1, "m") is None


def test_a_record_caught_being_written_reads_as_the_last_one() -> None:
    writer = BoardWriter()
    reader = BoardReader(os.dup(writer.fd))
    writer.publish(1, 1, figures())
    assert reader.figures(1, "m") is not None
    writer._map[2048:2048 + 8] = (writer._map[2048] | 1).to_bytes(8, "little")  # the writer stopped mid-record
    writer._map[2048 + 12] ^= 0xFF
    read = reader.figures(1, "m")
    assert read is not None and read[1] == figures()
