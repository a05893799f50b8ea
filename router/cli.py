"""The `model-router` command: serve, check, plugins, store, export."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from router.access import AccessPolicy, policy_from_settings
from router.config import ServerSettings, config_error, load_settings
from router.errors import ConfigError

if TYPE_CHECKING:
    from router.serving.plan import FleetPlan

# What serves, plugins and the web framework are imported by the subcommands that use them: the
# parent of a split host runs this module and supervises, and imports none of them.

__all__ = ["main"]

log = logging.getLogger("router.cli")

MISSING_FILES_HINT = ("model-router: put the files in the model store, or build the demo weights (yolov8n.pt, resnet18.pt) "
                      "with `model-router store init-demo --store DIR`")


def prepare(args: argparse.Namespace) -> tuple[ServerSettings, FleetPlan, AccessPolicy]:
    """Every validation that comes before the port opens, shared by `serve` and `check`: the
    settings, the fleet and its plugins' options and paths, the keys. Raises ConfigError."""
    from router.serving.plan import load_plan

    settings = settings_from(args)
    plan = load_plan(settings.config)
    return settings, plan, access_policy(settings)


def settings_from(args: argparse.Namespace) -> ServerSettings:
    """The settings, with the command's flags over the environment. Raises ConfigError."""
    overrides = {k: v for k in ("config", "host", "port", "grpc_port", "workers") if (v := getattr(args, k, None)) is not None}
    return load_settings(**overrides)


def _refuse(exc: ConfigError) -> int:
    print(f"model-router: {exc}", file=sys.stderr)
    return 2


def cmd_serve(args: argparse.Namespace) -> int:
    from router.logs import configure_logging
    from router.serving.threads import available_cores

    try:
        settings = settings_from(args)
        policy = access_policy(settings)
    except ConfigError as exc:
        return _refuse(exc)
    workers = settings.front_count(available_cores())
    if workers > 1:  # N front processes and one engine (router.host): docs/architecture-processes.md
        from router.host.supervisor import Supervisor

        # The engine checks the fleet file (a bad one stops the host with status 2) and the
        # fronts the tracing settings: this process supervises and loads no plugin.
        configure_logging(settings.log_level, settings.log_format, role="parent")
        log.info(policy.describe())
        try:
            return Supervisor(settings, workers).run()
        except ConfigError as exc:  # a port another process has
            return _refuse(exc)
    return serve_one_process(args)


def serve_one_process(args: argparse.Namespace) -> int:
    from router.grpc.server import grpc_server
    from router.http.app import Listener, create_app
    from router.http.server import run_server
    from router.inference_protocol.shared_memory import SharedMemoryRegistry
    from router.logs import configure_logging
    from router.pipelines import PipelineRunner
    from router.serving.runtime import in_process
    from router.serving.threads import apply_threads, available_cores, count_threads, settle_collector
    from router.tracing import tracing_from_environment

    try:
        settings, plan, policy = prepare(args)
        tracing = tracing_from_environment()  # OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT turns it on
    except ConfigError as exc:
        return _refuse(exc)
    configure_logging(settings.log_level, settings.log_format)
    threads = count_threads(available_cores(), settings.cpu_workers, settings.torch_threads)
    apply_threads(threads)
    settle_collector()
    runtime = in_process(plan, cpu_workers=threads.cpu_workers, tracing=tracing)
    shared_memory = SharedMemoryRegistry.from_settings(settings)
    pipelines = PipelineRunner(runtime)  # one runner for every front of this process: HTTP and gRPC
    listeners: list[Listener] = []
    if settings.grpc_port:
        listeners.append(grpc_server(runtime, settings, policy, shared_memory, pipelines, tracing))
    app = create_app(runtime, max_body_bytes=settings.max_body_bytes, drain_timeout_s=settings.drain_timeout_s,
                     access_policy=policy, body_timeout_s=settings.body_timeout_s, max_items=settings.max_items,
                     trim_memory=settings.trim_memory, shared_memory=shared_memory, listeners=listeners, tracing=tracing,
                     pipelines=pipelines)
    log.info(policy.describe())
    log.info("tracing: %s", tracing.describe() if tracing is not None else "off (no OTEL_EXPORTER_OTLP_ENDPOINT)")
    run_server(app, runtime, settings)
    return 0


def access_policy(settings: ServerSettings) -> AccessPolicy:
    return policy_from_settings(settings)


def cmd_check(args: argparse.Namespace) -> int:
    from router.tracing import tracing_from_environment

    try:
        _, plan, _ = prepare(args)
        tracing = tracing_from_environment()
    except ConfigError as exc:
        return _refuse(exc)
    if tracing is not None:
        print(f"model-router: tracing: {tracing.describe()}", file=sys.stderr)
        tracing.shutdown()
    if missing := [line for model in plan.models.values() for line in model.missing_files(plan.source)]:
        print(f"model-router: {config_error(plan.source, missing)}\n{MISSING_FILES_HINT}", file=sys.stderr)
        return 2
    print(json.dumps(plan.describe(), indent=2))
    pipelines = f", {len(plan.pipelines)} pipeline(s)" if plan.pipelines else ""
    print(f"model-router: {plan.source} is valid: {len(plan.models)} model(s){pipelines} on "
          f"{len(plan.fleet.devices)} device(s)", file=sys.stderr)
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    """Every entry point the router reads: model plugins, transforms, exporters, demo files. Exit 1 if any is broken."""
    from router.exporting import installed_exporters
    from router.serving.registry import PluginRegistry
    from router.serving.transforms import TransformRegistry
    from router.store import demo_files

    registry = PluginRegistry.from_entry_points()
    for name in registry.names():
        info = registry.get(name)
        print(f"{name}\t{info.distribution or '-'} {info.version or ''}\t{info.cls.__module__}.{info.cls.__qualname__}")
    broken = dict(registry.broken)
    transforms = TransformRegistry.from_entry_points()
    for name in transforms.names():
        transform = transforms.get(name)
        if transform is not None:
            where = f"{transform.cls.__module__}.{transform.cls.__qualname__}"
            print(f"transform {name}\t{transform.distribution or '(built in)'}\t{where}")
    broken |= {f"transform {name}": reason for name, reason in transforms.broken.items()}
    exporters, demos = installed_exporters(), demo_files()
    for name, exporter in sorted(exporters.entries.items()):
        cls = type(exporter.target)
        print(f"exporter {name}\t{exporter.distribution or '-'} {exporter.version or ''}\t{cls.__module__}.{cls.__qualname__}")
    for name, demo in sorted(demos.entries.items()):
        print(f"demo file {name}\t{demo.distribution or '-'} {demo.version or ''}\t{demo.target.name}")
    broken |= {f"exporter {name}": reason for name, reason in exporters.broken.items()}
    broken |= {f"demo file {name}": reason for name, reason in demos.broken.items()}
    for name, reason in sorted(broken.items()):
        print(f"{name}\tBROKEN\t{reason}")
    if broken:
        print(f"model-router: {len(broken)} broken entry point(s): {', '.join(sorted(broken))}", file=sys.stderr)
        return 1
    return 0


def cmd_plugins_check(args: argparse.Namespace) -> int:
    """Run the plugin contract against one installed plugin; exit 1 naming the step it breaks."""
    import mimetypes

    from router.plugin_kit import ContractFailure, check_plugin
    from router.sdk import Payload

    try:
        options = json.loads(args.options)
    except json.JSONDecodeError as exc:
        print(f"model-router: --options is a JSON object, got {args.options!r} ({exc})", file=sys.stderr)
        return 2
    if not isinstance(options, dict):
        print(f"model-router: --options is a JSON object, got {args.options!r}", file=sys.stderr)
        return 2
    inputs = None
    if args.inputs:
        missing = [path for path in args.inputs if not path.is_file()]
        if missing:
            print(f"model-router: --input names no file: {', '.join(map(str, missing))}", file=sys.stderr)
            return 2
        inputs = [Payload(path.read_bytes(), mimetypes.guess_type(path.name)[0] or "application/octet-stream", path.name)
                  for path in args.inputs]
    try:
        report = check_plugin(args.name, options=options, inputs=inputs, store=args.store, device=args.device,
                              refuses=args.refuses)
    except ContractFailure as exc:
        print(f"model-router: {exc}", file=sys.stderr)
        return 1
    for line in report.steps:
        print(f"ok\t{line}")
    outcome = "refuses it as expected, naming the model" if report.refusal else "keeps the contract"
    print(f"model-router: plugin {args.name!r} on {args.device}: {outcome} ({len(report.steps)} checks)", file=sys.stderr)
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
    """Export a fleet model (or convert an exported file) with the exporters the plugins declare."""
    from router.exporting import export_steps, installed_exporters, run_export, source_model
    from router.sdk.exporter import ExportError
    from router.serving.plan import load_plan

    if args.model is None and args.from_file is None:
        print("model-router: export needs --model (a model of the fleet) or --from (an exported file)", file=sys.stderr)
        return 2
    try:
        steps = export_steps(installed_exporters(), args.format, from_file=args.from_file is not None)
    except ExportError as exc:
        print(f"model-router: {exc}", file=sys.stderr)
        return 1
    try:
        source = None if args.from_file is not None else source_model(load_plan(args.config), args.model)
    except ConfigError as exc:
        return _refuse(exc)
    except ExportError as exc:
        print(f"model-router: {exc}", file=sys.stderr)
        return 1

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    model = args.model or Path(args.from_file).stem
    try:
        paths = run_export(steps, model=model, source=source, input_file=args.from_file, out=args.out, fp16=args.fp16,
                           device=args.device, progress=progress)
    except ExportError as exc:
        print(f"model-router: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


def cmd_reload(args: argparse.Namespace) -> int:
    """Ask a running server to re-read its fleet file: SIGHUP to a process, or the admin route."""
    if args.pid is not None:
        os.kill(args.pid, signal.SIGHUP)
        print(f"sent SIGHUP to {args.pid}", file=sys.stderr)
        return 0
    import httpx

    key = os.environ.get("MODEL_ROUTER_ADMIN_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        reply = httpx.post(args.url.rstrip("/") + "/admin/reload", headers=headers, timeout=args.timeout)
    except httpx.HTTPError as exc:
        print(f"model-router: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    print(reply.text)
    return 0 if reply.status_code == 200 else 1


def cmd_cluster(args: argparse.Namespace) -> int:
    """Deploy a fleet onto a running Ray cluster, show it, or take it down (needs the ray extra: pip install -e '.[ray]')."""
    try:
        from router.cluster import commands
    except ImportError as exc:
        print(f"model-router: cluster needs Ray Serve, the ray extra: pip install -e '.[ray]' in a checkout, or "
              f"pip install --find-links dist 'vision-model-router[ray]' from built wheels ({exc})", file=sys.stderr)
        return 2
    try:
        if args.cluster_command == "deploy":
            commands.print_json(commands.deploy(args.config, args.address, ingress=args.ingress))
        elif args.cluster_command == "status":
            commands.print_json(commands.status(args.address, args.app))
        else:
            commands.shutdown(args.address, args.app)
            print(f"model-router: application {args.app!r} deleted", file=sys.stderr)
    except ConfigError as exc:
        print(f"model-router: {exc}", file=sys.stderr)
        return 2
    return 0


def _workers(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"workers is a number from 1 to 256 or auto, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="model-router", description=__doc__)
    sub = root.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a fleet (settings also from MODEL_ROUTER_* env)")
    serve.add_argument("--config", type=Path, help="fleet YAML (env MODEL_ROUTER_CONFIG)")
    serve.add_argument("--host", help="bind address (env MODEL_ROUTER_HOST)")
    serve.add_argument("--port", type=int, help="port (env MODEL_ROUTER_PORT)")
    serve.add_argument("--grpc-port", type=int, help="gRPC port, 0 to turn gRPC off (env MODEL_ROUTER_GRPC_PORT, default 8001)")
    serve.add_argument("--workers", type=_workers,
                       help="front processes: 1 (one process), N > 1 (N HTTP fronts and one engine) or auto "
                            "(env MODEL_ROUTER_WORKERS; default auto: a front per core, 1 on 2 cores or fewer)")
    serve.set_defaults(func=cmd_serve)
    check = sub.add_parser("check", help="run every validation `serve` runs (fleet, plugin options and paths, "
                                         "pipelines, MODEL_ROUTER_* settings, keys) and print the resolved plan")
    check.add_argument("--config", type=Path, help="fleet YAML (env MODEL_ROUTER_CONFIG)")
    check.set_defaults(func=cmd_check)
    reload = sub.add_parser("reload", help="make a running server re-read its fleet file and apply the difference")
    target = reload.add_mutually_exclusive_group()
    target.add_argument("--url", default="http://127.0.0.1:8000",
                        help="the server (POST /admin/reload; admin key from env MODEL_ROUTER_ADMIN_KEY)")
    target.add_argument("--pid", type=int, help="send SIGHUP to this process instead")
    reload.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the reload")
    reload.set_defaults(func=cmd_reload)
    plugins = sub.add_parser("plugins", help="list installed plugins, transforms, exporters and demo files "
                                             "(exit 1 if any is broken)")
    plugins.set_defaults(func=cmd_plugins)
    plugins_sub = plugins.add_subparsers(dest="plugins_command")
    check_one = plugins_sub.add_parser("check", help="run the plugin contract against one installed plugin "
                                                     "(docs/plugins.md, \"Check your plugin\"); exit 1 if it breaks it")
    check_one.add_argument("name", help="the plugin's entry-point name")
    check_one.add_argument("--options", default="{}", help="the model's options: as a JSON object (default {})")
    check_one.add_argument("--store", type=Path, default=Path("model_store"),
                           help="the model store the options name files in (default model_store)")
    check_one.add_argument("--input", dest="inputs", type=Path, action="append",
                           help="an input file, each different (repeat it); default: three generated photos if the "
                                "plugin accepts JPEG, else its example payload")
    check_one.add_argument("--device", default="cpu", help="the device to load on: cpu or cuda:N (default cpu)")
    check_one.add_argument("--refuses", action="store_true",
                           help="the plugin is expected to refuse the device, with an error naming the model")
    check_one.set_defaults(func=cmd_plugins_check)
    store = sub.add_parser("store", help="model store tasks")
    store_sub = store.add_subparsers(dest="store_command", required=True)
    demo = store_sub.add_parser("init-demo", help="build the demo weights (untrained) into the model store")
    demo.add_argument("--store", default="model_store")
    demo.add_argument("--force", action="store_true", help="rebuild files that exist")
    demo.set_defaults(func=cmd_store_init_demo)
    export = sub.add_parser("export", help="export a fleet model to ONNX, and to TensorRT where available")
    export.add_argument("--config", type=Path, default=Path(os.environ.get("MODEL_ROUTER_CONFIG", "config/fleet.yaml")))
    export.add_argument("--model", help="a model of the fleet (plugin yolo or resnet)")
    export.add_argument("--from", dest="from_file", type=Path,
                        help="build from this exported file instead of a fleet model, e.g. --from M.onnx --format tensorrt")
    export.add_argument("--format", default="auto",
                        help="an installed exporter's format (onnx, tensorrt) or auto: ONNX, plus an engine where "
                             "TensorRT and a GPU are present")
    export.add_argument("--fp16", action="store_true", help="build the TensorRT engine with fp16 kernels")
    export.add_argument("--device", default="cuda:0", help="the GPU an engine is built and checked on (default cuda:0)")
    export.add_argument("--out", type=Path, help="path of the first file written (default: MODEL_STORE/MODEL.onnx); "
                                                 "an engine goes beside the ONNX file")
    export.set_defaults(func=cmd_export)
    cluster = sub.add_parser("cluster", help="scale out on a Ray cluster: deploy, status, shutdown (the ray extra)")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    deploy = cluster_sub.add_parser("deploy", help="deploy a fleet file with a cluster: section onto Ray Serve")
    deploy.add_argument("--config", type=Path, default=Path(os.environ.get("MODEL_ROUTER_CONFIG", "config/fleet.yaml")))
    deploy.add_argument("--ingress", action="store_true",
                        help="serve HTTP through Ray Serve's proxy (serve.ingress) instead of the router's own front")
    for command in (deploy, cluster_sub.add_parser("status", help="the application, its replicas, where models are"),
                    cluster_sub.add_parser("shutdown", help="delete the application (replicas drain first)")):
        command.add_argument("--address", default="auto", help="the Ray cluster (default auto: the local node's)")
        if command is not deploy:
            command.add_argument("--app", default="model-router", help="the Serve application (cluster.app_name)")
        command.set_defaults(func=cmd_cluster)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    code: int = args.func(args)
    return code
