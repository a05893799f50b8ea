"""A front's connection to the engine: the handshake on a blocking socket (descriptors cross by
`SCM_RIGHTS`), then an asyncio protocol on the front's event loop. What the front sends in one
loop turn leaves in one `write`."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from router.host.arena import Arena
from router.host.messages import EngineMessage, Frames, Hello, Welcome, encode_frame

__all__ = ["EngineStream", "Handshake", "handshake"]


@dataclass
class Handshake:
    sock: socket.socket
    welcome: Welcome
    board_fd: int
    answer_fd: int
    frames: Frames  # with whatever followed the Welcome in the same read
    early: list[Any]  # messages that came with the Welcome


def handshake(path: Path, front: int, arena: Arena, timeout_s: float = 10.0) -> Handshake:
    """Connect, say Hello with the request arena, take the Welcome with the board and the answer
    arena. Raises OSError (no engine yet) or ValueError (an engine that does not follow it)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(str(path))
        out = bytearray()
        encode_frame(Hello(front, os.getpid(), arena.size), out)
        assert arena.fd is not None
        socket.send_fds(sock, [bytes(out)], [arena.fd])
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        frames = Frames(EngineMessage)
        messages = frames.feed(data)
        if len(fds) != 2 or not messages or not isinstance(messages[0], Welcome):
            for fd in fds:
                os.close(fd)
            raise ValueError(f"the engine's welcome is not one: {len(fds)} descriptor(s), {messages[:1]}")
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return Handshake(sock, messages[0], fds[0], fds[1], frames, messages[1:])


class EngineStream(asyncio.Protocol):
    """The connected stream: decoded messages to `on_message`, the end to `on_lost`."""

    def __init__(self, frames: Frames, on_message: Callable[[Any], None], on_lost: Callable[[], None]) -> None:
        self._frames = frames
        self._on_message = on_message
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._out = bytearray()
        self._flush_due = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        try:
            messages = self._frames.feed(data)
        except (ValueError, msgspec.DecodeError):
            if self._transport is not None:
                self._transport.close()
            return
        for message in messages:
            self._on_message(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._on_lost()

    def send(self, message: msgspec.Struct) -> None:
        """Queue a message; everything queued in this loop turn goes out in one write."""
        if self.closed:
            return
        encode_frame(message, self._out)
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        if self._out and self._transport is not None and not self.closed:
            self._transport.write(bytes(self._out))
        self._out.clear()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
