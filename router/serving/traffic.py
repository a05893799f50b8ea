"""The values about a routed name's traffic that cross from a front to the fleet's owner.

One definition, imported on both sides of a split host (`router.host.messages`): a front
observes answers (`Observation`) and forwards operators' changes of a split (`TrafficChange`);
the engine (or the one process, or the cluster's front) owns the routes and their rollouts.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["Observation", "ObservationKind", "TrafficChange"]

ObservationKind = Literal["served", "failed", "agreement"]


class Observation(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One answer of a version (`served` or `failed`, `value` its latency in seconds), or one
    comparison of a version's answer with another's on the same input (`agreement`, `value` in
    0..1, `against` the other version)."""

    name: str
    version: str
    kind: ObservationKind
    value: float
    against: str = ""


class TrafficChange(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An operator's change of a routed name's traffic, applied whole; what it leaves None stays.
    `mirror` "" stops mirroring."""

    weights: dict[str, float] | None = None
    stable: str | None = None
    mirror: str | None = None
    mirror_percent: float | None = None
