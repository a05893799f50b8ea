"""Resolve a fleet config against the installed plugins: every name and option checked, before any port opens.

Pipelines are resolved after the models (`resolve_pipelines`): the names their steps use, their
transforms' options, and whether each step can take what the step before it gives.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from dataclasses import field as dataclass_field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, BaseModel, ValidationError

from router.config import SECRET_LOOKING, FleetConfig, RouteConfig, config_error, load_fleet, validation_problems
from router.errors import UnknownPlugin, brief, clip
from router.pipeline_config import PipelineConfig, StepConfig
from router.sdk.plugin import PluginContext
from router.sdk.transforms import Transform
from router.serving.registry import PluginInfo, PluginRegistry
from router.serving.transforms import TransformRegistry
from router.serving.versions import VersionRoute, deployment_name, split_name

__all__ = ["FleetPlan", "ModelPlan", "PipelinePlan", "load_plan", "option_keys", "pipeline_transforms", "plan_pipeline",
           "resolve_fleet", "resolve_pipelines", "version_route"]


@dataclass(frozen=True)
class ModelPlan:
    name: str
    plugin: PluginInfo
    options: BaseModel
    files: tuple[tuple[str, Path], ...] = ()  # the paths its plugin resolved: as given, and in the store

    def missing_files(self, source: str) -> list[str]:
        """One line per file its plugin named that does not exist: the option's key, its value and the path."""
        keys = {str(value): key for key, value in self.options.model_dump().items() if isinstance(value, str | Path)}
        return [f"{source}: models.{self.name}.options.{keys.get(given, '?')}: {given!r}: no such file ({path})"
                for given, path in self.files if not path.exists()]


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline checked against the fleet: its steps, the models it uses (through the pipelines
    it names too) and the model its requests enter by. A model with versions is listed by its name:
    each item is routed to a version as it goes."""

    name: str
    config: PipelineConfig
    models: tuple[str, ...]
    entry: str

    def describe(self) -> dict[str, Any]:
        return {"steps": [step.model_dump(exclude_defaults=True) for step in self.config.steps],
                "timeout_ms": self.config.timeout_ms, "models": list(self.models), "entry": self.entry}


@dataclass(frozen=True)
class FleetPlan:
    source: str
    fleet: FleetConfig
    models: dict[str, ModelPlan]
    pipelines: dict[str, PipelinePlan] = dataclass_field(default_factory=dict)
    routes: dict[str, VersionRoute] = dataclass_field(default_factory=dict)  # the names of models with versions

    def users_of(self, model: str) -> list[str]:
        """The pipelines that use `model` (directly or through another pipeline); a version
        (`resnet18@2`) is used by the pipelines that use its name."""
        name, version = split_name(model)
        routed = version is not None and name in self.routes
        return sorted(p for p, plan in self.pipelines.items() if model in plan.models or routed and name in plan.models)

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
            "pipelines": {name: plan.describe() for name, plan in self.pipelines.items()},
            "routes": {name: _describe_route(route, self.fleet.routes.get(name)) for name, route in self.routes.items()},
        }


def version_route(name: str, config: RouteConfig, generation: int = 1) -> VersionRoute:
    """The route a fleet file's section gives a name with versions."""
    mirror = config.mirror
    return VersionRoute(name, tuple(config.versions), config.stable, dict(config.traffic),
                        mirror.version if mirror else None, mirror.percent if mirror else 0.0, generation)


def _describe_route(route: VersionRoute, config: RouteConfig | None) -> dict[str, Any]:
    rollout = config.rollout if config is not None else None
    return {"versions": {v: route.deployment(v) for v in route.versions}, "stable": route.stable,
            "traffic": dict(route.weights), "mirror": {"version": route.mirror, "percent": route.mirror_percent}
            if route.mirror else None, "rollout": rollout.model_dump(mode="json") if rollout else None,
            "generation": route.generation}


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
        context = PluginContext(name, fleet.model_store, fleet.allow_absolute_paths)
        try:
            info.cls(options, context)
        except Exception as exc:  # noqa: BLE001  # a path outside the store (ValueError), or the plugin's own refusal
            problems.append(f"{source}: models.{name}.options: {clip(str(exc) or type(exc).__name__)}")
            continue
        models[name] = ModelPlan(name, info, options, tuple(context.resolved))
    if problems:
        raise config_error(source, problems)
    return FleetPlan(source, fleet, models, routes={name: version_route(name, route) for name, route in fleet.routes.items()})


def load_plan(config_path: Path, registry: PluginRegistry | None = None,
              transforms: TransformRegistry | None = None) -> FleetPlan:
    """Parse and resolve a fleet file, its pipelines included; raises ConfigError naming file, key,
    value and what is accepted. Without registries, only the plugins and transforms the fleet names
    are imported."""
    fleet = load_fleet(config_path)
    if registry is None:
        registry = PluginRegistry.from_entry_points(only={model.plugin for model in fleet.models.values()})
    plan = resolve_fleet(fleet, registry, str(config_path))
    if not fleet.pipelines:
        return plan
    pipelines = resolve_pipelines(fleet, plan.models, transforms or pipeline_transforms(fleet), str(config_path))
    return replace(plan, pipelines=pipelines)


def pipeline_transforms(fleet: FleetConfig) -> TransformRegistry:
    """The transforms the fleet's pipelines use (and the built-in ones), imported and validated."""
    return TransformRegistry.from_entry_points(
        only={step.name for pipeline in fleet.pipelines.values() for step in pipeline.steps if step.kind == "transform"})


def resolve_pipelines(fleet: FleetConfig, models: Mapping[str, ModelPlan], transforms: TransformRegistry,
                      source: str = "fleet") -> dict[str, PipelinePlan]:
    """Check every pipeline against the fleet's models and pipelines and the installed transforms;
    all problems are reported together (ConfigError)."""
    problems: list[str] = []
    plans = {}
    for name, config in fleet.pipelines.items():
        found = _PipelineCheck(name, config, fleet, models, transforms, source).problems()
        problems += found
        if not found:
            plans[name] = plan_pipeline(name, fleet.pipelines)
    if problems:
        raise config_error(source, problems)
    return plans


def plan_pipeline(name: str, pipelines: Mapping[str, PipelineConfig]) -> PipelinePlan:
    """A pipeline's plan from pipelines `resolve_pipelines` has checked (a cluster's front has its
    file checked at deploy): the models it uses and the one its requests enter by."""
    return PipelinePlan(name, pipelines[name], tuple(sorted(_models_used(name, pipelines))), _entry(name, pipelines) or "")


def _models_used(name: str, pipelines: Mapping[str, PipelineConfig]) -> set[str]:
    used: set[str] = set()
    for step in pipelines[name].steps:
        if step.kind == "model":
            used.add(step.name)
        elif step.kind == "pipeline" and step.name in pipelines and step.name != name:
            used |= _models_used(step.name, {k: v for k, v in pipelines.items() if k != name})
    return used


def _entry(name: str, pipelines: Mapping[str, PipelineConfig], seen: frozenset[str] = frozenset()) -> str | None:
    """The model a pipeline's requests enter by: its first step's (through pipelines it names)."""
    first = pipelines[name].steps[0]
    if first.kind == "model":
        return first.name
    if first.name in seen or first.name not in pipelines:
        return None
    return _entry(first.name, pipelines, seen | {name})


def _cycle(start: str, pipelines: Mapping[str, PipelineConfig], path: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    """A chain of pipeline steps from `start` back to the first pipeline of `path`, if there is one."""
    path = (*path, start)
    for step in pipelines[start].steps:
        if step.kind != "pipeline" or step.name not in pipelines:
            continue
        if step.name == path[0]:
            return (*path, step.name)
        if step.name not in path and (found := _cycle(step.name, pipelines, path)):
            return found
    return None


@dataclass(frozen=True)
class _PipelineCheck:
    """The checks of one pipeline, each problem one line naming file, key, value and what is accepted."""

    name: str
    config: PipelineConfig
    fleet: FleetConfig
    models: Mapping[str, ModelPlan]
    transforms: TransformRegistry
    source: str

    def problems(self) -> list[str]:
        key = f"{self.source}: pipelines.{self.name}"
        if self.name in self.fleet.models or self.name in self.fleet.routes:
            return [(f"{key}: a model is named {self.name!r} too; models and pipelines share one name "
                     "(POST /models/{name}/predict): rename one")]
        problems = [f"{key}.steps[{i}].{message}" for i, step in enumerate(self.config.steps)
                    if (message := self._unknown(step)) is not None]
        if problems:
            return problems
        if (cycle := _cycle(self.name, self.fleet.pipelines)) is not None:
            return [f"{key}.steps: a cycle of pipelines: {' -> '.join(cycle)}; a pipeline cannot run itself"]
        steps = self.config.steps
        for index in range(1, len(steps), 2):
            problems += [f"{key}.steps[{index}]: {p}" for p in self._fits(steps[index - 1], steps[index], steps[index + 1])]
        used = [d for m in sorted(_models_used(self.name, self.fleet.pipelines)) for d in self._deployments(m)]
        levels = {m: self.fleet.models[m].queue.priority_levels for m in used}
        if len(set(levels.values())) > 1:
            shown = ", ".join(f"{m}: {n}" for m, n in levels.items())
            problems.append(f"{key}: its models have different queue.priority_levels ({shown}); X-Priority carries "
                            "to every step, so they must agree")
        return problems

    def _unknown(self, step: StepConfig) -> str | None:
        """`key: why` when a step's name or options are not accepted."""
        if step.kind == "model" and step.name not in self.fleet.models and step.name not in self.fleet.routes:
            return "model: " + _no_such("model", step.name, [*self.fleet.models, *self.fleet.routes])
        if step.kind == "pipeline" and step.name not in self.fleet.pipelines:
            return "pipeline: " + _no_such("pipeline", step.name, list(self.fleet.pipelines))
        if step.kind != "transform":
            return None
        info = self.transforms.get(step.name)
        if info is None:
            return f"transform: {self.transforms.why_missing(step.name)}"
        return _options_problem(info.cls, step.options)

    def _fits(self, before: StepConfig, transform: StepConfig, after: StepConfig) -> list[str]:
        """Whether `transform` can read what `before` answers, and `after` take what it gives."""
        info = self.transforms.get(transform.name)
        assert info is not None
        cls, problems = info.cls, []
        for shown, plugin in self._plugins(before):
            answers = plugin.cls.answers
            if cls.needs is not None and answers is not None and answers != cls.needs:
                problems.append(f"transform {transform.name} reads the answer of a model that answers {cls.needs}; "
                                f"{shown} answers {answers} (plugin {plugin.name})")
            if cls.gives == "image" and not _takes_images(plugin):
                problems.append(f"transform {transform.name} passes on the image {shown} took, but it takes "
                                f"{', '.join(plugin.cls.accepts)}")
        for shown, plugin in self._plugins(after):
            takes = _takes_images(plugin) if cls.gives == "image" else any(
                fnmatch("application/json", pattern.lower()) for pattern in plugin.cls.accepts)
            if not takes:
                wanted = "image/*" if cls.gives == "image" else "application/json"
                problems.append(f"transform {transform.name} gives {cls.gives}s, for a model that accepts {wanted}; "
                                f"{shown} accepts {', '.join(plugin.cls.accepts)} (plugin {plugin.name})")
        return problems

    def _model_of(self, step: StepConfig) -> str:
        """The model a step's input goes to first (a pipeline step's entry model)."""
        return step.name if step.kind == "model" else _entry(step.name, self.fleet.pipelines) or ""

    def _deployments(self, model: str) -> list[str]:
        """The models that serve a name: its versions' for a model with versions, else its own."""
        route = self.fleet.routes.get(model)
        return [deployment_name(model, v) for v in route.versions] if route is not None else [model]

    def _plugins(self, step: StepConfig) -> list[tuple[str, PluginInfo]]:
        """The plugin of each model a step's input can go to first, with how a message shows it:
        every version's, for a model with versions (each item may be routed to any of them)."""
        model = self._model_of(step)
        shown = step.describe()
        return [(shown if deployment == model else f"{shown} (version {split_name(deployment)[1]})",
                 self.models[deployment].plugin) for deployment in self._deployments(model)]


def _takes_images(plugin: PluginInfo) -> bool:
    return any(pattern.lower().startswith("image/") for pattern in plugin.cls.accepts)


def _no_such(what: str, name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"no {what} named {brief(name)}; {what}s: {', '.join(sorted(known)) or 'none'}{hint}"


def _options_problem(cls: type[Transform], options: Mapping[str, Any]) -> str | None:  # type: ignore[type-arg]
    """The first problem of a transform's options (unknown key, bad value), or None."""
    accepted = option_keys(cls.Options)
    unknown = [key for key in options if key not in accepted]
    if unknown:
        return (f"options.{clip(unknown[0], 80)}: unknown key; accepted: {', '.join(accepted) or 'none'} "
                f"(got {brief(options[unknown[0]])})")
    try:
        cls.Options.model_validate(dict(options))
    except ValidationError as exc:
        lines = validation_problems(exc, "-", cls.Options, prefix="options.")
        return "; ".join(line.removeprefix("-: ") for line in lines)
    return None


def transform_options(cls: type[Transform], options: Mapping[str, Any]) -> BaseModel:  # type: ignore[type-arg]
    """A transform's options, validated (after `resolve_pipelines` accepted them)."""
    return cls.Options.model_validate(dict(options))
