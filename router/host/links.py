"""The engine's side of its connections to the fronts: the handshake, one reader thread per front,
one writer thread for all.

A reader thread decodes frames and unpacks items (views of the front's request arena) and hands
each read's messages to the event loop in one `call_soon_threadsafe`. The writer thread packs
outputs into each front's answer arena (it alone allocates and frees there), encodes and writes.
So the loop that schedules batches never serialises anything and never makes a socket call.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from router.host.arena import Arena
from router.host.messages import (
    Failure,
    Frames,
    FrontMessage,
    Hello,
    Release,
    Reply,
    Submit,
    Welcome,
    encode_frame,
)
from router.host.packing import Packer, unpack
from router.scheduling.queue import BatchFacts

__all__ = ["ANSWER_ARENA_BYTES", "FrontLink", "Outgoing", "Writer", "accept_front"]

log = logging.getLogger("router.host.links")
#: Each front's answer arena (outputs of predict_batch on their way to postprocess).
ANSWER_ARENA_BYTES = 64 * 1024 * 1024
READ_BYTES = 256 * 1024


@dataclass(frozen=True)
class Outgoing:
    """A reply to write: an output to pack (for the front's postprocess), a final answer (hooks in
    the engine), or a failure; `message` for anything already a message."""

    id: int = 0
    output: Any = None
    answer: bytes | None = None
    input_info: bytes | None = None
    failure: Failure | None = None
    facts: BatchFacts | None = None
    message: msgspec.Struct | None = None
    packs: bool = False  # `output` is to be packed


@dataclass(eq=False)
class FrontLink:
    """One connected front: its socket, its arenas, its open requests (kept by the engine's loop)."""

    index: int
    pid: int
    sock: socket.socket
    request_arena: Arena  # the front's: read here, never allocated here
    answer_arena: Arena  # the engine's: only the writer thread allocates and frees
    requests: dict[int, Any] = field(default_factory=dict)
    alive: bool = True
    outbox: list[Outgoing] = field(default_factory=list)
    received: dict[str, int] = field(default_factory=dict)  # messages by kind

    @property
    def name(self) -> str:
        return f"front {self.index} (pid {self.pid})"


def accept_front(sock: socket.socket, epoch: int, board_fd: int, board_bytes: int) -> FrontLink:
    """The handshake on a new connection: Hello with the front's arena, Welcome with the board and
    the front's answer arena. Raises OSError or ValueError on a peer that does not follow it."""
    sock.settimeout(10.0)
    data, fds, _, _ = socket.recv_fds(sock, 64 * 1024, 1)
    if len(fds) != 1:
        raise ValueError(f"a front's hello must carry its arena's descriptor, got {len(fds)}")
    frames = Frames(FrontMessage)
    messages = frames.feed(data)
    while not messages:
        more = sock.recv(64 * 1024)
        if not more:
            raise ValueError("the front closed the connection during its hello")
        messages = frames.feed(more)
    hello = messages[0]
    if not isinstance(hello, Hello):
        raise ValueError(f"a front's first message must be Hello, got {type(hello).__name__}")  # noqa: TRY004
    request_arena = Arena.attach(fds[0], hello.arena_bytes)
    answer_arena = Arena.create(f"model-router-answers-{hello.front}", ANSWER_ARENA_BYTES)
    out = bytearray()
    encode_frame(Welcome(os.getpid(), epoch, board_bytes, ANSWER_ARENA_BYTES), out)
    assert answer_arena.fd is not None
    socket.send_fds(sock, [bytes(out)], [board_fd, answer_arena.fd])
    sock.settimeout(None)
    return FrontLink(hello.front, hello.pid, sock, request_arena, answer_arena)


def read_front(link: FrontLink, loop: asyncio.AbstractEventLoop, deliver: Callable[[FrontLink, list[Any]], None],
               lost: Callable[[FrontLink], None], writer: Writer) -> None:
    """The reader thread of one front: decode, unpack items, hand each read's messages to the loop
    (a Submit goes as (Submit, item)); Release goes straight to the writer. Ends when the front goes."""
    frames = Frames(FrontMessage)
    buffer = bytearray(READ_BYTES)
    try:
        while True:
            size = link.sock.recv_into(buffer)
            if not size:
                break
            batch: list[Any] = []
            for message in frames.feed(memoryview(buffer)[:size]):
                if isinstance(message, Release):
                    writer.put(link, [Outgoing(message=message)])
                elif isinstance(message, Submit):
                    batch.append((message, unpack(message.item, link.request_arena) if message.item else None))
                else:
                    batch.append(message)
            if batch:
                loop.call_soon_threadsafe(deliver, link, batch)
    except (OSError, ValueError, msgspec.DecodeError) as exc:
        log.warning("%s: connection failed: %s: %s", link.name, type(exc).__name__, exc)
    finally:
        try:
            loop.call_soon_threadsafe(lost, link)
        except RuntimeError:  # the loop is closed: the engine is stopping
            pass


class Writer:
    """The one writer thread: packs, encodes and writes what the loop hands it, front by front."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[FrontLink, list[Outgoing]] | None] = queue.SimpleQueue()
        self._packers: dict[int, Packer] = {}
        self._thread = threading.Thread(target=self._run, name="engine-writer", daemon=True)
        self.inline_buffers = 0

    def start(self) -> None:
        self._thread.start()

    def put(self, link: FrontLink, items: list[Outgoing]) -> None:
        self._queue.put((link, items))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(5.0)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            link, items = job
            try:
                self._write(link, items)
            except Exception:  # one front's trouble must not stop the others' answers (logged with its traceback)
                log.exception("%s: writing failed", link.name)

    def _write(self, link: FrontLink, items: list[Outgoing]) -> None:
        out = bytearray()
        packer = self._packers.get(id(link))
        if packer is None:
            packer = self._packers[id(link)] = Packer(link.answer_arena)
        for item in items:
            if isinstance(item.message, Release):
                for offset in item.message.offsets:
                    link.answer_arena.free(offset)
                continue
            if isinstance(item.message, _Forget):
                self._packers.pop(id(link), None)
                link.answer_arena.close()
                return
            if item.message is not None:
                encode_frame(item.message, out)
                continue
            output = None
            if item.packs:
                try:
                    output, packing = packer.pack(item.output)
                except Exception as exc:  # noqa: BLE001  # an output pickle cannot carry: that request's 500
                    failure = Failure("ModelError", f"the model's output cannot reach the front: {type(exc).__name__}: "
                                                    f"{exc}")
                    encode_frame(Reply(item.id, failure=failure), out)
                    continue
                self.inline_buffers += packing.inline_buffers
            encode_frame(Reply(item.id, output, item.answer, item.input_info, item.failure, item.facts), out)
        if out and link.alive:
            try:
                link.sock.sendall(out)
            except OSError as exc:  # the reader sees the end too, and cleans up
                log.info("%s: write failed: %s", link.name, exc)

    def forget(self, link: FrontLink) -> None:
        """The front is gone: its packer and answer arena go with it."""
        self._queue.put((link, [Outgoing(message=_Forget())]))


class _Forget(msgspec.Struct):
    """The writer drops a link's packer (queued behind its last writes)."""
