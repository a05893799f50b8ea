"""A gRPC stream's frames as a pure async pipeline (`answer_in_order`): answers in the frames' order
whatever order they finish in, at most `limit` frames read ahead (back-pressure), and every
frame's task awaited or cancelled when the stream ends, fails or is cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from router.grpc.inference import answer_in_order


class Frames:
    """An async iterator of frames that counts how many were read."""

    def __init__(self, count: int, fail_at: int | None = None) -> None:
        self.count, self.fail_at, self.read = count, fail_at, 0

    def __aiter__(self) -> AsyncIterator[int]:
        return self

    async def __anext__(self) -> int:
        if self.read == self.fail_at:
            raise ConnectionError("the stream broke")
        if self.read >= self.count:
            raise StopAsyncIteration
        self.read += 1
        return self.read - 1


async def settle() -> None:
    """Let every ready task run until none can go further (no timers involved)."""
    for _ in range(50):
        await asyncio.sleep(0)


async def test_answers_keep_the_frames_order_whatever_order_they_finish_in() -> None:
    done = [asyncio.Event() for _ in range(4)]

    async def answer(frame: Any, seq: int) -> str:
        await done[seq].wait()
        return f"answer {frame}"

    answers = answer_in_order(Frames(4), answer, limit=4)
    first = asyncio.ensure_future(anext(answers))
    for seq in (3, 1, 2):
        done[seq].set()
    await settle()
    assert not first.done()  # frame 0 is not answered: nothing may overtake it
    done[0].set()
    assert await first == "answer 0"
    assert [a async for a in answers] == ["answer 1", "answer 2", "answer 3"]


async def test_at_most_limit_frames_are_read_ahead() -> None:
    release = asyncio.Event()
    frames = Frames(10)

    async def answer(frame: Any, seq: int) -> int:
        await release.wait()
        return seq

    answers = answer_in_order(frames, answer, limit=3)
    first = asyncio.ensure_future(anext(answers))
    await settle()
    assert frames.read == 3  # the fourth frame stays unread until an answer goes out
    release.set()
    assert await first == 0
    await settle()
    assert frames.read == 3  # answered, but its slot is free only once the answer is taken (written)
    assert await anext(answers) == 1
    await settle()
    assert frames.read == 4
    assert [a async for a in answers] == list(range(2, 10)) and frames.read == 10


async def test_cancelling_the_stream_cancels_every_frame() -> None:
    started: list[asyncio.Future[None]] = []
    cancelled = 0

    async def answer(frame: Any, seq: int) -> int:
        nonlocal cancelled
        started.append(asyncio.get_running_loop().create_future())
        try:
            await asyncio.Event().wait()  # never answered
        except asyncio.CancelledError:
            cancelled += 1
            raise
        return seq

    answers = answer_in_order(Frames(5), answer, limit=5)
    consumer = asyncio.ensure_future(anext(answers))
    await settle()
    assert len(started) == 5
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    await answers.aclose()
    assert cancelled == 5


async def test_a_broken_stream_fails_after_the_frames_read_before_it() -> None:
    async def answer(frame: Any, seq: int) -> int:
        return seq

    got = []
    with pytest.raises(ConnectionError, match="the stream broke"):
        async for value in answer_in_order(Frames(10, fail_at=3), answer, limit=2):
            got.append(value)
    assert got == [0, 1, 2]
