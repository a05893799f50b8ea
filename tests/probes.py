"""A memory probe for tests: readings from a script, behind the real `MemoryProbe` interface."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from router.scheduling.memory import MemoryReading, ProbeError

__all__ = ["ScriptedProbe"]


class ScriptedProbe:
    """Readings from a script, for tests: a sequence (the last value repeats) or a callable.
    An exception instance in the script is raised when reached."""

    def __init__(
        self,
        device: str,
        script: Iterable[MemoryReading | BaseException] | Callable[[], MemoryReading],
    ) -> None:
        self.device = device
        self.reads = 0
        self._call: Callable[[], MemoryReading] | None = script if callable(script) else None
        self._items: Iterator[MemoryReading | BaseException] | None = (
            None if callable(script) else iter(list(script))
        )
        self._last: MemoryReading | BaseException | None = None

    def read(self) -> MemoryReading:
        self.reads += 1
        if self._call is not None:
            return self._call().check()
        assert self._items is not None
        self._last = next(self._items, self._last)
        if self._last is None:
            raise ProbeError("scripted probe has no readings")
        if isinstance(self._last, BaseException):
            raise self._last
        return self._last.check()

    def close(self) -> None:
        pass
