"""The board: figures the engine publishes for the fronts' refusals, in shared memory.

One memfd, written only by the engine and mapped read-only by every front: a header (the engine's
epoch, ready, draining) and one fixed slot per model holding its `ModelFigures` (the rules'
inputs, the refusal's words included). A front reads a slot and runs the same `admit` the engine
runs (`router.serving.rules`), with no round trip.

Each record is guarded by a sequence lock: the writer makes its counter odd, writes, makes it even
again; a reader retries until it reads the same even counter before and after the record (x86
keeps stores in order and loads in order, which is all this needs).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

from router.scheduling.service_time import Prediction
from router.serving.rules import ModelFigures, Refusal

__all__ = ["BOARD_BYTES", "MAX_MODELS", "BoardHeader", "BoardReader", "BoardWriter"]

SLOT_BYTES = 1024
MAX_MODELS = 255
BOARD_BYTES = SLOT_BYTES * (MAX_MODELS + 1)  # slot 0 is the header
_SEQ = struct.Struct("<Q")
_HEADER = struct.Struct("<IIId")  # epoch, ready, draining, published_at
_FIGURES = struct.Struct("<IIHHIII" "ddddd" "dIIddId" "dBH")
_DETAIL_AT = 8 + _FIGURES.size
DETAIL_MAX = SLOT_BYTES - _DETAIL_AT
_KINDS = ("ShuttingDown", "ModelUnavailable", "ModelDoesNotFit", "EngineUnavailable")
_PREDICTION, _IDLE, _HALF_OPEN, _SAMPLE, _REFUSAL, _REFUSAL_RETRY = 1, 2, 4, 8, 16, 32
READ_TRIES = 1000


@dataclass(frozen=True)
class BoardHeader:
    epoch: int  # the engine's start count: 0 until an engine has written the board
    ready: bool
    draining: bool
    published_at: float


class BoardWriter:
    """The engine's side: it creates the board and alone writes it."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("model-router-board", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, BOARD_BYTES)
        self._map = mmap.mmap(self.fd, BOARD_BYTES)

    def header(self, epoch: int, ready: bool, draining: bool, now: float) -> None:
        self._write(0, _HEADER.pack(epoch, ready, draining, now))

    def publish(self, slot: int, generation: int, figures: ModelFigures) -> None:
        """Write one model's figures into its slot (1..MAX_MODELS)."""
        self._write(slot * SLOT_BYTES, _encode(generation, figures))

    def clear(self, slot: int) -> None:
        """The model is gone: its slot reads as empty."""
        self._write(slot * SLOT_BYTES, bytes(_FIGURES.size + 3))

    def _write(self, base: int, record: bytes) -> None:
        (seq,) = _SEQ.unpack_from(self._map, base)
        _SEQ.pack_into(self._map, base, seq + 1 if seq % 2 == 0 else seq + 2)
        self._map[base + 8:base + 8 + len(record)] = record
        _SEQ.pack_into(self._map, base, seq + 2 if seq % 2 == 0 else seq + 3)

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)


class BoardReader:
    """A front's side: a read-only mapping of the board the engine sent."""

    def __init__(self, fd: int) -> None:
        self._map = mmap.mmap(fd, BOARD_BYTES, prot=mmap.PROT_READ)
        os.close(fd)
        self._decoded: dict[int, tuple[int, str, tuple[int, ModelFigures] | None]] = {}  # slot: (seq, name, figures)

    def header(self) -> BoardHeader:
        _, record = self._read(0, _HEADER.size, 0)
        epoch, ready, draining, at = _HEADER.unpack(record)
        return BoardHeader(epoch, bool(ready), bool(draining), at)

    def figures(self, slot: int, name: str) -> tuple[int, ModelFigures] | None:
        """(generation, figures) of the model in `slot`, or None while the slot is empty. A slot
        not written since the last read is not decoded again."""
        base = slot * SLOT_BYTES
        (seq,) = _SEQ.unpack_from(self._map, base)
        cached = self._decoded.get(slot)
        if cached is not None and cached[0] == seq and cached[1] == name:
            return cached[2]
        seq, record = self._read(base, _FIGURES.size, DETAIL_MAX)
        decoded = _decode(record, name)
        self._decoded[slot] = (seq, name, decoded)
        return decoded

    def _read(self, base: int, size: int, tail: int) -> tuple[int, bytes]:
        """A consistent copy of a record: its fixed part, and up to `tail` bytes after it when its
        last field (a length) says there are any."""
        for _ in range(READ_TRIES):
            (before,) = _SEQ.unpack_from(self._map, base)
            if before % 2:
                continue
            record = self._map[base + 8:base + 8 + size]
            if tail and (length := int.from_bytes(record[-2:], "little")):
                record += self._map[base + 8 + size:base + 8 + size + min(length, tail)]
            (after,) = _SEQ.unpack_from(self._map, base)
            if before == after:
                return before, record
        raise TimeoutError("the board is being written and never settles")

    def close(self) -> None:
        self._map.close()


def _encode(generation: int, f: ModelFigures) -> bytes:
    p, r = f.prediction, f.refusal
    flags = ((_PREDICTION if p else 0) | (_IDLE if f.idle else 0) | (_HALF_OPEN if f.half_open_at is not None else 0)
             | (_SAMPLE if f.last_sample_at is not None else 0) | (_REFUSAL if r else 0)
             | (_REFUSAL_RETRY if r and r.retry_after_s is not None else 0))
    detail = r.detail.encode()[:DETAIL_MAX] if r else b""
    kind = _KINDS.index(r.kind) if r and r.kind in _KINDS else 1
    fixed = _FIGURES.pack(
        generation, flags, f.priority_levels, f.default_priority, f.timeout_ms, f.capacity, f.occupancy,
        f.retry_after_s, f.at, f.half_open_at or 0.0, f.half_open_interval_s, f.last_sample_at or 0.0,
        p.answer_in_s if p else 0.0, p.queued_ahead if p else 0, p.batches_ahead if p else 0,
        p.batch_s if p else 0.0, p.running_left_s if p else 0.0, p.instances if p else 0, p.loading_s if p else 0.0,
        (r.retry_after_s or 0.0) if r else 0.0, kind, len(detail),
    )
    return fixed + detail


def _decode(record: bytes, name: str) -> tuple[int, ModelFigures] | None:
    (generation, flags, levels, default, timeout_ms, capacity, occupancy, retry_after_s, at, half_open_at, interval_s,
     last_sample_at, answer_in_s, queued_ahead, batches_ahead, batch_s, running_left_s, instances, loading_s,
     refusal_retry, kind, detail_len) = _FIGURES.unpack_from(record)
    if generation == 0:
        return None
    prediction = (Prediction(answer_in_s, queued_ahead, batches_ahead, batch_s, running_left_s, instances, loading_s)
                  if flags & _PREDICTION else None)
    refusal = None
    if flags & _REFUSAL:
        start = _DETAIL_AT - 8
        detail = record[start:start + detail_len].decode(errors="replace")
        refusal = Refusal(_KINDS[kind], detail, refusal_retry if flags & _REFUSAL_RETRY else None)
    return generation, ModelFigures(
        name=name, priority_levels=levels, default_priority=default, timeout_ms=timeout_ms, capacity=capacity,
        occupancy=occupancy, retry_after_s=retry_after_s, refusal=refusal, prediction=prediction,
        idle=bool(flags & _IDLE), half_open_at=half_open_at if flags & _HALF_OPEN else None,
        half_open_interval_s=interval_s, last_sample_at=last_sample_at if flags & _SAMPLE else None, at=at,
    )
