"""A front process of a split host, started by the parent (`router.host.supervisor`):

    python -m router.host.front_main --index I --socket PATH --parent PID --settings PATH

The same Litestar app and connection layer as `model-router serve` with one process, over an
`EngineClient` instead of a `Runtime`, on its own SO_REUSEPORT listening socket of the host's port,
with the settings the parent resolved (`router.host.handover`).
"""

from __future__ import annotations

import argparse
import math
import signal
import socket
import sys
from pathlib import Path

from router.config import ServerSettings
from router.errors import ConfigError
from router.grpc.server import grpc_server
from router.host.client import EngineClient
from router.host.handover import ListeningFronts, read_settings
from router.host.titles import die_with_parent, set_title
from router.http.app import Listener, create_app
from router.http.auth import policy_from_settings
from router.http.server import run_server
from router.inference_protocol.shared_memory import SharedMemoryRegistry
from router.logs import configure_logging
from router.pipelines import PipelineRunner
from router.serving.facade import Serving
from router.serving.threads import available_cores, settle_collector
from router.tracing import tracing_from_environment

__all__ = ["listening_socket", "main"]


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening socket on `host:port` that shares the port with the other fronts (SO_REUSEPORT):
    the kernel spreads new connections over them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(False)
    return sock


def front_cpu_workers(settings: ServerSettings, workers: int) -> int:
    """Each front's share of the cores for preprocessing (the setting divided among the fronts)."""
    cores = settings.cpu_workers or available_cores()
    return max(1, math.ceil(cores / workers))


class ListeningMark:
    """The last of a front's listeners: its start marks the front listening (its HTTP socket
    listens before the app starts, its gRPC server has started)."""

    def __init__(self, fronts: ListeningFronts, front: int) -> None:
        self.fronts, self.front = fronts, front

    async def start(self) -> None:
        self.fronts.mark(self.front)

    async def stop(self) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--settings", type=Path, required=True)
    args = parser.parse_args(argv)
    die_with_parent(args.parent)
    set_title(f"front {args.index}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent orchestrates a stop
    try:
        settings = read_settings(args.settings)
        workers = settings.front_count(available_cores())  # the parent's count
        policy = policy_from_settings(settings)
        tracing = tracing_from_environment()  # each process exports its own spans; a request's trace joins them
    except ConfigError as exc:
        print(f"model-router front {args.index}: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format, role=f"front {args.index}")
    settle_collector()
    client = EngineClient(args.socket, args.index, cpu_workers=front_cpu_workers(settings, workers),
                          stale_after_s=settings.engine_stale_s)
    # V2 system shared memory: one table of registrations for every front (the run directory's)
    shared_memory = SharedMemoryRegistry.from_settings(settings, table=args.socket.parent / "regions")
    serving = Serving(client)
    pipelines = PipelineRunner(serving)  # one runner for this front's HTTP app and its gRPC listener
    listeners: list[Listener] = []
    if settings.grpc_port:  # every front serves gRPC too, on the same port (grpc.so_reuseport)
        listeners.append(grpc_server(serving, settings, policy, shared_memory, pipelines, tracing, reuse_port=True))
    fronts = ListeningFronts(args.socket.parent / "listening", workers)
    listeners.append(ListeningMark(fronts, args.index))  # last: once the gRPC server listens
    client.listening = fronts.all_listening  # ready (HTTP and gRPC) once every front listens
    app = create_app(serving, max_body_bytes=settings.max_body_bytes, drain_timeout_s=settings.drain_timeout_s,
                     access_policy=policy, body_timeout_s=settings.body_timeout_s, max_items=settings.max_items,
                     trim_memory=settings.trim_memory, shared_memory=shared_memory, listeners=listeners,
                     tracing=tracing, pipelines=pipelines)
    client.request_counts = app.state.metrics.request_counts  # /models shows every front's counts
    pipelines.counts = app.state.metrics.pipeline_counts  # and every front's pipeline counts
    sock = listening_socket(settings.host, settings.port)
    run_server(app, serving, settings, sockets=[sock],
               max_connections=max(1, math.ceil(settings.max_connections / workers)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
