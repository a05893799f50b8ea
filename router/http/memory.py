"""Handing memory back to the system after bursts of large request bodies.

glibc's allocator keeps the memory that request bodies, decoded tensors and images leave behind
when they are freed: after 64 concurrent 15 MB bodies the process stays gigabytes larger, though it
does not keep growing. `malloc_trim(0)` returns the free pages; it is called off the event loop
once the requests of a burst have finished. Elsewhere than glibc it is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from router.serving.memory import malloc_trim

__all__ = ["BodyMemory", "malloc_trim"]

log = logging.getLogger("router.http.memory")
TRIM_AFTER_BYTES = 64 * 1024 * 1024
CHECK_INTERVAL_S = 1.0
BUSY_TRIM_INTERVAL_S = 10.0


class BodyMemory:
    """Counts body bytes and requests in flight; trims once a burst of large bodies is over (or
    every 10 s while one lasts)."""

    def __init__(self, threshold_bytes: int = TRIM_AFTER_BYTES, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold_bytes = threshold_bytes
        self.clock = clock
        self.since_trim = 0
        self.in_flight = 0
        self.last_trim = clock()
        self.trims = 0

    def received(self, size: int) -> None:
        self.since_trim += size

    def due(self) -> bool:
        """Enough body bytes since the last trim, and the burst is over or has lasted a while."""
        if self.since_trim < self.threshold_bytes:
            return False
        return self.in_flight == 0 or self.clock() - self.last_trim >= BUSY_TRIM_INTERVAL_S

    async def trim_after_bursts(self) -> None:
        """Run for the app's lifetime (the lifespan starts and cancels it)."""
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            if self.due():
                self.since_trim = 0
                self.last_trim = self.clock()
                started = time.perf_counter()
                if not await asyncio.to_thread(malloc_trim):
                    return
                self.trims += 1
                log.debug("returned free heap memory to the system in %.1f ms", (time.perf_counter() - started) * 1000)
