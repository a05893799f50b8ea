"""The parent of a split host: it holds the port, starts one engine and N fronts, and watches them.

- The settings: resolved once, by `model-router serve`, and handed to every child whole
  (`router.host.handover`): a flag reaches the engine and every front alike.
- The ports, HTTP and gRPC: sockets bound with SO_REUSEPORT that never listen (the kernel queues
  connections only on listening sockets, the fronts'), so a port another process has fails here,
  before anything starts, and stays ours while a front restarts.
- A front that dies is started again (after 0.5 s, doubling to 10 s while it keeps dying); its
  clients' connections were reset, nothing else is lost.
- The engine that dies is started again the same way, and loads the fleet file anew; meanwhile
  every front answers 503 with Retry-After. Five engine deaths within a minute are a crash loop:
  everything is stopped and the parent exits 1, for the orchestrator to see.
- A child that exits with status 2 from its first start refused its configuration (the engine
  checks the fleet file and its plugins' options, every child the settings): everything is stopped
  and the parent exits 2, as `serve` with one process does before its port opens. Later, a restart
  that is refused counts as a death like any other (the file may be mended before the next one).
  The parent itself loads no plugin and imports neither torch nor the web framework: it supervises.
- The watchdog: the parent creates each engine's board and reads its heartbeat there. An engine
  that has published nothing for `engine_hang_s` (stopped, or its event loop stuck) is killed, with
  one `engine_hung` log line saying why, and restarted as one that died: what an orchestrator's
  liveness probe would do, from inside the host. The fronts stopped trusting it long before
  (`engine_stale_s`: 503 and not ready).
- SIGTERM or SIGINT: the fronts drain (they stop taking requests and answer what they hold, which
  the engine finishes), then the engine stops; exit 0. SIGHUP goes to the engine (reload).

A front runs its plugins' hooks one input per thread of its CPU pool, which is the parallelism: its
OpenMP, MKL and OpenBLAS threads are one each (`FRONT_THREADS`, in its environment from the start),
so that torch's kernels in a hook (ResNet's resize) do not spread each input over every core and
fight the pool's other threads, the engine and the other fronts for them. The engine keeps the
settings' `torch_threads` for its batches.

The children run in their own sessions (a terminal's Ctrl-C reaches only this process, which
stops them in order) and get SIGTERM from the kernel if this process dies.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from router.config import ServerSettings
from router.host.board import BoardReader, create_board, silent_s
from router.host.handover import hold_port, write_settings
from router.host.titles import set_title

__all__ = ["CONFIG_REFUSED", "ENGINE_DEATHS_LIMIT", "FRONT_THREADS", "Child", "Supervisor", "restart_delay"]

log = logging.getLogger("router.host.supervisor")
ENGINE_DEATHS_LIMIT = 5
#: The exit status of a child that refused its configuration (a ConfigError at start); from a first
#: start, the host's too.
CONFIG_REFUSED = 2
ENGINE_DEATHS_WINDOW_S = 60.0
POLL_S = 0.05
FIRST_RESTART_S = 0.5
MAX_RESTART_S = 10.0
#: A child alive this long after a start is well again: its next death restarts it at once.
HEALTHY_AFTER_S = 30.0
#: A front's environment over the parent's: its hooks' native libraries run one thread each.
FRONT_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def restart_delay(recent_deaths: int) -> float:
    """Seconds to wait before starting a child that died `recent_deaths` times in a row."""
    if recent_deaths <= 1:
        return FIRST_RESTART_S
    return min(MAX_RESTART_S, FIRST_RESTART_S * 2 ** (recent_deaths - 1))


@dataclass
class Child:
    """One process the parent started: what it is, how to start it, its deaths."""

    role: str  # "engine" or "front N"
    command: list[str]
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    started_at: float = 0.0
    deaths: int = 0  # in a row
    restart_at: float | None = None
    death_times: deque[float] = field(default_factory=deque)


class Supervisor:
    def __init__(self, settings: ServerSettings, workers: int) -> None:
        self.settings = settings
        self.workers = workers
        self.run_dir = Path(tempfile.mkdtemp(prefix="model-router-"))
        self.socket_path = self.run_dir / "engine.sock"
        self.metrics_dir = self.run_dir / "metrics"
        self.metrics_dir.mkdir()
        self.settings_path = self.run_dir / "settings.json"
        self._port_holders: list[socket.socket] = []
        self._stopping = False
        self._reload = False
        self._epoch = 0
        self._board: BoardReader | None = None  # the current engine's, for its heartbeat
        self.children: list[Child] = []

    # -- start --------------------------------------------------------------------------------

    def _hold_ports(self) -> ServerSettings:
        """Hold the HTTP and gRPC ports; the settings every child gets (with the port bound, for port 0)."""
        host = self.settings.host
        http = hold_port(host, self.settings.port, "MODEL_ROUTER_PORT (--port)")
        self._port_holders.append(http)
        if self.settings.grpc_port:
            self._port_holders.append(hold_port(host, self.settings.grpc_port, "MODEL_ROUTER_GRPC_PORT (--grpc-port)"))
        return self.settings.model_copy(update={"port": int(http.getsockname()[1]), "workers": self.workers,
                                                "config": Path(self.settings.config).resolve()})

    def _environment(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if key != "PROMETHEUS_MULTIPROC_DIR"}
        env.update({"PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir), "PYTHONUNBUFFERED": "1"})
        return env

    def _commands(self) -> list[Child]:
        python, parent, path = sys.executable, str(os.getpid()), str(self.socket_path)
        common = ["--socket", path, "--parent", parent, "--settings", str(self.settings_path)]
        engine = Child("engine", [python, "-m", "router.host.engine_main", *common])
        fronts = [Child(f"front {i}", [python, "-m", "router.host.front_main", "--index", str(i), *common])
                  for i in range(1, self.workers + 1)]
        return [engine, *fronts]

    def _start(self, child: Child, env: dict[str, str]) -> None:
        command = list(child.command)
        handed: tuple[int, ...] = ()
        if child.role == "engine":
            self._epoch += 1
            board = create_board()  # a fresh one: its heartbeat counts from this engine's first publication
            command += ["--epoch", str(self._epoch), "--board-fd", str(board)]
            handed = (board,)
        if child.role != "engine":
            env = {**env, **FRONT_THREADS}
        child.process = subprocess.Popen(command, env=env, start_new_session=True, pass_fds=handed)
        if handed:
            if self._board is not None:
                self._board.close()
            self._board = BoardReader(handed[0])  # maps it and closes the descriptor
        child.starts += 1
        child.started_at = time.monotonic()
        child.restart_at = None
        log.info("started %s (pid %d)", child.role, child.process.pid)

    # -- run ----------------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until a signal; the exit status."""
        set_title("parent")
        env = self._environment()
        self.children = self._commands()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        try:
            settings = self._hold_ports()  # ConfigError: a port is taken
            write_settings(settings, self.settings_path)
            log.info("serving %s on http://%s:%d with %d front process(es) and one engine", settings.config,
                     settings.host, settings.port, self.workers)
            for child in self.children:
                self._start(child, env)
            status = self._watch(env)
        finally:
            self._stop_all()
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return status

    def _on_stop(self, sig: int, frame: FrameType | None) -> None:
        if self._stopping:  # a second signal: stop now
            for child in self.children:
                if child.process is not None and child.process.poll() is None:
                    child.process.kill()
        self._stopping = True

    def _on_hup(self, sig: int, frame: FrameType | None) -> None:
        self._reload = True

    def _watch(self, env: dict[str, str]) -> int:
        while not self._stopping:
            if self._reload:
                self._reload = False
                engine = self.children[0].process
                if engine is not None and engine.poll() is None:
                    log.info("received SIGHUP: the engine re-reads the fleet file")
                    engine.send_signal(signal.SIGHUP)
            now = time.monotonic()
            for child in self.children:
                outcome = self._check(child, now, env)
                if outcome == "crash loop":
                    return 1
                if outcome == "refused":
                    return CONFIG_REFUSED
            time.sleep(POLL_S)
        return 0

    def _check(self, child: Child, now: float, env: dict[str, str]) -> str:
        process = child.process
        if child.restart_at is not None:
            if now >= child.restart_at:
                self._start(child, env)
            return "waiting"
        if process is None:
            return "alive"
        if process.poll() is None and not (child.role == "engine" and self._hung(process, now)):
            return "alive"
        if now - child.started_at > HEALTHY_AFTER_S:
            child.deaths = 0
        child.deaths += 1
        child.death_times.append(now)
        while child.death_times and now - child.death_times[0] > ENGINE_DEATHS_WINDOW_S:
            child.death_times.popleft()
        log.error("%s (pid %d) exited with status %s", child.role, process.pid, process.returncode)
        if process.returncode == CONFIG_REFUSED and child.starts == 1:
            log.critical("%s refused its configuration (its error is above): stopping the server", child.role)
            return "refused"
        if child.role == "engine" and len(child.death_times) >= ENGINE_DEATHS_LIMIT:
            log.critical("the engine died %d times within %.0f s: stopping the server", len(child.death_times),
                         ENGINE_DEATHS_WINDOW_S)
            return "crash loop"
        delay = restart_delay(child.deaths)
        child.restart_at = now + delay
        log.warning("restarting %s in %.1f s", child.role, delay)
        return "dead"

    def _hung(self, engine: subprocess.Popen[bytes], now: float) -> bool:
        """The watchdog: an engine silent for `engine_hang_s` is killed (and then restarted as one that died)."""
        limit, board = self.settings.engine_hang_s, self._board
        if not limit or board is None:
            return False
        silent = silent_s(board.header(), now)
        if silent is None or silent < limit:
            return False
        log.error("the engine (pid %d) has published nothing for %.1f s (engine_hang_s %.1f): killing it, to start "
                  "another", engine.pid, silent, limit,
                  extra={"event": "engine_hung", "pid": engine.pid, "silent_s": round(silent, 3), "limit_s": limit})
        engine.kill()
        try:
            engine.wait(5)
        except subprocess.TimeoutExpired:  # not reaped yet: the next look kills it again
            return False
        return True

    # -- stop ---------------------------------------------------------------------------------

    def _stop_all(self) -> None:
        """The fronts first (they drain), then the engine."""
        fronts = [c.process for c in self.children[1:] if c.process is not None]
        engine = self.children[0].process if self.children else None
        _terminate(fronts, self.settings.drain_timeout_s + 10.0)
        _terminate([engine] if engine is not None else [], 30.0)
        for holder in self._port_holders:
            holder.close()


def _terminate(processes: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    limit = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(max(0.1, limit - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("pid %d did not stop within %.0f s: killed", process.pid, timeout_s)
            process.kill()
            process.wait(5)
