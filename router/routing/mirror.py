"""Shadow copies: a request's input run on another version in spare device capacity, compared, dropped.

A copy is submitted as a shadow item (`Serving.submit(..., shadow=True)`): the serving core
admits it only while no real request waits on its device, refuses it first and never queues it
ahead of one. Its answer never reaches the user, its failure is nobody's (it is counted apart, as
the mirror's), and the user's answer never waits for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from router.routing.tally import Tallies
from router.sdk.plugin import Payload
from router.serving.facade import Answer, Serving
from router.serving.versions import VersionRoute, split_name

__all__ = ["Mirrors"]

log = logging.getLogger("router.routing.mirror")


class Mirrors:
    """The shadow copies in flight in this process, and the comparison of each with its user's answer."""

    def __init__(self, facade: Serving, tallies: Tallies, clock: Callable[[], float]) -> None:
        self.facade = facade
        self.tallies = tallies
        self.clock = clock
        self._open: set[asyncio.Task[Answer | None]] = set()

    @property
    def open(self) -> int:
        return len(self._open)

    def start(self, route: VersionRoute, version: str, payload: Payload, priority: int | None,
              timeout_ms: float | None) -> asyncio.Task[Answer | None]:
        """Submit a shadow copy of the input to `version` of `route`, with the request's own
        timeout from now; the task's result is its answer, None when it was shed or failed."""
        task = asyncio.ensure_future(self._shadow(route.deployment(version), payload, priority, timeout_ms))
        self._open.add(task)
        task.add_done_callback(self._open.discard)
        return task

    async def _shadow(self, deployment: str, payload: Payload, priority: int | None,
                      timeout_ms: float | None) -> Answer | None:
        try:
            return await self.facade.submit(deployment, payload, priority=priority, timeout_ms=timeout_ms, shadow=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001  # a shadow's refusal or failure is nobody's: counted by the core
            log.debug("shadow copy for %s not answered: %s: %s", deployment, type(exc).__name__, exc)
            return None

    def compare(self, route: VersionRoute, served: str, answer: Answer, shadow: asyncio.Task[Answer | None]) -> None:
        """Once the shadow copy is answered, record how its answer agrees with the user's (the
        version that is not the stable one against the stable one)."""

        def done(task: asyncio.Task[Answer | None]) -> None:
            if task.cancelled() or task.exception() is not None or task.result() is None:
                return
            other = task.result()
            assert other is not None
            _, copied = split_name(other.model)
            if copied is None:
                return
            version, against = (copied, served) if served == route.stable else (served, copied)
            value = self._agreement(route.deployment(version), answer.output if version == served else other.output,
                                    other.output if version == served else answer.output)
            if value is not None:
                self.tallies.agreed(route.name, version, against, value)

        shadow.add_done_callback(done)

    def _agreement(self, deployment: str, answer: Any, other: Any) -> float | None:
        try:
            return self.facade.agreement(deployment, answer, other)
        except Exception:  # a plugin's comparison hook that raises compares nothing
            log.exception("comparing the answers of %s failed", deployment)
            return None
