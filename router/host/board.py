"""The board: figures the engine publishes for the fronts' refusals, in shared memory.

One memfd, written only by the engine and mapped read-only by every front: a header (the engine's
epoch, ready, draining) and one fixed slot per model holding its `ModelFigures` (the rules'
inputs, its deadline forecast and the refusal's words included), as MessagePack. A front reads a slot and runs the same `admit` the engine
runs (`router.serving.rules`), with no round trip.

Each record is guarded by a sequence lock: the writer makes its counter odd, writes, makes it even
again; a reader retries until it reads the same even counter before and after the record (x86
keeps stores in order and loads in order, which is all this needs).

The header's `published_at` (the host's monotonic clock, the same in every process) is the
engine's heartbeat: it publishes every 100 ms at least, so a board silent for long
(`silent_s`) is an engine that hangs. The fronts then stop trusting it (`engine_stale_s`) and the
parent, which creates the board and hands it to each engine it starts, kills the engine
(`engine_hang_s`).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import msgspec
from msgspec.structs import replace

from router.serving.rules import ModelFigures

__all__ = ["BOARD_BYTES", "MAX_MODELS", "BoardHeader", "BoardReader", "BoardWriter", "create_board", "silent_s"]

SLOT_BYTES = 2048
MAX_MODELS = 255
BOARD_BYTES = SLOT_BYTES * (MAX_MODELS + 1)  # slot 0 is the header
_SEQ = struct.Struct("<Q")
_LENGTH = struct.Struct("<I")
_HEADER = struct.Struct("<IIId")  # epoch, ready, draining, published_at
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(tuple[int, ModelFigures])
RECORD_MAX = SLOT_BYTES - 8 - _LENGTH.size
READ_TRIES = 100


@dataclass(frozen=True)
class BoardHeader:
    epoch: int  # the engine's start count: 0 until an engine has written the board
    ready: bool
    draining: bool
    published_at: float


def silent_s(header: BoardHeader, now: float) -> float | None:
    """Seconds since the engine last published the board; None before it first did (still loading)."""
    if header.epoch == 0:
        return None
    return max(0.0, now - header.published_at)


def create_board() -> int:
    """A new, empty board: the memfd's descriptor (closed on exec unless handed on)."""
    fd = os.memfd_create("model-router-board", os.MFD_CLOEXEC)
    os.ftruncate(fd, BOARD_BYTES)
    return fd


class BoardWriter:
    """The engine's side: it alone writes the board, the one the parent handed it or its own."""

    def __init__(self, fd: int | None = None) -> None:
        self.fd = create_board() if fd is None else fd
        self._map = mmap.mmap(self.fd, BOARD_BYTES)

    def header(self, epoch: int, ready: bool, draining: bool, now: float) -> None:
        self._write(0, _HEADER.pack(epoch, ready, draining, now))

    def publish(self, slot: int, generation: int, figures: ModelFigures) -> None:
        """Write one model's figures into its slot (1..MAX_MODELS). Refusal words too long for the
        slot are cut short."""
        record = _ENCODER.encode((generation, figures))
        if len(record) > RECORD_MAX and figures.refusal is not None:
            cut = replace(figures.refusal, detail=figures.refusal.detail[:RECORD_MAX // 2] + "...")
            record = _ENCODER.encode((generation, replace(figures, refusal=cut)))
        self._write(slot * SLOT_BYTES, _LENGTH.pack(len(record)) + record)

    def clear(self, slot: int) -> None:
        """The model is gone: its slot reads as empty."""
        self._write(slot * SLOT_BYTES, _LENGTH.pack(0))

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
        self._header = BoardHeader(0, False, False, 0.0)

    def header(self) -> BoardHeader:
        read = self._read(0, _HEADER.size, False)
        if read is None:  # being written by an engine that lost its core: the last one read
            return self._header
        epoch, ready, draining, at = _HEADER.unpack(read[1])
        self._header = BoardHeader(epoch, bool(ready), bool(draining), at)
        return self._header

    def figures(self, slot: int, name: str) -> tuple[int, ModelFigures] | None:
        """(generation, figures) of the model in `slot`, or None while the slot is empty. A slot
        not written since the last read is not decoded again."""
        base = slot * SLOT_BYTES
        (seq,) = _SEQ.unpack_from(self._map, base)
        cached = self._decoded.get(slot)
        if cached is not None and cached[0] == seq and cached[1] == name:
            return cached[2]
        read = self._read(base, _LENGTH.size, True)
        if read is None:  # being written by an engine that lost its core: the last one read
            return cached[2] if cached is not None and cached[1] == name else None
        seq, record = read
        decoded = None
        if len(record) > _LENGTH.size:
            generation, figures = _DECODER.decode(record[_LENGTH.size:])
            decoded = (generation, replace(figures, name=name))
        self._decoded[slot] = (seq, name, decoded)
        return decoded

    def _read(self, base: int, size: int, prefixed: bool) -> tuple[int, bytes] | None:
        """A consistent copy of a record of `size` bytes, or with `prefixed`, of its length prefix
        and the bytes it counts; None if the writer stays in the middle of it (descheduled)."""
        for _ in range(READ_TRIES):
            (before,) = _SEQ.unpack_from(self._map, base)
            if before % 2:
                continue
            record = self._map[base + 8:base + 8 + size]
            if prefixed:
                (length,) = _LENGTH.unpack(record)
                record += self._map[base + 8 + size:base + 8 + size + min(length, RECORD_MAX)]
            (after,) = _SEQ.unpack_from(self._map, base)
            if before == after:
                return before, record
        return None

    def close(self) -> None:
        self._map.close()
