"""Resolve a fleet config against the installed plugins: every name and option checked, before any port opens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from router.config import FleetConfig, config_error, validation_problems
from router.errors import UnknownPlugin, brief, clip
from router.sdk.plugin import PluginContext
from router.serving.registry import PluginInfo, PluginRegistry

__all__ = ["FleetPlan", "ModelPlan", "resolve_fleet"]


@dataclass(frozen=True)
class ModelPlan:
    name: str
    plugin: PluginInfo
    options: BaseModel


@dataclass(frozen=True)
class FleetPlan:
    source: str
    fleet: FleetConfig
    models: dict[str, ModelPlan]

    def describe(self) -> dict[str, Any]:
        """The resolved plan as plain data (printed by `model-router check`)."""
        devices = {
            name: device.model_dump(mode="json", exclude_none=True) for name, device in self.fleet.devices.items()
        }
        models = {}
        for name, plan in self.models.items():
            config = self.fleet.models[name]
            models[name] = {
                "plugin": plan.plugin.name,
                "distribution": f"{plan.plugin.distribution or '(registered in code)'} {plan.plugin.version or ''}".strip(),
                "instances": config.instance_devices,
                "options": plan.options.model_dump(mode="json"),
                "queue": config.queue.model_dump(mode="json"),
                "batch": config.batch.model_dump(mode="json"),
                "memory": config.memory.model_dump(mode="json", exclude_none=True),
                "execution": config.execution.model_dump(mode="json"),
                "warmup": config.warmup.model_dump(mode="json", exclude_none=True),
                "weight": config.weight,
                "required": config.required,
            }
        return {
            "source": self.source,
            "model_store": str(self.fleet.model_store),
            "devices": devices,
            "models": models,
        }


def resolve_fleet(fleet: FleetConfig, registry: PluginRegistry, source: str = "fleet") -> FleetPlan:
    """Match each model to its plugin, validate its options and construct the plugin once (which
    resolves its file paths: one escaping the model store is refused here). Nothing is loaded.
    All problems are reported together."""
    problems: list[str] = []
    models: dict[str, ModelPlan] = {}
    for name, config in fleet.models.items():
        try:
            info = registry.get(config.plugin)
        except UnknownPlugin as exc:
            problems.append(f"{source}: models.{name}.plugin: {clip(exc.message)} (got {brief(config.plugin)})")
            continue
        try:
            options = info.cls.Options.model_validate(config.options)
        except ValidationError as exc:
            problems += validation_problems(exc, source, info.cls.Options, prefix=f"models.{name}.options.")
            continue
        try:
            info.cls(options, PluginContext(name, fleet.model_store, fleet.allow_absolute_paths))
        except Exception as exc:  # a path outside the store (ValueError), or the plugin's own refusal
            problems.append(f"{source}: models.{name}.options: {clip(str(exc) or type(exc).__name__)}")
            continue
        models[name] = ModelPlan(name, info, options)
    if problems:
        raise config_error(source, problems)
    return FleetPlan(source, fleet, models)
