"""Counting a routed name's answers by version: the metrics, /models, and the rollout's observations."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any, Protocol

from router.errors import RouterError, outcome_of
from router.serving.traffic import Observation

__all__ = ["Tallies", "VersionTelemetry"]


class VersionTelemetry(Protocol):
    """Where a version's figures go (the Prometheus metrics)."""

    def observe_version(self, name: str, version: str, outcome: str, seconds: float) -> None: ...
    def observe_agreement(self, name: str, version: str, against: str, value: float) -> None: ...
    def observe_fallback(self, name: str) -> None: ...


class Tallies:
    """A routed name's figures by version, as this process saw them; each observation also goes
    to `report` (the serving core's `report_versions`: the rollouts' owner)."""

    def __init__(self, report: Callable[[Observation], None], clock: Callable[[], float]) -> None:
        self.report = report
        self.clock = clock
        self.sinks: list[VersionTelemetry] = []
        self.outcomes: defaultdict[tuple[str, str], Counter[str]] = defaultdict(Counter)
        self.agreement: defaultdict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0.0])
        self.fallbacks: Counter[str] = Counter()

    def served(self, name: str, version: str, seconds: float) -> None:
        self.outcomes[name, version]["ok"] += 1
        for sink in self.sinks:
            sink.observe_version(name, version, "ok", seconds)
        self.report(Observation(name, version, "served", seconds))

    def failed(self, name: str, version: str, error: BaseException, seconds: float) -> None:
        outcome = outcome_of(error)
        self.outcomes[name, version][outcome] += 1
        for sink in self.sinks:
            sink.observe_version(name, version, outcome, seconds)
        if isinstance(error, RouterError) and error.status_code in (500, 504):  # the version's own fault: the rule counts it
            self.report(Observation(name, version, "failed", seconds))

    def agreed(self, name: str, version: str, against: str, value: float) -> None:
        figures = self.agreement[name, version, against]
        figures[0] += 1
        figures[1] += value
        for sink in self.sinks:
            sink.observe_agreement(name, version, against, value)
        self.report(Observation(name, version, "agreement", value, against))

    def fell_back(self, name: str) -> None:
        self.fallbacks[name] += 1
        for sink in self.sinks:
            sink.observe_fallback(name)

    def describe(self, name: str) -> dict[str, Any]:
        """This process's figures of `name`: outcomes by version, mean agreement by pair, fallbacks."""
        return {
            "outcomes": {v: dict(c) for (n, v), c in self.outcomes.items() if n == name},
            "agreement": {f"{v} vs {a}": {"compared": int(f[0]), "mean": round(f[1] / f[0], 4) if f[0] else None}
                          for (n, v, a), f in self.agreement.items() if n == name},
            "fallbacks": self.fallbacks[name],
        }
