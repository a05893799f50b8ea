"""Requests being answered: their count, the outcome each one ends with, and a wait for none.

Every front counts its requests this way: a drain waits until none is in flight, and every
request ends with exactly one outcome counted, whether its screen refused it (`screening`) or it
went on to be answered (`InFlight.request`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from router.errors import RouterError, outcome_of

__all__ = ["InFlight", "screening"]


@contextmanager
def screening(ended: Callable[[str], None]) -> Iterator[None]:
    """A request's screen: a refusal from it is the request's outcome (`ended(outcome)`), raised on."""
    try:
        yield
    except RouterError as exc:
        ended(outcome_of(exc))
        raise


class InFlight:
    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextmanager
    def request(self, ended: Callable[[str], None]) -> Iterator[None]:
        """One request in flight for the block; then `ended(outcome)`: "ok", the outcome of the
        RouterError or cancellation that left the block, or "error" for anything else."""
        outcome = "error"
        self.count += 1
        self._idle.clear()
        try:
            yield
            outcome = "ok"
        except (RouterError, asyncio.CancelledError) as exc:
            outcome = outcome_of(exc)
            raise
        finally:
            self.count -= 1
            if self.count == 0:
                self._idle.set()
            ended(outcome)

    async def until_idle(self, timeout_s: float) -> None:
        """Return once no request is in flight; TimeoutError after `timeout_s`."""
        await asyncio.wait_for(self._idle.wait(), timeout_s)
