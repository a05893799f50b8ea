"""A model's versions in the fleet file: `versions:`, `stable:`, `traffic:`, `mirror:`, `rollout:`.

A model section with `versions:` serves each version as its own model, named `{name}@{version}`:
the model's own keys are the base and each version's section is merged over them (mappings key by
key, anything else replaced). The name itself becomes a route (`RouteConfig`) over its versions.
`expand_versions` does this on the parsed file, before validation, and keeps what it needs to
report a problem under the key the user wrote (`models.resnet18.versions.2.queue.max_size`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails

from router.rollout_config import RolloutConfig

__all__ = [
    "ROUTE_KEYS",
    "SEPARATOR",
    "VERSION_NAME_PATTERN",
    "Expansion",
    "MirrorConfig",
    "RouteConfig",
    "RouteProblems",
    "changed_route",
    "expand_versions",
    "merge_section",
    "removal_problem",
    "route_problems",
    "version_name_problem",
]

#: A version's name, whole (`resnet18@2`'s `2`).
VERSION_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}"
#: Between a name and its version in a deployment's name; the model name pattern has no '@'.
SEPARATOR = "@"
#: The keys of a model section that describe its route, not a model.
ROUTE_KEYS = ("versions", "stable", "traffic", "mirror", "rollout")


def version_name_problem(version: str) -> str | None:
    """Why `version` is not a version name, or None."""
    if re.fullmatch(VERSION_NAME_PATTERN, version):
        return None
    return (f"version name {version!r} is not valid; accepted: letters, digits, '_', '.', '-', starting with a "
            "letter or digit, at most 32 characters")


class RouteProblems(ValueError):
    """A route's problems, each under its key (`traffic.3`), so a fleet file's report can name them."""

    def __init__(self, problems: list[tuple[tuple[str, ...], str]]) -> None:
        super().__init__("; ".join(f"{'.'.join(key)}: {message}" if key else message for key, message in problems))
        self.problems = problems


class _Route(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MirrorConfig(_Route):
    """A version that receives a copy of a share of the name's requests, into spare capacity only."""

    version: str
    percent: float = Field(100.0, ge=0, le=100, description="the share of the name's requests copied to it")


class RouteConfig(_Route):
    """A routed name: its versions in the file's order, the stable version, the split, the mirror, the rollout."""

    versions: list[str] = Field(min_length=1)
    stable: str = Field(description="default: the first version listed")
    traffic: dict[str, float] = Field(description="share by version (percent); default: all to the stable version")
    mirror: MirrorConfig | None = None
    rollout: RolloutConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        """YAML reads `1:` as a number: version names are strings wherever they appear."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("versions"), list):
            data["versions"] = [_text(v) for v in data["versions"]]
        for key in ("stable",):
            if key in data:
                data[key] = _text(data[key])
        if data.get("stable") is None and data.get("versions"):
            data["stable"] = data["versions"][0]
        if isinstance(data.get("traffic"), dict):
            data["traffic"] = {_text(k): v for k, v in data["traffic"].items()}
        elif data.get("traffic") is None and "stable" in data:
            data["traffic"] = {data["stable"]: 100}
        for key, inner in (("mirror", "version"), ("rollout", "candidate")):
            if isinstance(data.get(key), dict) and inner in data[key]:
                data[key] = {**data[key], inner: _text(data[key][inner])}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> RouteConfig:
        problems = route_problems(self)
        if problems:
            raise RouteProblems(problems)
        return self

    def weight(self, version: str) -> float:
        return self.traffic.get(version, 0.0)


def _text(value: Any) -> Any:
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


def route_problems(route: RouteConfig) -> list[tuple[tuple[str, ...], str]]:
    """Every problem of a route, each with its key: names it does not list, bad weights, its mirror and rollout."""
    versions = route.versions
    listed = ", ".join(versions)
    problems = [(("versions",), p) for v in versions if (p := version_name_problem(v))]
    if len(set(versions)) != len(versions):
        problems.append((("versions",), f"a version is listed twice (got {versions})"))

    def unknown(key: tuple[str, ...], version: str) -> None:
        if version not in versions:
            problems.append((key, f"no version {version!r}; versions: {listed}"))

    unknown(("stable",), route.stable)
    for version, weight in route.traffic.items():
        unknown(("traffic", version), version)
        if not math.isfinite(weight) or weight < 0:
            problems.append((("traffic", version), f"weight {weight} is not accepted; accepted: a share of 0 or more"))
    if route.traffic and all(weight == 0 for weight in route.traffic.values()):
        problems.append((("traffic",), f"every weight is 0 (got {route.traffic}); give a version a share above 0"))
    if route.mirror is not None:
        unknown(("mirror", "version"), route.mirror.version)
    if route.rollout is not None:
        unknown(("rollout", "candidate"), route.rollout.candidate)
        if route.rollout.candidate == route.stable:
            message = f"{route.rollout.candidate!r} is the stable version; a rollout moves traffic to another of {listed}"
            problems.append((("rollout", "candidate"), message))
    return problems


@dataclass
class Expansion:
    """A fleet file's models with their versions expanded, and what turns a problem's key back into the one written."""

    data: Any
    sections: dict[str, tuple[str, str, Mapping[str, Any]]] = field(default_factory=dict)  # deployment: (name, version, its section)
    routed: set[str] = field(default_factory=set)
    errors: list[InitErrorDetails] = field(default_factory=list)

    def translate(self, error: ValidationError | None, schema: type[BaseModel],
                  accepted_keys: Callable[[type[BaseModel], tuple[Any, ...]], list[str]]) -> ValidationError:
        """`error`'s problems (and the expansion's own) under the keys the user wrote; an unknown key's
        message lists the keys accepted where it was found (`accepted_keys(schema, its path)`)."""
        details: list[InitErrorDetails] = list(self.errors)
        seen: set[tuple[Any, ...]] = set()
        for item in error.errors() if error is not None else []:
            for loc, message in self._located(item):
                detail: InitErrorDetails
                if item["type"] == "extra_forbidden":
                    accepted = accepted_keys(schema, tuple(item["loc"][:-1]))
                    detail = _value_error(loc, f"unknown key; accepted: {', '.join(accepted)}", item["input"])
                elif message is not None:
                    detail = _value_error(loc, message, item["input"])
                else:
                    detail = {"type": item["type"], "loc": loc, "input": item["input"]}  # type: ignore[typeddict-item]
                    if "ctx" in item:
                        detail["ctx"] = item["ctx"]
                key = (loc, item["type"], message or item["msg"])
                if key not in seen:
                    seen.add(key)
                    details.append(detail)
        return ValidationError.from_exception_data(schema.__name__, details)

    def _located(self, item: Any) -> list[tuple[tuple[str | int, ...], str | None]]:
        """Where a problem belongs in the file as written (several for a route's problems), with a new message if any."""
        loc = tuple(item["loc"])
        if len(loc) >= 2 and loc[0] == "routes" and loc[1] in self.routed:
            error = (item.get("ctx") or {}).get("error")
            if isinstance(error, RouteProblems) and len(loc) == 2:
                return [(("models", loc[1], *key), message) for key, message in error.problems]
            return [(("models", *loc[1:]), None)]
        if len(loc) >= 2 and loc[0] == "models" and loc[1] in self.sections:
            name, version, section = self.sections[str(loc[1])]
            rest = loc[2:]
            if _holds(section, rest):
                return [(("models", name, "versions", version, *rest), None)]
            return [(("models", name, *rest), None)]
        return [(loc, None)]


def _holds(section: Mapping[str, Any], path: tuple[str | int, ...]) -> bool:
    """Whether the version's own section holds the key at `path` (else it came from the model's base)."""
    node: Any = section
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return bool(path)


def _value_error(loc: tuple[str | int, ...], message: str, got: Any) -> InitErrorDetails:
    return {"type": "value_error", "loc": loc, "input": got, "ctx": {"error": ValueError(message)}}


def merge_section(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` merged over `base`: mappings key by key, anything else replaced."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_section(merged[key], value)
        else:
            merged[key] = value
    return merged


def expand_versions(data: Any) -> Expansion:
    """Each model section with `versions:` becomes one model per version (`name@version`, in place)
    and a route under `routes`; a fleet without versions is returned as it came."""
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict) or not any(isinstance(s, dict) and set(s) & set(ROUTE_KEYS) for s in models.values()):
        return Expansion(data)
    expansion = Expansion(data)
    expanded: dict[Any, Any] = {}
    routes: dict[Any, Any] = dict(data["routes"]) if isinstance(data.get("routes"), dict) else {}
    for name, section in models.items():
        if not isinstance(section, dict) or not set(section) & set(ROUTE_KEYS):
            expanded[name] = section
            continue
        route = _expand_one(str(name), section, expanded, expansion)
        if route is not None:
            if name in routes:
                expansion.errors.append(_value_error(("models", name), "routed twice: by its versions and in "
                                                     "routes; keep one", None))
            routes[name] = route
            expansion.routed.add(str(name))
    expansion.data = {**data, "models": expanded, "routes": routes}
    return expansion


def _expand_one(name: str, section: dict[str, Any], expanded: dict[Any, Any], expansion: Expansion) -> dict[str, Any] | None:
    """One routed model's versions, added to `expanded`; its route's data, or None after an error."""
    versions = section.get("versions")
    where = ("models", name, "versions")
    if "versions" not in section:
        present = ", ".join(k for k in ROUTE_KEYS if k in section)
        expansion.errors.append(_value_error(("models", name), f"{present}: only a model with versions: takes it; "
                                             "list them, like versions: {'1': {}, '2': {options: {...}}}", section))
        return None
    if not isinstance(versions, dict) or not versions:
        expansion.errors.append(_value_error(where, "versions must map each version's name to its section, like "
                                             "{'1': {}, '2': {options: {...}}}", versions))
        return None
    base = {key: value for key, value in section.items() if key not in ROUTE_KEYS}
    names = []
    for raw, own in versions.items():
        version = str(_text(raw))
        if (problem := version_name_problem(version)) is not None:
            expansion.errors.append(_value_error((*where, version), problem, raw))
            continue
        if own is not None and not isinstance(own, dict):
            expansion.errors.append(_value_error((*where, version), "a version's section is a mapping of the model's "
                                                 "keys to change, like {options: {weights: b.pt}} or {}", own))
            continue
        deployment = f"{name}{SEPARATOR}{version}"
        expanded[deployment] = merge_section(base, own or {})
        expansion.sections[deployment] = (name, version, own or {})
        names.append(version)
    if len(names) != len(versions):
        return None
    return {"versions": names, **{key: section[key] for key in ROUTE_KEYS[1:] if key in section}}


def changed_route(route: RouteConfig, *, weights: Mapping[str, float] | None = None, stable: str | None = None,
                  mirror: str | None = None, mirror_percent: float | None = None) -> dict[str, Any]:
    """The data of `route` after an operator's change, to validate as a RouteConfig: `weights` is
    the whole new split (versions it leaves out get none), `mirror` "" stops mirroring, and what is
    None stays. A stable version that becomes the rollout's candidate ends that rollout: it is promoted."""
    data = route.model_dump()
    if weights is not None:
        data["traffic"] = {_text(version): weight for version, weight in weights.items()}
    if stable is not None:
        data["stable"] = _text(stable)
    if mirror == "":
        data["mirror"] = None
    elif mirror is not None or mirror_percent is not None:
        current = route.mirror
        version = mirror if mirror is not None else current.version if current is not None else None
        if version is None:
            raise RouteProblems([(("mirror", "percent"), f"{mirror_percent:g} given without a mirror; name the version to mirror too")])
        percent = mirror_percent if mirror_percent is not None else current.percent if current is not None else 100.0
        data["mirror"] = {"version": _text(version), "percent": percent}
    if route.rollout is not None and data["stable"] == route.rollout.candidate:
        data["rollout"] = None
    return data


def removal_problem(route: RouteConfig, version: str) -> str | None:
    """Why a version cannot be removed from its route now (what still sends it requests), or None."""
    if version == route.stable:
        return f"version {version!r} is the stable version: make another one stable first"
    if route.weight(version) > 0:
        return f"version {version!r} takes {route.weight(version):g} of the traffic: move it to another version first"
    if route.mirror is not None and route.mirror.version == version:
        return f"version {version!r} is the mirror: stop mirroring it, or mirror another version, first"
    if route.rollout is not None and route.rollout.candidate == version:
        return (f"version {version!r} is the candidate of the rollout in the fleet file: change its rollout: "
                "and reload first")
    return None
