"""A front process's models: a plugin object per model, constructed but never loaded, which runs
`preprocess`, `postprocess` and `describe_input` here once it has the engine's front state.

A model's hooks run in the engine instead (the front sends the raw body) while the front has no
front state for it (never loaded yet), when its plugin says `preprocess_needs_model`, and when
the front state does not make its hooks work here: after adopting it, the front tries the
plugin's own `example_payload()`, and a plugin that raises there (one written before the split,
whose `preprocess` reads what `load` set) is served from the engine, with one log line saying so;
so is one whose hook raises here on a request that then succeeds in the engine (a `postprocess`
that needs the model).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from router.errors import ModelError
from router.host.messages import ModelEntry
from router.sdk.plugin import ModelPlugin, PluginContext
from router.serving.registry import PluginRegistry

__all__ = ["FrontHookFailed", "FrontModel", "FrontModels", "front_hook"]

log = logging.getLogger("router.host.front_models")
T = TypeVar("T")


@dataclass(eq=False)
class FrontModel:
    """One model as this front knows it."""

    entry: ModelEntry
    plugin: ModelPlugin[Any] | None  # None when its class or options do not build here
    accepts: tuple[str, ...]
    prepared_generation: int = 0  # the generation whose front state the plugin adopted; 0: none yet

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def prepares_here(self) -> bool:
        """Its hooks run in this front: the plugin took the front state of the serving generation."""
        return (self.plugin is not None and not self.entry.hooks_in_engine
                and self.prepared_generation == self.entry.generation)


class FrontModels:
    """The fleet as the engine last described it (`Models`), with this front's plugin objects."""

    def __init__(self) -> None:
        self.models: dict[str, FrontModel] = {}
        self._registry: dict[str, type[ModelPlugin[Any]]] = {}

    def get(self, name: str) -> FrontModel | None:
        return self.models.get(name)

    def update(self, entries: tuple[ModelEntry, ...]) -> list[FrontModel]:
        """Take the engine's new list; returns the models whose front state is new (to adopt)."""
        fresh: list[FrontModel] = []
        models: dict[str, FrontModel] = {}
        for entry in entries:
            known = self.models.get(entry.name)
            if known is not None and known.entry.plugin == entry.plugin and known.entry.options == entry.options:
                known.entry = entry
                model = known
            else:
                model = self._build(entry)
            models[entry.name] = model
            if entry.front_state is not None and model.prepared_generation != entry.generation and model.plugin:
                fresh.append(model)
        self.models = models
        return fresh

    def _build(self, entry: ModelEntry) -> FrontModel:
        try:
            cls = self._class(entry.plugin)
            options = cls.Options.model_validate_json(entry.options)
            context = PluginContext(entry.name, Path(entry.store_dir), entry.allow_absolute_paths)
            plugin = cls(options, context)
        except Exception as exc:  # noqa: BLE001  # the engine builds it; this front just cannot prepare its inputs
            log.warning("model %s: its plugin does not build in a front (%s: %s); its hooks run in the engine",
                        entry.name, type(exc).__name__, exc, extra={"model": entry.name})
            return FrontModel(entry, None, ())
        return FrontModel(entry, plugin, tuple(cls.accepts))

    def _class(self, name: str) -> type[ModelPlugin[Any]]:
        cls = self._registry.get(name)
        if cls is None:
            cls = self._registry[name] = PluginRegistry.from_entry_points(only={name}).get(name).cls
        return cls

    def serve_from_engine(self, model: FrontModel, hook: str, error: Exception) -> None:
        """A hook that failed here worked in the engine: this plugin's hooks need the loaded model."""
        log.warning("model %s: plugin %s failed in %s in a front process (%s) and worked in the engine; its hooks "
                    "run in the engine from now on", model.name, model.entry.plugin, hook, error,
                    extra={"model": model.name})
        model.plugin = None

    async def adopt(self, model: FrontModel) -> None:
        """Hand the plugin its front state, then check that `preprocess` works here."""
        entry, plugin = model.entry, model.plugin
        assert plugin is not None and entry.front_state is not None
        try:
            plugin.adopt_front_state(pickle.loads(entry.front_state))
            example = plugin.example_payload()
            if example is not None:
                await asyncio.to_thread(plugin.preprocess, example)
        except Exception as exc:  # noqa: BLE001  # a plugin written before the split: served from the engine
            log.warning("model %s: plugin %s cannot preprocess in a front process with its front state (%s: %s); "
                        "its hooks run in the engine", entry.name, entry.plugin, type(exc).__name__, exc,
                        extra={"model": entry.name})
            model.plugin = None
            return
        model.prepared_generation = entry.generation


class FrontHookFailed(Exception):
    """A plugin's hook raised in this front (not a RouterError it meant): maybe it needs the model."""

    def __init__(self, hook: str, error: ModelError) -> None:
        super().__init__(error.detail)
        self.hook, self.error = hook, error


async def front_hook(work: Awaitable[T], hook: str) -> T:
    """`work`, a hook run in this front; a plugin's own exception there is `FrontHookFailed`."""
    try:
        return await work
    except ModelError as exc:  # HookRunner's word for a plugin's own exception
        raise FrontHookFailed(hook, exc) from None
