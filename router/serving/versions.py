"""A name's versions and how its traffic is split between them: one immutable route per name.

A model with `versions:` in the fleet file serves each version as its own deployment, named
`{name}@{version}` (its own queue, batch policy, memory budget, residency). The name itself is a
route over them: weights (the split), the stable version answers fall back to, and a mirror
version that receives a copy of a share of the requests into spare device capacity only. Routes
are swapped whole, by generation; nothing patches one in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["VERSION_SEPARATOR", "VersionRoute", "deployment_name", "split_name"]

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
