"""Plugin discovery through entry points, validated when a plugin registers."""

from __future__ import annotations

import inspect
from collections.abc import Collection
from dataclasses import dataclass
from importlib.metadata import entry_points

from pydantic import BaseModel

from router.errors import PluginValidationError, UnknownPlugin
from router.sdk.plugin import ModelPlugin

__all__ = ["ENTRY_POINT_GROUP", "PluginInfo", "PluginRegistry"]

ENTRY_POINT_GROUP = "model_router.plugins"


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
        for point in entry_points(group=group):
            self._discovered.add(point.name)
            if only is not None and point.name not in only:
                continue
            dist = getattr(point, "dist", None)
            try:
                target = point.load()
                self.register(
                    point.name,
                    target,
                    distribution=dist.name if dist else None,
                    version=dist.version if dist else None,
                )
            except PluginValidationError as exc:
                self._broken[point.name] = str(exc)
            except Exception as exc:  # an import error in a third-party package must not stop the others
                self._broken[point.name] = f"{type(exc).__name__}: {exc}"

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
