"""Resolve a fleet config against the installed plugins: every name and option checked, before any port opens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, BaseModel, ValidationError

from router.config import SECRET_LOOKING, FleetConfig, config_error, load_fleet, validation_problems
from router.errors import UnknownPlugin, brief, clip
from router.sdk.plugin import PluginContext
from router.serving.registry import PluginInfo, PluginRegistry

__all__ = ["FleetPlan", "ModelPlan", "load_plan", "option_keys", "resolve_fleet"]


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
                "required": config.is_required,
                "residency": config.residency,
            }
        return {
            "source": self.source,
            "model_store": str(self.fleet.model_store),
            "devices": devices,
            "models": models,
        }


def option_keys(schema: type[BaseModel]) -> list[str]:
    """The keys an options model reads, in declaration order: field names and their string aliases.
    Any other key is refused for every plugin, whatever its `model_config` says about extra keys:
    a misspelt option must never be dropped silently."""
    config = schema.model_config
    by_name = bool(config.get("populate_by_name") or config.get("validate_by_name"))
    keys: dict[str, None] = {}
    for field_name, field in schema.model_fields.items():
        if by_name or (field.alias is None and field.validation_alias is None):
            keys[field_name] = None
        for alias in (field.alias, field.validation_alias):
            if isinstance(alias, str):
                keys[alias] = None
            elif isinstance(alias, AliasChoices):
                keys.update((choice, None) for choice in alias.choices if isinstance(choice, str))
    return list(keys)


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
        schema = info.cls.Options
        accepted = option_keys(schema)
        unknown = [key for key in config.options if key not in accepted]
        problems.extend(
            f"{source}: models.{name}.options.{clip(key, 80)}: unknown key; accepted: {', '.join(accepted) or 'none'}"
            + (" (value not shown: the key may hold a secret)" if SECRET_LOOKING.search(key)
               else f" (got {brief(config.options[key])})")
            for key in unknown
        )
        try:
            options = schema.model_validate({k: v for k, v in config.options.items() if k in accepted})
        except ValidationError as exc:
            problems += validation_problems(exc, source, schema, prefix=f"models.{name}.options.")
            continue
        if unknown:
            continue
        try:
            info.cls(options, PluginContext(name, fleet.model_store, fleet.allow_absolute_paths))
        except Exception as exc:  # noqa: BLE001  # a path outside the store (ValueError), or the plugin's own refusal
            problems.append(f"{source}: models.{name}.options: {clip(str(exc) or type(exc).__name__)}")
            continue
        models[name] = ModelPlan(name, info, options)
    if problems:
        raise config_error(source, problems)
    return FleetPlan(source, fleet, models)


def load_plan(config_path: Path, registry: PluginRegistry | None = None) -> FleetPlan:
    """Parse and resolve a fleet file; raises ConfigError naming file, key, value and what is accepted.
    Without a registry, only the plugins the fleet names are imported."""
    fleet = load_fleet(config_path)
    if registry is None:
        registry = PluginRegistry.from_entry_points(only={model.plugin for model in fleet.models.values()})
    return resolve_fleet(fleet, registry, str(config_path))
