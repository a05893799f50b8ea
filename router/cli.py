"""The `model-router` command: serve, check, plugins, store, export."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from pathlib import Path

from router.config import ServerSettings, load_fleet, load_settings
from router.errors import ConfigError
from router.http.auth import AccessPolicy, read_keys
from router.serving.plan import FleetPlan, resolve_fleet
from router.serving.registry import PluginRegistry

__all__ = ["build_plan", "main"]

log = logging.getLogger("router.cli")


def build_plan(config_path: Path, registry: PluginRegistry | None = None) -> FleetPlan:
    """Parse and resolve a fleet file; raises ConfigError naming file, key, value and what is accepted."""
    fleet = load_fleet(config_path)
    if registry is None:
        registry = PluginRegistry.from_entry_points(only={model.plugin for model in fleet.models.values()})
    return resolve_fleet(fleet, registry, str(config_path))


def prepare(args: argparse.Namespace) -> tuple[ServerSettings, FleetPlan, AccessPolicy]:
    """Every validation that comes before the port opens, shared by `serve` and `check`: the
    settings, the fleet and its plugins' options and paths, the keys. Raises ConfigError."""
    overrides = {k: v for k in ("config", "host", "port") if (v := getattr(args, k, None)) is not None}
    settings = load_settings(**overrides)
    plan = build_plan(settings.config)
    return settings, plan, access_policy(settings)


def _refuse(exc: ConfigError) -> int:
    print(f"model-router: {exc}", file=sys.stderr)
    return 2


def cmd_serve(args: argparse.Namespace) -> int:
    from router.http.app import create_app
    from router.http.server import run_server
    from router.logs import configure_logging
    from router.serving.runtime import Runtime

    try:
        settings, plan, policy = prepare(args)
    except ConfigError as exc:
        return _refuse(exc)
    configure_logging(settings.log_level)
    runtime = Runtime(plan, cpu_workers=settings.cpu_workers)
    app = create_app(runtime, max_body_bytes=settings.max_body_bytes, drain_timeout_s=settings.drain_timeout_s,
                     access_policy=policy, body_timeout_s=settings.body_timeout_s, max_items=settings.max_items,
                     trim_memory=settings.trim_memory)
    log.info(policy.describe())
    run_server(app, runtime, settings)
    return 0


def access_policy(settings: ServerSettings) -> AccessPolicy:
    policy = AccessPolicy(
        predict_keys=read_keys(settings.api_keys, settings.api_keys_file, "MODEL_ROUTER_API_KEYS"),
        admin_keys=read_keys(settings.admin_keys, settings.admin_keys_file, "MODEL_ROUTER_ADMIN_KEYS"),
        protect_health=settings.protect_health,
        protect_metrics=settings.protect_metrics,
    )
    policy.check_consistent()
    return policy


def cmd_check(args: argparse.Namespace) -> int:
    try:
        _, plan, _ = prepare(args)
    except ConfigError as exc:
        return _refuse(exc)
    print(json.dumps(plan.describe(), indent=2))
    print(f"model-router: {plan.source} is valid: {len(plan.models)} model(s) on "
          f"{len(plan.fleet.devices)} device(s)", file=sys.stderr)
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    registry = PluginRegistry.from_entry_points()
    for name in registry.names():
        info = registry.get(name)
        print(f"{name}\t{info.distribution or '-'} {info.version or ''}\t{info.cls.__module__}.{info.cls.__qualname__}")
    for name, reason in registry.broken.items():
        print(f"{name}\tBROKEN\t{reason}")
    return 0


def cmd_store_init_demo(args: argparse.Namespace) -> int:
    from router.store import DemoStoreError, init_demo

    try:
        paths = init_demo(Path(args.store), force=args.force)
    except DemoStoreError as exc:
        print(f"model-router: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(f"built {path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Export a fleet model to ONNX (and a TensorRT engine); the work lives in the onnx plugin package."""
    try:  # an optional plugin package: the core works without it
        exporter = importlib.import_module("model_router_onnx.export")
    except ImportError as exc:
        print(f"model-router: export needs the onnx plugin: pip install -e plugins/onnx (model-router-onnx); {exc}",
              file=sys.stderr)
        return 1
    try:
        plan = build_plan(args.config)
    except ConfigError as exc:
        return _refuse(exc)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        paths = exporter.export_model(plan, args.model, fmt=args.format, fp16=args.fp16, out=args.out, progress=progress)
    except exporter.ExportError as exc:
        print(f"model-router: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="model-router", description=__doc__)
    sub = root.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a fleet (settings also from MODEL_ROUTER_* env)")
    serve.add_argument("--config", type=Path, help="fleet YAML (env MODEL_ROUTER_CONFIG)")
    serve.add_argument("--host", help="bind address (env MODEL_ROUTER_HOST)")
    serve.add_argument("--port", type=int, help="port (env MODEL_ROUTER_PORT)")
    serve.set_defaults(func=cmd_serve)
    check = sub.add_parser("check", help="run every validation `serve` runs (fleet, plugin options and paths, "
                                         "MODEL_ROUTER_* settings, keys) and print the resolved plan")
    check.add_argument("--config", type=Path, help="fleet YAML (env MODEL_ROUTER_CONFIG)")
    check.set_defaults(func=cmd_check)
    plugins = sub.add_parser("plugins", help="list installed plugins")
    plugins.set_defaults(func=cmd_plugins)
    store = sub.add_parser("store", help="model store tasks")
    store_sub = store.add_subparsers(dest="store_command", required=True)
    demo = store_sub.add_parser("init-demo", help="build the demo weights (untrained) into the model store")
    demo.add_argument("--store", default="model_store")
    demo.add_argument("--force", action="store_true", help="rebuild files that exist")
    demo.set_defaults(func=cmd_store_init_demo)
    export = sub.add_parser("export", help="export a fleet model to ONNX, and to TensorRT where available")
    export.add_argument("--config", type=Path, default=Path(os.environ.get("MODEL_ROUTER_CONFIG", "config/fleet.yaml")))
    export.add_argument("--model", required=True, help="a model of the fleet (plugin yolo or resnet)")
    export.add_argument("--format", choices=("auto", "onnx", "tensorrt"), default="auto",
                        help="auto: ONNX, plus an engine where TensorRT and a GPU are present")
    export.add_argument("--fp16", action="store_true", help="build the TensorRT engine with fp16 kernels")
    export.add_argument("--out", type=Path, help="ONNX path (default: MODEL_STORE/MODEL.onnx); the engine goes beside it")
    export.set_defaults(func=cmd_export)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    code: int = args.func(args)
    return code
