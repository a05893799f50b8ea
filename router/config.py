"""Typed configuration: the fleet YAML and the server settings.

Everything is parsed and validated here, before any port opens. Errors name the file, the key,
the bad value and what is accepted.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from router.devices import check_device_name
from router.errors import ConfigError, brief, clip
from router.pipeline_config import PipelineConfig
from router.version_config import SEPARATOR, MirrorConfig, RouteConfig, expand_versions, version_name_problem

__all__ = [
    "AutoscalingConfig",
    "BatchPolicy",
    "ClusterConfig",
    "CopiesConfig",
    "DeviceConfig",
    "ExecutionConfig",
    "FleetConfig",
    "FrontConfig",
    "MemoryConfig",
    "MirrorConfig",
    "ModelConfig",
    "NodeTypeConfig",
    "PipelineConfig",
    "QueueConfig",
    "RouteConfig",
    "ServerSettings",
    "WarmupConfig",
    "config_error",
    "format_validation_error",
    "load_fleet",
    "load_settings",
    "nesting_exceeds",
    "resolve_workers",
    "validation_problems",
]

#: A model's name, whole (matched with re.fullmatch: `$` would also match before a final newline).
MODEL_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
#: Instances of one model (entries of its `devices`): each is a thread, a plugin object and, with
#: isolation: process, a process.
MAX_INSTANCES = 64
#: Mappings and lists inside one another in a fleet file or a model's section.
MAX_CONFIG_DEPTH = 32
SECRET_KEYS = {"api_keys", "admin_keys"}
#: A key whose value an error message never shows: it may hold a secret.
SECRET_LOOKING = re.compile(r"key|secret|token|passw|credential|auth", re.IGNORECASE)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class QueueConfig(_Strict):
    """A model's bounded queue."""

    max_size: int = Field(64, ge=1, le=1_000_000, description="queued requests before 503")
    timeout_ms: int = Field(10_000, ge=1, description="default deadline; X-Timeout-Ms may shorten it")
    priority_levels: int = Field(3, ge=1, le=16, description="accepted X-Priority values are 1..N")
    default_priority: int = Field(1, ge=1, description="priority of requests without X-Priority")

    @model_validator(mode="after")
    def _default_in_range(self) -> QueueConfig:
        if self.default_priority > self.priority_levels:
            raise ValueError(
                f"default_priority {self.default_priority} is above priority_levels "
                f"{self.priority_levels}; accepted: 1..{self.priority_levels}"
            )
        return self


class BatchPolicy(_Strict):
    """Dynamic batching: a batch goes when full, or max_delay_ms after its first arrival."""

    max_size: int = Field(8, ge=1, le=4096)
    max_delay_ms: float = Field(5.0, ge=0, le=60_000)

    @cached_property  # read for every batch formed: computed once
    def max_delay_s(self) -> float:
        return self.max_delay_ms / 1000.0


class MemoryConfig(_Strict):
    """A model's memory budget and optional declared costs (they override the plugin's estimate)."""

    budget: ByteSize | None = Field(None, description="weights + running batches; none = device budget")
    weights: ByteSize | None = None
    per_item: ByteSize | None = None
    fixed: ByteSize | None = None
    profile: bool = Field(True, description="profile peak memory at warm-up on CUDA")


class ExecutionConfig(_Strict):
    timeout_ms: int = Field(60_000, ge=1, description="limit on one batch's run, separate from deadlines")


class WarmupConfig(_Strict):
    enabled: bool = True
    batch_sizes: list[int] | None = Field(None, description="default: 1 and batch.max_size")

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(size < 1 for size in value):
            raise ValueError(f"batch sizes must be >= 1, got {value}")
        return value


class DeviceConfig(_Strict):
    """A device and its shared memory budget."""

    memory_budget: ByteSize | None = Field(None, description="absolute budget; overrides memory_fraction")
    memory_fraction: float = Field(0.9, gt=0, le=1, description="budget as a fraction of total memory")
    high_watermark: float = Field(0.9, gt=0, le=1, description="pause batch admission above this share of budget")
    low_watermark: float = Field(0.8, gt=0, le=1, description="resume batch admission below this share")
    probe: Literal["auto", "nvml", "host", "process", "none"] = "auto"
    poll_interval_ms: float = Field(20.0, gt=0, description="probe re-read interval while work waits")
    max_concurrent_loads: int = Field(1, ge=1, le=64, description="model loads running at once on the device")
    max_concurrent_batches: int | None = Field(
        None, ge=1, le=1024, description="batches running at once on the device; default 1 on cpu, no limit on cuda"
    )

    def concurrent_batch_limit(self, device: str) -> int | None:
        """The limit in force on `device`: the setting, else 1 on the CPU (a batch already uses
        every core through torch's threads) and none on a GPU."""
        if self.max_concurrent_batches is not None:
            return self.max_concurrent_batches
        return 1 if device == "cpu" else None

    @model_validator(mode="after")
    def _watermarks_ordered(self) -> DeviceConfig:
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"low_watermark {self.low_watermark} is above high_watermark {self.high_watermark}; "
                "accepted: low_watermark <= high_watermark"
            )
        return self


class ModelConfig(_Strict):
    """One served model."""

    plugin: str = Field(min_length=1)
    device: str | None = Field(None, description="shorthand for devices: [device]")
    devices: list[str] | None = Field(None, max_length=MAX_INSTANCES,
                                      description="one instance per entry, all on the model's queue")
    options: dict[str, Any] = Field(default_factory=dict)
    queue: QueueConfig = QueueConfig()
    batch: BatchPolicy = BatchPolicy()
    memory: MemoryConfig = MemoryConfig()
    execution: ExecutionConfig = ExecutionConfig()
    warmup: WarmupConfig = WarmupConfig()
    weight: float = Field(1.0, gt=0, description="fair-share weight among models on a device")
    required: bool | None = Field(None, description="readiness waits for this model; default: residency is always")
    residency: Literal["always", "on_demand"] = Field(
        "always", description="always: loaded at start, never evicted; on_demand: loaded by its first request, evictable"
    )
    idle_unload_s: float | None = Field(None, gt=0, description="unload after this long unused (on_demand models)")
    load_timeout_ms: int = Field(300_000, ge=1, description="a load that takes longer fails")
    isolation: Literal["thread", "process"] = Field(
        "thread", description="process: each instance runs in a child process, ended on unload"
    )

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str | None) -> str | None:
        if value is not None:
            check_device_name(value)
        return value

    @field_validator("devices")
    @classmethod
    def _device_names(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            if not value:
                raise ValueError("devices is empty; list at least one, like [cpu] or [cuda:0, cuda:1]")
            for device in value:
                check_device_name(device)
        return value

    @model_validator(mode="after")
    def _one_device_form(self) -> ModelConfig:
        if self.device is not None and self.devices is not None:
            raise ValueError("give either device or devices, not both")
        return self

    @model_validator(mode="after")
    def _residency_keys(self) -> ModelConfig:
        if self.idle_unload_s is not None and self.residency == "always":
            raise ValueError("idle_unload_s needs residency: on_demand (an always-resident model is never unloaded)")
        if self.required and self.residency == "on_demand":
            raise ValueError("an on_demand model cannot be required: readiness cannot wait for a model that loads "
                             "on its first request")
        return self

    @property
    def is_required(self) -> bool:
        """Readiness waits for this model (the default for always-resident models)."""
        return self.required if self.required is not None else self.residency == "always"

    @property
    def instance_devices(self) -> list[str]:
        """The device of each instance, in order."""
        if self.devices:
            return list(self.devices)
        return [self.device or "cpu"]


class _Bounds(_Strict):
    min: int
    max: int

    @model_validator(mode="after")
    def _ordered(self) -> _Bounds:
        if self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}; accepted: min <= max")
        return self


class ReplicaBounds(_Bounds):
    """How many device replicas of one node type Ray runs: fixed when min = max, else autoscaled."""

    min: int = Field(1, ge=0, le=10_000)
    max: int = Field(1, ge=1, le=10_000)


class NodeTypeConfig(_Strict):
    """One kind of device replica: what device it drives and what Ray reserves for it."""

    device: Literal["cuda", "cpu"] = Field("cuda", description="cuda: one GPU per replica (cuda:0 inside it); cpu")
    num_gpus: float = Field(1.0, ge=0, le=64, description="Ray GPUs per replica; a fraction shares a GPU")
    num_cpus: float = Field(1.0, ge=0, le=1024, description="Ray CPUs per replica")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per replica")
    replicas: ReplicaBounds = ReplicaBounds()
    memory_budget: ByteSize | None = Field(None, description="each replica's device budget (default: devices.<device>)")
    max_ongoing_requests: int = Field(256, ge=1, le=100_000, description="requests Ray sends a replica at once")
    models: list[str] | None = Field(None, description="the models it may serve (default: all)")

    @model_validator(mode="after")
    def _gpu_for_cuda(self) -> NodeTypeConfig:
        if self.device == "cuda" and self.num_gpus == 0:
            raise ValueError("device cuda needs num_gpus > 0 (a whole GPU: 1, or a share like 0.5)")
        if self.device == "cpu" and self.num_gpus != 0:
            raise ValueError(f"device cpu takes num_gpus: 0, got {self.num_gpus}")
        return self


class CopiesConfig(_Bounds):
    """How many replicas hold a model: min always resident, up to max while it is busy."""

    min: int = Field(0, ge=0, le=10_000, description="copies kept resident (0: loaded on demand)")
    max: int = Field(1, ge=1, le=10_000, description="copies a busy model may gain")


class AutoscalingConfig(_Strict):
    """Ray's replica autoscaler, and when a model gains or loses a copy."""

    target_ongoing_requests: float = Field(32.0, gt=0, description="per replica: Ray adds replicas above this")
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    metrics_interval_s: float = Field(1.0, gt=0, description="how often replicas report their load to Ray")
    copy_target_in_flight: float = Field(16.0, gt=0, description="per copy: a model gains a copy above this")
    copy_idle_s: float = Field(60.0, gt=0, description="an extra copy unused this long is released")


class FrontConfig(_Strict):
    """The HTTP front: our app in its own Ray replica, calling device replicas through deployment handles."""

    host: str = "0.0.0.0"
    port: int = Field(8000, ge=1, le=65535)
    replicas: int = Field(1, ge=1, le=1000, description="front replicas, at most one per node")
    num_cpus: float = Field(1.0, ge=0, le=1024)
    resources: dict[str, float] = Field(default_factory=dict)


class ClusterConfig(_Strict):
    """Scale-out on a Ray cluster: one router replica per device, placed and restarted by Ray Serve."""

    app_name: str = Field("model-router", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    node_types: dict[str, NodeTypeConfig] = Field(default_factory=lambda: {"gpu": NodeTypeConfig()})
    copies: CopiesConfig = CopiesConfig()
    models: dict[str, CopiesConfig] = Field(default_factory=dict, description="per-model copies")
    autoscaling: AutoscalingConfig = AutoscalingConfig()
    front: FrontConfig = FrontConfig()
    stats_period_s: float = Field(0.5, gt=0, le=60, description="how often replicas report to the routers")

    @field_validator("node_types")
    @classmethod
    def _some_node_type(cls, value: dict[str, NodeTypeConfig]) -> dict[str, NodeTypeConfig]:
        if not value:
            raise ValueError("node_types is empty; add one, like {gpu: {device: cuda, num_gpus: 1}}")
        for name in value:
            if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,31}", name):
                raise ValueError(f"node type name {name!r} is not valid; accepted: lower-case letters, digits, '-'")
        return value

    def copies_of(self, model: str) -> CopiesConfig:
        return self.models.get(model, self.copies)


class FleetConfig(_Strict):
    """The whole fleet file."""

    model_store: Path = Field(Path("model_store"), description="relative to the fleet file's folder")
    allow_absolute_paths: bool = False
    devices: dict[str, DeviceConfig] = Field(default_factory=dict)
    models: dict[str, ModelConfig]
    pipelines: dict[str, PipelineConfig] = Field(default_factory=dict, description="models chained in one request")
    cluster: ClusterConfig | None = Field(None, description="scale-out on Ray Serve (model-router cluster deploy)")
    routes: dict[str, RouteConfig] = Field(default_factory=dict, description=(
        "the names of models with versions: their versions (each served as the model name@version), stable "
        "version, split, mirror and rollout; made from each model's versions: when the file is read"))

    @field_validator("devices")
    @classmethod
    def _device_names(cls, value: dict[str, DeviceConfig]) -> dict[str, DeviceConfig]:
        for name in value:
            check_device_name(name)
        return value

    @field_validator("models")
    @classmethod
    def _model_names(cls, value: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        if not value:
            raise ValueError("the fleet has no models; add at least one under 'models'")
        _check_names([name.partition(SEPARATOR)[0] for name in value], "model")
        for name in value:
            if SEPARATOR in name and (problem := version_name_problem(name.partition(SEPARATOR)[2])):
                raise ValueError(f"model {name!r}: {problem}")
        return value

    @field_validator("pipelines")
    @classmethod
    def _pipeline_names(cls, value: dict[str, PipelineConfig]) -> dict[str, PipelineConfig]:
        _check_names(value, "pipeline")
        return value

    @model_validator(mode="after")
    def _declare_used_devices(self) -> FleetConfig:
        """Devices that models use but the file does not list get default settings."""
        devices = dict(self.devices)
        for model in self.models.values():
            for device in model.instance_devices:
                devices.setdefault(device, DeviceConfig())
        object.__setattr__(self, "devices", devices)
        return self

    @model_validator(mode="after")
    def _cluster_names_models(self) -> FleetConfig:
        """The cluster section may only name models of the fleet."""
        if self.cluster is None:
            return self
        named = [("cluster.models", name) for name in self.cluster.models]
        for type_name, node_type in self.cluster.node_types.items():
            named += [(f"cluster.node_types.{type_name}.models", name) for name in node_type.models or []]
        for key, name in named:
            if name not in self.models:
                raise ValueError(f"{key}: no model named {name!r}; models: {', '.join(sorted(self.models))}")
        return self

    @model_validator(mode="after")
    def _routes_name_their_versions(self) -> FleetConfig:
        """A routed name is no model's and no pipeline's name, and each of its versions is a model."""
        _check_names(self.routes, "model")
        for name, route in self.routes.items():
            if name in self.models or name in self.pipelines:
                what = "model" if name in self.models else "pipeline"
                raise ValueError(f"{what}s.{name}: a {what} is named {name!r} too, and {name!r} is a model with "
                                 "versions; models and pipelines share one name: rename one")
            missing = [v for v in route.versions if f"{name}{SEPARATOR}{v}" not in self.models]
            if missing:
                raise ValueError(f"routes.{name}: no model for version(s) {', '.join(missing)} "
                                 f"(each version is the model {name}{SEPARATOR}<version>)")
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _expand_versions(cls, data: Any, handler: Any) -> FleetConfig:
        """Models with versions become one model per version and a route (router.version_config);
        problems are reported under the keys the file wrote. Defined last: it wraps every check above."""
        expansion = expand_versions(data)
        if not expansion.sections and not expansion.errors:
            return handler(data)  # type: ignore[no-any-return]
        try:
            fleet = handler(expansion.data)
        except ValidationError as exc:
            raise expansion.translate(exc, cls, _accepted_keys) from None
        if expansion.errors:
            raise expansion.translate(None, cls, _accepted_keys)
        return fleet  # type: ignore[no-any-return]


def _check_names(names: Iterable[str], what: str) -> None:
    for name in names:
        if not re.fullmatch(MODEL_NAME_PATTERN, name):
            raise ValueError(
                f"{what} name {name!r} is not valid; accepted: letters, digits, '_', '.', '-', "
                "starting with a letter or digit, at most 64 characters"
            )


def validation_problems(
    error: ValidationError, source: str, schema: type[BaseModel] | None = None, *, prefix: str = "",
    key_names: dict[str, str] | None = None,
) -> list[str]:
    """One line per problem: `file: key.path: message (got value)`. With the schema, an unknown
    key's message lists the accepted keys. Values are shown briefly, and never under a key that
    looks like it holds a secret. `key_names` renames top-level keys (settings: their variables)."""
    lines = []
    for item in error.errors():
        parts = [str(part) for part in item["loc"]]
        if parts and key_names:
            parts[0] = key_names.get(parts[0], parts[0])
        location = prefix + (".".join(parts) or "(top level)")
        message = clip(item["msg"].removeprefix("Value error, "))
        if item["type"] == "extra_forbidden" and schema is not None:
            accepted = _accepted_keys(schema, item["loc"][:-1])
            if accepted:
                message = f"unknown key; accepted: {', '.join(accepted)}"
        got = item.get("input")
        if isinstance(got, dict) or item["type"] == "missing":
            shown = ""
        elif any(SECRET_LOOKING.search(part) for part in parts):
            shown = " (value not shown: the key may hold a secret)"
        else:
            shown = f" (got {brief(got)})"
        lines.append(f"{source}: {location}: {message}{shown}")
    return lines


def config_error(source: str, problems: list[str]) -> ConfigError:
    """One problem reads as one line; several get a header line, then one indented line each."""
    if len(problems) == 1:
        return ConfigError(problems[0])
    return ConfigError("\n".join([f"{source}: invalid configuration ({len(problems)} problem(s))",
                                  *(f"  {line}" for line in problems)]))


def format_validation_error(error: ValidationError, source: str, schema: type[BaseModel] | None = None) -> str:
    """A header line, then one indented line per problem (see `validation_problems`)."""
    lines = validation_problems(error, source, schema)
    return "\n".join([f"{source}: invalid configuration ({len(lines)} problem(s))", *(f"  {line}" for line in lines)])


def _accepted_keys(schema: type[BaseModel], path: tuple[int | str, ...]) -> list[str]:
    """Field names of the model found by following `path` from `schema` (through dict values and list items)."""
    current: Any = schema
    for part in path:
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(part))
            if field is None:
                return []
            current = field.annotation
        elif get_origin(current) is dict:
            current = get_args(current)[1]
        elif get_origin(current) is list:
            current = get_args(current)[0]
        else:
            return []
        if get_origin(current) in (Union, UnionType):
            current = next((a for a in get_args(current) if a is not type(None)), None)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def load_fleet(path: str | Path) -> FleetConfig:
    """Read and validate a fleet file. Raises ConfigError with a readable message."""
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read fleet file: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x})") from None
    try:
        data = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"{source}: nests mappings and lists more than {MAX_CONFIG_DEPTH} levels deep") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{source}: not valid YAML: {clip(str(exc.problem or exc.context), 120)}{where}") from None
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: an integer too long to convert
        raise ConfigError(f"{source}: not valid YAML: {clip(str(exc), 120)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with 'models' at the top, got {type(data).__name__}")
    if nesting_exceeds(data, MAX_CONFIG_DEPTH):
        raise ConfigError(f"{source}: nests mappings and lists more than {MAX_CONFIG_DEPTH} levels deep")
    if secrets := sorted(key for key in map(str, data) if SECRET_LOOKING.search(key)):
        key = secrets[0] if secrets[0] in SECRET_KEYS else "api_keys"
        raise ConfigError(
            f"{source}: {clip(secrets[0], 40)}: API keys never go in the fleet file; set "
            f"MODEL_ROUTER_{key.upper()} or MODEL_ROUTER_{key.upper()}_FILE (a secret file, one key a line)"
        )
    if problems := _written_routes(data, str(source)):
        raise config_error(str(source), problems)
    try:
        fleet = FleetConfig.model_validate(data)
    except ValidationError as exc:
        raise config_error(str(source), validation_problems(exc, str(source), FleetConfig)) from None
    if not fleet.model_store.is_absolute():
        store = (source.parent / fleet.model_store).resolve()
        fleet = fleet.model_copy(update={"model_store": store})
    return fleet


def _written_routes(data: dict[str, Any], source: str) -> list[str]:
    """A fleet file gives a model's versions in its section: `routes` and `name@version` models are
    what the router makes of them, never written by hand (so no model of the file is named like a version)."""
    hint = "give the model versions: (docs/configuration.md, \"Versions and traffic splits\")"
    problems = [f"{source}: routes: not a fleet-file key; {hint}"] if "routes" in data else []
    models = data.get("models")
    if isinstance(models, dict):
        problems += [f"{source}: models.{clip(str(name), 80)}: '{SEPARATOR}' separates a name from its version and is "
                     f"not accepted in a model's name; {hint}" for name in models if SEPARATOR in str(name)]
    return problems


def nesting_exceeds(value: Any, limit: int) -> bool:
    """Whether a parsed YAML or JSON value nests mappings and lists more than `limit` deep. Each
    container is visited once, so a YAML alias bomb (one list referenced a billion times over) is
    measured in the size of its text, without recursion."""
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)) or id(node) in seen:
            continue
        if depth > limit:
            return True
        seen.add(id(node))
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


class ServerSettings(BaseSettings):
    """Process settings, from MODEL_ROUTER_* environment variables."""

    model_config = SettingsConfigDict(env_prefix="MODEL_ROUTER_", extra="ignore")

    config: Path = Path("config/fleet.yaml")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    grpc_port: int = Field(8001, ge=0, le=65535, description="the Open Inference Protocol over gRPC; 0 turns it off")
    grpc_stream_frames: int = Field(16, ge=1, le=4096, description="frames of one gRPC stream unanswered at once; "
                                                                     "past that the stream is not read (back-pressure)")
    grpc_keyless_streams: int = Field(256, ge=1, le=1_000_000, description=(
        "open gRPC streams without an inference key (health Watch; ModelStreamInfer on a server without keys), all "
        "connections together (at most a quarter of max_connections); more are RESOURCE_EXHAUSTED"))
    grpc_keyless_streams_per_connection: int = Field(16, ge=1, le=1_000_000,
                                                     description="the same, on one connection")
    grpc_keyless_awaited: int = Field(256, ge=1, le=1_000_000, description=(
        "gRPC calls without an inference key waiting for their request message (at most a quarter of "
        "max_connections); one more ends the longest-waiting one with RESOURCE_EXHAUSTED"))
    shared_memory: Literal["loopback", "any", "off"] = Field(
        "loopback", description="who may use V2 system shared memory: clients on this host, any client, or none")
    shared_memory_register: Literal["admin", "inference"] = Field(
        "admin", description="with keys set, which keys may register shared memory regions: admin keys, or inference keys too")
    shared_memory_prefix: str = Field("", max_length=200, pattern=r"^[!-.0-~]*$",
                                      description="every shared memory object's name must start with this (no '/')")
    shared_memory_owner_uid: Literal["server", "any"] | int = Field(
        "server", description="the uid that must own a shared memory object: the server's own, any, or this uid")
    proxy_headers: bool = Field(False, description="take the client's address from X-Forwarded-For when the "
                                                   "connection comes from forwarded_allow_ips (behind a proxy)")
    forwarded_allow_ips: str = Field("127.0.0.1", min_length=1,
                                     description="comma-separated proxy addresses (or networks) trusted for X-Forwarded-For")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "text"] = Field("auto", description="auto: text on a terminal, else JSON lines")
    max_body_bytes: int = Field(20 * 1024 * 1024, ge=1024)
    drain_timeout_s: float = Field(30.0, ge=0)
    # A split host's watchdog over its engine (router.host.board: the engine publishes every 100 ms at least).
    engine_stale_s: float = Field(3.0, gt=0, le=3600, description="a split host's fronts take an engine silent this "
                                  "long as hung: every request 503, not ready, until it publishes again")
    engine_hang_s: float = Field(30.0, ge=0, le=86400, description="the parent kills and restarts an engine silent "
                                 "this long, as a liveness probe would; 0: never")
    cpu_workers: int = Field(0, ge=0, le=1024, description="preprocessing threads; 0 = number of CPU cores")
    torch_threads: int = Field(0, ge=0, le=1024, description="torch intra-op threads; 0 = number of CPU cores")
    api_keys: str | None = Field(None, description="comma-separated bearer keys for inference routes")
    api_keys_file: Path | None = Field(None, description="a file with one inference key a line")
    admin_keys: str | None = Field(None, description="comma-separated bearer keys for state-changing routes")
    admin_keys_file: Path | None = None
    protect_health: bool = Field(False, description="require a key for /health/* too")
    protect_metrics: bool = Field(False, description="require a key for /metrics too")
    # What one client can make the server hold or wait for (see router.http.protocol).
    max_header_bytes: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024,
                                  description="request line and headers together; more is refused with 431")
    max_headers: int = Field(100, ge=8, le=10_000, description="header fields in one request; more is refused with 431")
    header_timeout_s: float = Field(10.0, gt=0, le=3600, description="time to send a request's headers")
    body_timeout_s: float = Field(60.0, gt=0, le=3600, description="time to send a request's body after its headers")
    keep_alive_s: int = Field(5, ge=1, le=3600, description="an idle keep-alive connection is closed after this")
    max_connections: int = Field(1024, ge=1, description="open connections (over it the longest-idle one is closed) "
                                 "and running requests (more get 503; liveness is always answered)")
    max_items: int = Field(1024, ge=1, description="items in one V2 request (also at most the model's queue size)")
    trim_memory: bool = Field(True, description="hand freed heap memory back to the system after large bodies")
    workers: int | Literal["auto"] = Field(
        "auto", description="front processes: 1 is one process with no IPC; N > 1 runs N HTTP fronts and one engine; "
                            "auto: one per core, at most 16, and 1 on 2 cores or fewer")

    @field_validator("workers")
    @classmethod
    def _some_workers(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= 256:
            raise ValueError(f"workers must be from 1 to 256 or auto, got {value}")
        return value

    @field_validator("shared_memory_owner_uid", mode="before")
    @classmethod
    def _a_uid(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().isdigit():
            return int(value)
        if value in ("server", "any") or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        raise ValueError("must be server, any or a uid (an integer >= 0)")

    def front_count(self, cores: int) -> int:
        """How many front processes serve (1: the single process)."""
        return resolve_workers(self.workers, cores)

    @model_validator(mode="after")
    def _ports_differ(self) -> ServerSettings:
        if self.grpc_port and self.grpc_port == self.port:
            raise ValueError(f"grpc_port {self.grpc_port} is the HTTP port too; give gRPC another port, or 0 to turn it off")
        return self

    @model_validator(mode="after")
    def _hang_after_stale(self) -> ServerSettings:
        if self.engine_hang_s and self.engine_hang_s <= self.engine_stale_s:
            raise ValueError(f"engine_hang_s {self.engine_hang_s} must be longer than engine_stale_s "
                             f"{self.engine_stale_s} (the fronts stop trusting the engine first), or 0 to never restart it")
        return self


#: `workers: auto` gives each core a front, up to this many (the engine's loop carries the rest).
MAX_AUTO_WORKERS = 16
#: ... on hosts with more cores than this: on 2 cores the fronts take cores from a model that runs
#: on the CPU, while a device-bound model gains from them (docs/architecture-processes.md, "Measured").
SINGLE_PROCESS_UP_TO_CORES = 2


def resolve_workers(setting: int | str, cores: int) -> int:
    """The number of front processes for a `workers` setting on a host with `cores` cores."""
    if isinstance(setting, int):
        return setting
    if cores <= SINGLE_PROCESS_UP_TO_CORES:
        return 1
    return min(cores, MAX_AUTO_WORKERS)


def load_settings(**overrides: Any) -> ServerSettings:
    """The settings from the environment (and command-line overrides); ConfigError, one line per
    problem naming the variable, when a value is bad."""
    names = {name: f"MODEL_ROUTER_{name.upper()}" for name in ServerSettings.model_fields if name not in overrides}
    problems = _unknown_variables(set(names.values()) | {f"MODEL_ROUTER_{name.upper()}" for name in overrides})
    try:
        settings = ServerSettings(**overrides)
    except ValidationError as exc:
        problems += validation_problems(exc, "environment", key_names=names)
    if problems:
        raise config_error("environment", problems)
    return settings


def _unknown_variables(known: set[str]) -> list[str]:
    """A misspelt variable is refused rather than ignored: MODEL_ROUTER_API_KEY (no S) must not
    leave the server open."""
    problems = []
    for variable in sorted(os.environ):
        if variable.startswith("MODEL_ROUTER_") and variable not in known:
            close = difflib.get_close_matches(variable, sorted(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; settings: {', '.join(sorted(known))}"
            problems.append(f"environment: {clip(variable, 80)}: not a setting{hint}")
    return problems
