"""Discovery through entry points: model plugins (validated when they register), and the
generic group loader that exporters and demo files are found with too."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Generic, TypeVar

from pydantic import BaseModel

from router.errors import PluginValidationError, UnknownPlugin
from router.sdk.plugin import PLUGINS_GROUP, ModelPlugin

__all__ = ["ENTRY_POINT_GROUP", "Discovered", "Entry", "PluginInfo", "PluginRegistry", "discover"]

ENTRY_POINT_GROUP = PLUGINS_GROUP
T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One entry point's target, checked, and the distribution that declared it."""

    name: str
    target: T
    distribution: str | None = None
    version: str | None = None


@dataclass
class Discovered(Generic[T]):
    """What an entry-point group holds: targets that loaded and passed their check, by name; the
    broken ones with their error; and every name seen, imported or not."""

    entries: dict[str, Entry[T]] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)


def discover(group: str, check: Callable[[str, object], T], *, only: Collection[str] | None = None) -> Discovered[T]:
    """Load the group's entry points (those named in `only`, or all) and check each target.

    `check(name, target)` returns the target as T or raises (PluginValidationError with the reason).
    An entry point that fails to import or to pass is recorded as broken: one bad third-party
    package must not stop the others.
    """
    found: Discovered[T] = Discovered()
    for point in entry_points(group=group):
        found.names.add(point.name)
        if only is not None and point.name not in only:
            continue
        dist = getattr(point, "dist", None)
        try:
            target = check(point.name, point.load())
        except PluginValidationError as exc:
            found.broken[point.name] = str(exc)
        except Exception as exc:  # noqa: BLE001  # a broken entry point is listed as broken, never fatal
            found.broken[point.name] = f"{type(exc).__name__}: {exc}"
        else:
            found.entries[point.name] = Entry(point.name, target, dist.name if dist else None,
                                              dist.version if dist else None)
    return found


@dataclass(frozen=True)
class PluginInfo:
    name: str
    cls: type[ModelPlugin]  # type: ignore[type-arg]
    distribution: str | None = None
    version: str | None = None


class PluginRegistry:
    """Plugins by name. Broken entry points are remembered with their error, not raised at import."""

    def __init__(self) -> None:
        self._plugins: dict[str, PluginInfo] = {}
        self._broken: dict[str, str] = {}
        self._discovered: set[str] = set()  # entry-point names, imported or not

    @classmethod
    def from_entry_points(cls, group: str = ENTRY_POINT_GROUP, *, only: Collection[str] | None = None) -> PluginRegistry:
        """Discover the group's plugins; import and validate those named in `only` (all if None).
        Serving imports only what the fleet uses: the other names are still listed in errors."""
        registry = cls()
        registry.load_entry_points(group, only=only)
        return registry

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP, *, only: Collection[str] | None = None) -> None:
        found = discover(group, _plugin_class, only=only)
        self._discovered |= found.names
        self._broken.update(found.broken)
        for name, entry in found.entries.items():
            try:
                self.register(name, entry.target, distribution=entry.distribution, version=entry.version)
            except PluginValidationError as exc:  # a name already taken by another class
                self._broken[name] = str(exc)

    def register(
        self,
        name: str,
        target: object,
        *,
        distribution: str | None = None,
        version: str | None = None,
    ) -> PluginInfo:
        """Validate and add a plugin class. Raises PluginValidationError at once if it is unfit."""
        validate_plugin_class(name, target)
        if name in self._plugins and self._plugins[name].cls is not target:
            existing = self._plugins[name].cls
            raise PluginValidationError(name, f"a different plugin is already registered under this name: {existing!r}")
        info = PluginInfo(name, target, distribution, version)  # type: ignore[arg-type]
        self._plugins[name] = info
        self._broken.pop(name, None)
        return info

    def get(self, name: str) -> PluginInfo:
        try:
            return self._plugins[name]
        except KeyError:
            raise UnknownPlugin(name, self.installed(), self._broken) from None

    def names(self) -> list[str]:
        """Plugins imported and validated."""
        return sorted(self._plugins)

    def installed(self) -> list[str]:
        """Every plugin name known, whether or not it was imported."""
        return sorted(set(self._plugins) | self._discovered)

    @property
    def broken(self) -> dict[str, str]:
        return dict(self._broken)


def _plugin_class(name: str, target: object) -> type[ModelPlugin]:  # type: ignore[type-arg]
    validate_plugin_class(name, target)
    return target  # type: ignore[return-value]  # checked above


def validate_plugin_class(name: str, target: object) -> None:
    if not (inspect.isclass(target) and issubclass(target, ModelPlugin)):
        raise PluginValidationError(name, f"entry point must name a ModelPlugin subclass, got {target!r}")
    if inspect.isabstract(target):
        missing = ", ".join(sorted(getattr(target, "__abstractmethods__", ())))
        raise PluginValidationError(name, f"{target.__name__} does not implement: {missing}")
    options = getattr(target, "Options", None)
    if not (inspect.isclass(options) and issubclass(options, BaseModel)):
        raise PluginValidationError(name, f"{target.__name__}.Options must be a pydantic BaseModel, got {options!r}")
    accepts = getattr(target, "accepts", None)
    if not (isinstance(accepts, tuple) and accepts and all(isinstance(t, str) and "/" in t for t in accepts)):
        raise PluginValidationError(
            name, f"{target.__name__}.accepts must be a non-empty tuple of media types like 'image/*', got {accepts!r}"
        )
