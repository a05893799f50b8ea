"""A model's residency bookkeeping: who holds it, who waits for its load, what operators asked,
and what its loads and unloads cost.

It is a small state machine with one owner: every change is one of the transition methods below
(a request holds and releases the model, waits for its load; an operator loads, unloads or lets
go of it; the residency executor starts, ends and gives up loads, evicts, unloads, and learns that
an instance's process died). Its fields
are private and read through properties, so a write from anywhere else fails at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType

from router.serving.rules import Refusal

__all__ = ["LOAD_RETRY_S", "Residency"]

#: After a failed load, an on-demand model is not tried again for this long (doubling, up to 60 s).
LOAD_RETRY_S = 2.0
LOAD_RETRY_MAX_S = 60.0


class Residency:
    """One model's residency figures and the transitions that change them."""

    def __init__(self) -> None:
        self._holders = 0  # requests in flight, from admission to the answer: a model with holders is in use
        self._last_used = 0.0
        self._waiting: list[float] = []  # deadlines of requests waiting for a load
        self._held = False  # an operator's load: kept resident until an operator unloads it
        self._held_down = False  # an operator's unload: not loaded again until an operator loads it
        self._never_fits: str | None = None
        self._load_error: str | None = None
        self._lost: str | None = None  # why an instance's process died, until it serves again (it is restarted)
        self._restarts = 0  # instances restarted after their process died
        self._retry_at = 0.0  # no new load of a failing on-demand model before this
        self._retry_s = LOAD_RETRY_S
        self._cold_start_s: float | None = None  # the last successful load's duration
        self._load_started_at: float | None = None
        self._loads = 0
        self._load_failures = 0
        self._last_load_at: float | None = None  # wall-clock time (epoch seconds)
        self._last_unload_returned_bytes: int | None = None
        self._evictions: Counter[str] = Counter()  # by kind
        self._changed = asyncio.Event()

    # -- reading ------------------------------------------------------------------------------

    @property
    def holders(self) -> int:
        return self._holders

    @property
    def last_used(self) -> float:
        return self._last_used

    @property
    def waiting(self) -> tuple[float, ...]:
        return tuple(self._waiting)

    @property
    def held(self) -> bool:
        return self._held

    @property
    def held_down(self) -> bool:
        return self._held_down

    @property
    def never_fits(self) -> str | None:
        return self._never_fits

    @property
    def load_error(self) -> str | None:
        return self._load_error

    @property
    def lost(self) -> str | None:
        return self._lost

    @property
    def restarts(self) -> int:
        return self._restarts

    @property
    def retry_at(self) -> float:
        return self._retry_at

    @property
    def cold_start_s(self) -> float | None:
        return self._cold_start_s

    @property
    def load_started_at(self) -> float | None:
        return self._load_started_at

    @property
    def loads(self) -> int:
        return self._loads

    @property
    def load_failures(self) -> int:
        return self._load_failures

    @property
    def last_load_at(self) -> float | None:
        return self._last_load_at

    @property
    def last_unload_returned_bytes(self) -> int | None:
        return self._last_unload_returned_bytes

    @property
    def evictions(self) -> Mapping[str, int]:
        return MappingProxyType(self._evictions)

    @property
    def changed(self) -> asyncio.Event:
        """Set at the next change that waiters care about (a load ended, an unload, an operator's word)."""
        return self._changed

    def refusal(self, model: str, loading: bool, now: float) -> Refusal | None:
        """Why a request for this model cannot wait for a load now, or None if it can."""
        if self._never_fits is not None:
            return Refusal("ModelDoesNotFit", self._never_fits)
        if self._held_down:
            return Refusal("ModelUnavailable", f"model {model!r} was unloaded by an operator; load it with "
                                               f"POST /models/{model}/load", 30.0)
        if self._load_error is not None and not loading and now < self._retry_at:
            return Refusal("ModelUnavailable", f"model {model!r} failed to load: {self._load_error}", self._retry_at - now)
        return None

    def load_left_s(self, now: float) -> float:
        """Seconds until the load under way (or one started now) is expected to end (at least 1: a Retry-After)."""
        expected = self._cold_start_s or 1.0
        if self._load_started_at is None:
            return max(1.0, expected)
        return max(1.0, self._load_started_at + expected - now)

    # -- the request path -----------------------------------------------------------------------

    def hold(self, now: float) -> None:
        self._holders += 1
        self._last_used = now

    def release(self, now: float) -> None:
        self._holders -= 1
        self._last_used = now

    def wait_for_load(self, deadline: float) -> None:
        self._waiting.append(deadline)

    def stop_waiting(self, deadline: float) -> None:
        self._waiting.remove(deadline)

    # -- operators ------------------------------------------------------------------------------

    def operator_load(self) -> None:
        """Load and keep resident; forget earlier failures (they are tried again now)."""
        self._held, self._held_down = True, False
        self._load_error, self._never_fits, self._retry_at = None, None, 0.0
        self._pulse()

    def operator_unload(self) -> None:
        """Unload and keep out until an operator loads it again."""
        self._held, self._held_down = False, True
        self._pulse()  # requests waiting for a load get 503 now

    def let_go(self) -> None:
        """Drop a hold (an operator's, a placement's, or the one an added model loads under)."""
        self._held = False
        self._pulse()

    def allow_loads(self) -> None:
        """Lift an operator's unload (the old version of a model comes back after a failed change)."""
        self._held_down = False

    # -- the residency executor -----------------------------------------------------------------

    def load_started(self, now: float) -> None:
        self._load_started_at = now

    def load_succeeded(self, seconds: float) -> None:
        self._load_started_at = None
        self._loads += 1
        self._cold_start_s = seconds
        self._last_load_at = time.time()
        self._load_error, self._retry_s, self._lost = None, LOAD_RETRY_S, None
        self._pulse()

    def instance_lost(self, why: str, *, reload: bool) -> None:
        """An instance's process died; with `reload` (an always-resident model) residency loads it
        again at once, and until it serves, requests are refused as restarting."""
        self._restarts += 1
        if reload:
            self._lost = why
        self._pulse()

    def load_postponed(self) -> None:
        """Sized now, it waits for room: not a failure."""
        self._load_started_at = None
        self._pulse()

    def load_failed(self, error: str | None, now: float) -> None:
        """A failed load: retried no sooner than the back-off, which doubles each time."""
        self._load_started_at = None
        self._load_failures += 1
        self._load_error = error
        self._retry_at = now + self._retry_s
        self._retry_s = min(LOAD_RETRY_MAX_S, self._retry_s * 2)
        self._pulse()

    def cannot_fit(self, reason: str, error: str | None = None) -> bool:
        """It can never load here; False if that was known already."""
        self._load_started_at = None
        known = self._never_fits is not None
        self._never_fits = reason
        if error is not None:
            self._load_error = error
        self._pulse()
        return not known

    def evicted(self, kind: str) -> None:
        self._evictions[kind] += 1

    def unloaded(self, returned_bytes: int | None) -> None:
        self._last_unload_returned_bytes = returned_bytes
        self._pulse()

    def unload_failed(self) -> None:
        self._pulse()

    def _pulse(self) -> None:
        """Wake everyone waiting for a change."""
        self._changed.set()
        self._changed = asyncio.Event()
