"""The engine process of a split host, started by the parent (`router.host.supervisor`):

    python -m router.host.engine_main --socket PATH --epoch N --parent PID --settings PATH [--board-fd FD]

It reads the settings the parent resolved (`router.host.handover`) and the fleet file, runs the
`Runtime` (queues, schedulers, residency, instances) and serves the fronts on the socket. SIGTERM
(from the parent, once the fronts have drained): answer what is left, unload, exit. SIGHUP:
re-read the fleet file. `--board-fd`: the board the parent created (it reads the heartbeat there,
`router.host.board`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections import Counter
from pathlib import Path

from router.errors import ConfigError, ShuttingDown
from router.host.engine import EngineServer
from router.host.handover import read_settings
from router.host.titles import die_with_parent, set_title
from router.http.metrics import RouterMetrics
from router.logs import configure_logging
from router.serving.plan import load_plan
from router.serving.runtime import Runtime
from router.serving.threads import apply_threads, available_cores, count_threads, settle_collector
from router.tracing import tracing_from_environment

__all__ = ["EngineEvents", "main"]

log = logging.getLogger("router.host.engine_main")
COUNTS_EVERY_S = 0.1


class EngineEvents:
    """The engine's share of the telemetry: batches, loads, evictions, waits for a load. Request
    outcomes, latencies and queue waits are the fronts' to count (they see every request)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def observe_request(self, model: str, outcome: str, seconds: float) -> None:
        pass

    def observe_queue_wait(self, model: str, seconds: float) -> None:
        pass

    def observe_answer(self, model: str, seconds: float, deadline_s: float) -> None:
        pass

    def observe_mirror(self, model: str, outcome: str) -> None:
        pass  # the fronts count mirrored copies, as they count requests

    def observe_batch(self, model: str, size: int, seconds: float) -> None:
        self.metrics.observe_batch(model, size, seconds)

    def observe_load(self, model: str, device: str, seconds: float, ok: bool) -> None:
        self.metrics.observe_load(model, device, seconds, ok)

    def observe_eviction(self, model: str, device: str, kind: str) -> None:
        self.metrics.observe_eviction(model, device, kind)

    def observe_cold_wait(self, model: str, seconds: float) -> None:
        self.metrics.observe_cold_wait(model, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--epoch", type=int, default=1)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--board-fd", type=int, default=None)
    parser.add_argument("--settings", type=Path, required=True)
    args = parser.parse_args(argv)
    die_with_parent(args.parent)
    set_title("engine")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent orchestrates a stop
    try:
        settings = read_settings(args.settings)
        plan = load_plan(settings.config)
        tracing = tracing_from_environment()  # the batch spans, children of the fronts' request spans
    except ConfigError as exc:
        print(f"model-router engine: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format, role="engine")
    threads = count_threads(available_cores(), settings.cpu_workers, settings.torch_threads)
    apply_threads(threads)
    settle_collector()
    metrics = RouterMetrics()
    runtime = Runtime(plan, cpu_workers=threads.cpu_workers, telemetry=EngineEvents(metrics), tracing=tracing)
    run = _serve(runtime, metrics, args.socket, args.epoch, settings.drain_timeout_s, args.board_fd)
    try:
        try:
            import uvloop

            uvloop.run(run)
        except ImportError:
            asyncio.run(run)
    finally:
        if tracing is not None:
            tracing.shutdown()
    return 0


async def _serve(runtime: Runtime, metrics: RouterMetrics, socket: Path, epoch: int, drain_s: float,
                 board_fd: int | None) -> None:
    loop = asyncio.get_running_loop()
    received: Counter[str] = Counter()

    def count(kind: str) -> None:
        received[kind] += 1

    server = EngineServer(runtime, socket, epoch, on_message=count, board_fd=board_fd)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(_reload(runtime)))
    await runtime.start()
    await server.start()
    counting = asyncio.ensure_future(_count_messages(received, metrics))
    await stop.wait()
    log.info("engine stopping: answering what is left")
    runtime.begin_drain()  # the fronts drained first
    try:
        await server.until_answered(min(drain_s, 5.0))
    except TimeoutError:
        log.warning("engine drain timeout: answering what is left with 503")
    runtime.answer_open(ShuttingDown("server is shutting down"))
    counting.cancel()
    await server.stop()
    await runtime.stop()


async def _count_messages(received: Counter[str], metrics: RouterMetrics) -> None:
    """The engine's message counts into its metric, in batches (a counter per message costs more)."""
    while True:
        await asyncio.sleep(COUNTS_EVERY_S)
        counts = dict(received)
        received.clear()
        for kind, count in counts.items():
            metrics.engine_messages.labels(kind).inc(count)


async def _reload(runtime: Runtime) -> None:
    log.info("received SIGHUP: re-reading the fleet file")
    try:
        report = await runtime.reload()
    except Exception as exc:  # noqa: BLE001  # a bad file: say so, keep serving what serves
        log.error("reload on SIGHUP failed, nothing changed: %s", exc)
        return
    log.info("reload on SIGHUP: added %s, changed %s, removed %s, errors %s, warnings %s", report.added,
             report.changed, report.removed, report.errors, report.warnings)


if __name__ == "__main__":
    raise SystemExit(main())
