"""A name's versions and how its traffic is split between them: one immutable route per name.

A model with `versions:` in the fleet file serves each version as its own deployment, named
`{name}@{version}` (its own queue, batch policy, memory budget, residency). The name itself is a
route over them: weights (the split), the stable version answers fall back to, and a mirror
version that receives a copy of a share of the requests into spare device capacity only. Routes
are swapped whole, by generation; nothing patches one in place.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

from router.errors import ModelNotFound

__all__ = ["VERSION_SEPARATOR", "VersionRoute", "deployment_name", "mirrors", "pick", "route_problems", "split_name"]

#: Between a name and its version in a deployment's name (`resnet18@2`); never in a model's name.
VERSION_SEPARATOR = "@"


def deployment_name(name: str, version: str) -> str:
    """The deployment that serves `version` of `name`."""
    return f"{name}{VERSION_SEPARATOR}{version}"


def split_name(deployment: str) -> tuple[str, str | None]:
    """(name, version) of a deployment's name; (name, None) for a model without versions."""
    name, sep, version = deployment.partition(VERSION_SEPARATOR)
    return (name, version) if sep else (deployment, None)


@dataclass(frozen=True)
class VersionRoute:
    """One routed name: its versions, the split, the stable version, the mirror."""

    name: str
    versions: tuple[str, ...]  # in the fleet file's order
    stable: str
    weights: Mapping[str, float]  # version -> share (percent); versions not listed get none
    mirror: str | None = None  # the version that receives mirrored copies
    mirror_percent: float = 0.0  # the share of the name's requests mirrored, 0 to 100
    generation: int = 0

    def deployment(self, version: str) -> str:
        return deployment_name(self.name, version)


def pick(route: VersionRoute, *, pinned: str | None = None, sticky_key: str | None = None, draw: float) -> str:
    """The version that answers one request: the pinned one, else the split's at the key's point or `draw`.

    A sticky key hashes (blake2b, the same in every process and every run) to a point in [0, 1),
    so one key keeps its version while the weights stay the same. The point falls on the
    cumulative weights in the order of `route.versions`; a version of weight 0 is never picked
    unless pinned, and a split with no positive weight sends everything to the stable version.
    """
    if pinned is not None:
        if pinned not in route.versions:
            raise ModelNotFound(
                f"model {route.name!r} has no version {pinned!r}; its versions: {', '.join(route.versions)}"
            )
        return pinned
    point = _key_point(sticky_key) if sticky_key is not None else draw
    if not 0 <= point < 1:
        raise ValueError(f"draw is a uniform number in [0, 1), got {draw}")
    shares = [(version, route.weights.get(version, 0.0)) for version in route.versions]
    shares = [(version, weight) for version, weight in shares if weight > 0]
    total = sum(weight for _, weight in shares)
    if total <= 0:
        return route.stable
    target, cumulative = point * total, 0.0
    for version, weight in shares:
        cumulative += weight
        if target < cumulative:
            return version
    return shares[-1][0]  # the point at the top edge of a sum that rounding left short


def _key_point(key: str) -> float:
    """A sticky key's point in [0, 1): its blake2b hash, not Python's hash(), which each process salts."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def mirrors(route: VersionRoute, routed: str, draw: float) -> str | None:
    """The version that receives a copy of a request routed to `routed`, or None.

    None without a mirror, when `draw` (uniform in [0, 1)) falls outside the mirrored share, or
    when the request already goes to the mirror version: a version is not compared with itself.
    """
    if route.mirror is None or route.mirror == routed or draw * 100 >= route.mirror_percent:
        return None
    return route.mirror


def route_problems(route: VersionRoute) -> list[str]:
    """What is wrong with a route, one sentence each naming the bad value; empty when it can serve."""
    known = ", ".join(route.versions)
    problems = [
        f"weight for {version!r}, which is not a version of {route.name!r} (its versions: {known})"
        for version in route.weights
        if version not in route.versions
    ]
    problems += [
        f"weight of version {version!r} is {weight}; weights are percents, 0 or more"
        for version, weight in route.weights.items()
        if not (weight >= 0 and math.isfinite(weight))
    ]
    if route.stable not in route.versions:
        problems.append(f"stable version {route.stable!r} is not a version of {route.name!r} (its versions: {known})")
    if route.mirror is not None and route.mirror not in route.versions:
        problems.append(f"mirror version {route.mirror!r} is not a version of {route.name!r} (its versions: {known})")
    if not 0 <= route.mirror_percent <= 100:
        problems.append(f"mirror_percent is {route.mirror_percent}; it is a percent, 0 to 100")
    return problems
