"""A front's watch on its engine's heartbeat: the board's `published_at`, written every 100 ms at
least. An engine silent for `engine_stale_s` is taken as hung (stopped, or its event loop stuck):
the front then answers every request 503 with Retry-After, is not ready, and answers the requests it
had sent with the same 503 rather than letting them wait out their deadlines; figures that old
neither refuse nor admit. It trusts the engine again as soon as the engine publishes. The parent
kills an engine silent for longer (`engine_hang_s`, `router.host.supervisor`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from router.errors import EngineUnavailable
from router.host.board import BoardReader, silent_s
from router.host.exchange import engine_silent

__all__ = ["HEARTBEAT_EVERY_S", "Heartbeat"]

log = logging.getLogger("router.host.heartbeat")
#: How often a front looks at the heartbeat for requests it has sent (new ones look themselves).
HEARTBEAT_EVERY_S = 0.1


class Heartbeat:
    """Whether the engine behind one board still publishes, and the log lines when that changes."""

    def __init__(self, front: int, stale_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.front = front
        self.stale_after_s = stale_after_s
        self.clock = clock  # the host's monotonic clock: the board's times are the engine's reading of it
        self.hung = False

    def silence(self, board: BoardReader) -> EngineUnavailable | None:
        """The 503 to answer while the engine is silent past the bound; None while it publishes."""
        silent = silent_s(board.header(), self.clock())
        if silent is None or silent <= self.stale_after_s:
            return None
        return engine_silent(silent)

    def look(self, board: BoardReader) -> EngineUnavailable | None:
        """The 503 for the open requests when the engine has just gone silent; None otherwise."""
        silence = self.silence(board)
        if silence is not None and not self.hung:
            log.error("front %d: the engine has published nothing for more than %.1f s (engine_stale_s): answering "
                      "503 and not ready until it publishes again", self.front, self.stale_after_s,
                      extra={"event": "engine_silent", "limit_s": self.stale_after_s})
        elif silence is None and self.hung:
            log.warning("front %d: the engine publishes again", self.front, extra={"event": "engine_back"})
        fresh = silence is not None and not self.hung
        self.hung = silence is not None
        return silence if fresh else None

    def reset(self) -> None:
        """A new engine: nothing heard from it yet is silence."""
        self.hung = False
