"""Pipeline transforms by name: the built-in ones, and those plugins declare under the
`model_router.transforms` entry point, each validated when it registers."""

from __future__ import annotations

import inspect
from collections.abc import Collection
from dataclasses import dataclass

from pydantic import BaseModel

from router.errors import PluginValidationError
from router.sdk.crop import CropTransform, WholeTransform
from router.sdk.transforms import ITEM_KINDS, TRANSFORMS_GROUP, Transform
from router.serving.registry import discover

__all__ = ["BUILT_IN", "TransformInfo", "TransformRegistry", "validate_transform_class"]

BUILT_IN: dict[str, type[Transform]] = {"crop": CropTransform, "whole": WholeTransform}  # type: ignore[type-arg]


@dataclass(frozen=True)
class TransformInfo:
    name: str
    cls: type[Transform]  # type: ignore[type-arg]
    distribution: str | None = None  # None: built in


class TransformRegistry:
    """Transforms by name: the built-in ones first; an entry point may not take their names."""

    def __init__(self) -> None:
        self._transforms = {name: TransformInfo(name, cls) for name, cls in BUILT_IN.items()}
        self.broken: dict[str, str] = {}
        self._discovered: set[str] = set()

    @classmethod
    def from_entry_points(cls, *, only: Collection[str] | None = None) -> TransformRegistry:
        """The built-in transforms and the group's entry points (those named in `only`, or all)."""
        registry = cls()
        found = discover(TRANSFORMS_GROUP, _transform_class, only=None if only is None else set(only) - set(BUILT_IN))
        registry._discovered = found.names
        registry.broken.update(found.broken)
        for name, entry in found.entries.items():
            try:
                registry.register(name, entry.target, distribution=entry.distribution)
            except PluginValidationError as exc:
                registry.broken[name] = str(exc)
        return registry

    def register(self, name: str, target: object, *, distribution: str | None = None) -> TransformInfo:
        """Validate and add a transform class; PluginValidationError at once if it is unfit."""
        validate_transform_class(name, target)
        if name in BUILT_IN and BUILT_IN[name] is not target:
            raise PluginValidationError(name, "the name of a built-in transform")
        info = TransformInfo(name, target, distribution)  # type: ignore[arg-type]  # checked above
        self._transforms[name] = info
        return info

    def get(self, name: str) -> TransformInfo | None:
        return self._transforms.get(name)

    def why_missing(self, name: str) -> str:
        """Why `name` is not here: broken, or not installed (listing what is)."""
        if name in self.broken:
            return f"transform {name!r} is installed but failed to load: {self.broken[name]}"
        return f"no transform named {name!r}; transforms: {', '.join(self.names())}"

    def names(self) -> list[str]:
        return sorted(set(self._transforms) | self._discovered)


def _transform_class(name: str, target: object) -> type[Transform]:  # type: ignore[type-arg]
    validate_transform_class(name, target)
    return target  # type: ignore[return-value]  # checked above


def validate_transform_class(name: str, target: object) -> None:
    """A transform must be a concrete Transform subclass with a pydantic Options model, a `needs`
    that is a word or None, and a `gives` the router knows."""
    if not (inspect.isclass(target) and issubclass(target, Transform)):
        raise PluginValidationError(name, f"entry point must name a Transform subclass, got {target!r}")
    if inspect.isabstract(target):
        raise PluginValidationError(name, f"{target.__name__} does not implement: apply")
    options = getattr(target, "Options", None)
    if not (inspect.isclass(options) and issubclass(options, BaseModel)):
        raise PluginValidationError(name, f"{target.__name__}.Options must be a pydantic BaseModel, got {options!r}")
    if target.needs is not None and not (isinstance(target.needs, str) and target.needs):
        raise PluginValidationError(name, f"{target.__name__}.needs must be a non-empty string or None, got {target.needs!r}")
    if target.gives not in ITEM_KINDS:
        raise PluginValidationError(name, f"{target.__name__}.gives must be one of {', '.join(ITEM_KINDS)}, "
                                          f"got {target.gives!r}")
