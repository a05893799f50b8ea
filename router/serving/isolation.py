"""`isolation: process`: a model's instance runs its plugin in a child process, ended on unload.

Some backends keep memory after their models are dropped (TorchScript, some CUDA libraries).
Ending the process that held the model is the one unload that always gives everything back.

`RemotePlugin` stands in for the plugin on the router's side: every hook is a call to the child
over a pipe, with the arguments and results pickled. Calls may overlap (preprocessing runs for
many requests at once); each carries an id, and the child runs them on a small thread pool. A
writer thread sends them, so no caller ever blocks on a pipe the child does not read.

A child that stops answering, or dies, must cost only its own model:

- the request path awaits its calls (`acall`): no router thread waits on the child, so a stopped
  child cannot take the CPU pool that every other model preprocesses on;
- every call but a batch (whose execution timeout fences the instance) is bounded by
  `call_timeout_s`, and once a call has gone unanswered that long, new calls are refused at once
  (503) until the child answers again;
- a child that exits unasked is reaped by the reader thread, its calls fail with `InstanceLost`
  (503 + Retry-After), and `on_exit` tells the serving layer, which restarts the instance.

The same boundary is the seam for serving from several processes per host: the router only ever
talks to a `ModelPlugin`, local or not.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, ClassVar

from pydantic import BaseModel

from router.errors import (
    ExecutionTimeout,
    InputError,
    InstanceLost,
    ModelError,
    ModelUnavailable,
    RouterError,
    undecodable,
)
from router.sdk.plugin import MemoryEstimate, ModelPlugin, Payload, PluginContext

__all__ = ["RemotePlugin", "exit_reason"]


def _send(conn: Connection, message: Any) -> None:
    """Plain pickling: tensors travel by value (multiprocessing's own pickler would try to share
    them through file descriptors between processes that are not its own)."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


log = logging.getLogger("router.serving.isolation")
#: Hooks the child answers.
HOOKS = frozenset({"load", "preprocess", "predict_batch", "postprocess", "describe_input", "memory_estimate",
                   "example_payload", "warmup", "unload", "front_state"})
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
#: Hooks bounded by their own timeouts: a batch by the instance's execution timeout (it fences).
_OWN_TIMEOUT: dict[str, float | None] = {"load": START_TIMEOUT_S, "unload": STOP_TIMEOUT_S, "predict_batch": None}


def exit_reason(returncode: int | None) -> str:
    """How a process ended, in words: 'killed by SIGKILL', 'exit code 3'."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def _settle(future: Future[Any], kind: str, value: Any) -> None:
    """Answer a call's future, unless its caller gave up on it (cancelled)."""
    try:
        if kind == "ok":
            future.set_result(value)
        else:
            future.set_exception(value)
    except InvalidStateError:
        pass


class RemotePlugin(ModelPlugin[BaseModel]):
    """A plugin whose object lives in a child process from `load` to `unload`."""

    torch_memory: ClassVar[bool] = False  # its memory is in another process: no in-process profiling
    predict_on_own_thread: ClassVar[bool] = True  # a batch waits on the child: never on the event loop

    def __init__(self, cls: type[ModelPlugin[Any]], options: BaseModel, context: PluginContext, *,
                 call_timeout_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(options, context)
        self.cls = cls
        self.accepts = cls.accepts  # type: ignore[misc]
        self.call_timeout_s = call_timeout_s
        #: Told why (from the reader thread) when the child exits without being asked to.
        self.on_exit: Callable[[str], None] | None = None
        self._clock = clock
        self._local = cls(options, context)  # for hooks that need no model (example_payload before load)
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] | None = None
        self._pending: dict[int, tuple[Future[Any], float]] = {}  # call id -> (future, sent at)
        self._lock = threading.Lock()  # the pending calls and the child's handles
        self._ids = itertools.count()
        self.died: str | None = None  # why the child died, once it has

    @property
    def name(self) -> str:
        return self.context.model_name

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None and self._process.poll() is None else None

    # -- the hooks ------------------------------------------------------------------------------

    def load(self, device: str) -> None:
        self._start()
        self._call("load", device)

    def preprocess(self, payload: Payload) -> Any:
        return self._call("preprocess", payload)

    def predict_batch(self, items: Sequence[Any]) -> Sequence[Any]:
        result: Sequence[Any] = self._call("predict_batch", list(items))
        return result

    def postprocess(self, output: Any, item: Any) -> Any:
        return self._call("postprocess", output, item)

    def describe_input(self, payload: Payload, item: Any) -> dict[str, Any]:
        described: dict[str, Any] = self._call("describe_input", payload, item)
        return described

    def memory_estimate(self) -> MemoryEstimate:
        estimate: MemoryEstimate = self._call("memory_estimate")
        return estimate

    def example_payload(self) -> Payload | None:
        return self._local.example_payload()

    def front_state(self) -> Any:
        """The child's loaded plugin's, for the front processes of a split host."""
        return self._call("front_state")

    def warmup(self, batch_size: int) -> None:
        self._call("warmup", batch_size)

    def unload(self) -> None:
        """Let the plugin unload, then end the child: whatever it still held goes with it."""
        try:
            if self.pid is not None:
                self._call("unload")
        finally:
            self._stop()

    async def acall(self, hook: str, *args: Any) -> Any:
        """A hook, awaited on the event loop without holding any thread: the request path's way in."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self.start_call(hook, *args)), self.call_timeout_s)
        except TimeoutError:
            raise self._timed_out(hook, self.call_timeout_s) from None

    # -- calls ------------------------------------------------------------------------------------

    def start_call(self, hook: str, *args: Any) -> Future[Any]:
        """Send a call to the child; its future. Refused at once (503) when the child is gone or
        has left a call unanswered for `call_timeout_s`."""
        with self._lock:
            outbox = self._outbox
            if outbox is None:
                if self.died is not None:
                    raise InstanceLost(f"model {self.name!r}: {self.died}; it is restarting", retry_after_s=1.0)
                raise ModelUnavailable(f"model {self.name!r}: its instance process is not running", retry_after_s=1.0)
            now = self._clock()
            oldest = min((sent for _, sent in self._pending.values()), default=now)
            if hook not in ("unload", "load") and now - oldest > self.call_timeout_s:
                raise ModelUnavailable(
                    f"model {self.name!r}: its instance process has not answered a call for {now - oldest:.1f} s",
                    retry_after_s=max(1.0, self.call_timeout_s))
            future: Future[Any] = Future()
            call_id = next(self._ids)
            self._pending[call_id] = (future, now)
        outbox.put(("call", call_id, hook, args))
        return future

    def _call(self, hook: str, *args: Any) -> Any:
        """A hook, waited for on the calling thread (the instance's own, while it loads and warms)."""
        timeout = _OWN_TIMEOUT.get(hook, self.call_timeout_s)
        future = self.start_call(hook, *args)
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            future.cancel()
            raise self._timed_out(hook, timeout or 0.0) from None

    def _timed_out(self, hook: str, seconds: float) -> ExecutionTimeout:
        return ExecutionTimeout(f"model {self.name!r}: its instance process did not answer {hook} within {seconds:g} s")

    # -- the child process ----------------------------------------------------------------------

    def _start(self) -> None:
        """A fresh interpreter (never a fork of a process that runs threads), joined by a socket pair."""
        self._stop()
        ours, theirs = socket.socketpair()
        process = subprocess.Popen(
            [sys.executable, "-m", "router.serving.isolation", str(theirs.fileno())], pass_fds=[theirs.fileno()],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        theirs.close()
        conn = Connection(ours.detach())
        outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        outbox.put(("start", self.cls.__module__, self.cls.__qualname__, self.options.model_dump(mode="json"),
                    self.context))
        with self._lock:
            self._process, self._conn, self._outbox, self.died = process, conn, outbox, None
            self._pending.clear()
        for role, target in (("reader", self._read), ("writer", self._write)):
            threading.Thread(target=target, args=(conn, *(() if role == "reader" else (outbox,))), daemon=True,
                             name=f"remote-{role}-{self.name}").start()
        log.info("model %s: instance process %d started", self.name, process.pid, extra={"model": self.name})

    def _stop(self) -> None:
        with self._lock:
            process, conn, outbox = self._process, self._conn, self._outbox
            self._process = self._conn = self._outbox = None
        if outbox is not None:
            outbox.put(("stop", 0, "", ()))
            outbox.put(None)
        if process is not None:
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_TIMEOUT_S)
            log.info("model %s: instance process %d ended (%s)", self.name, process.pid,
                     exit_reason(process.returncode), extra={"model": self.name})
        if conn is not None:
            conn.close()
        self._fail_pending(ModelUnavailable(f"model {self.name!r}: its instance process ended during a call",
                                            retry_after_s=1.0))

    def _write(self, conn: Connection, outbox: queue.SimpleQueue[tuple[Any, ...] | None]) -> None:
        """Send queued calls in order; only this thread blocks when the child stops reading."""
        while (message := outbox.get()) is not None:
            if message[0] == "start":
                message = message[1:]
            try:
                _send(conn, message)
            except (OSError, ValueError):
                return  # the pipe is gone: the reader sees it and fails what waits
            except Exception as exc:  # noqa: BLE001  # arguments that cannot be pickled: that call fails, the others go on
                with self._lock:
                    entry = self._pending.pop(message[1], None)
                if entry is not None:
                    _settle(entry[0], "error", ModelError(f"model {self.name!r}: the arguments of {message[2]} "
                                                          f"cannot reach the instance process: {exc}"))

    def _read(self, conn: Connection) -> None:
        """Hand each answer to its caller; when the pipe closes, fail whatever still waits."""
        while True:
            try:
                kind, call_id, value = _recv(conn)
            except (EOFError, OSError):
                break
            with self._lock:
                entry = self._pending.pop(call_id, None)
            if entry is not None:
                _settle(entry[0], kind, value)
        self._ended(conn)

    def _ended(self, conn: Connection) -> None:
        """The pipe closed. Asked to (`_stop`): nothing more to do. Unasked: the child died; reap it,
        say so once, refuse its calls, and tell `on_exit`."""
        with self._lock:
            if self._conn is not conn:
                return
            process, outbox = self._process, self._outbox
            self._process = self._conn = self._outbox = None
        if outbox is not None:
            outbox.put(None)
        conn.close()
        assert process is not None
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # it closed its end but lives on: end it
            process.kill()
            process.wait(STOP_TIMEOUT_S)
        self.died = f"its instance process {process.pid} died ({exit_reason(process.returncode)})"
        if self.on_exit is not None:  # it says so (once), and first: the instance fails before its calls do
            self.on_exit(self.died)
        else:
            log.error("model %s: %s", self.name, self.died, extra={"model": self.name, "pid": process.pid})
        self._fail_pending(InstanceLost(f"model {self.name!r}: {self.died} during a call; it is restarting",
                                        retry_after_s=1.0))

    def _fail_pending(self, error: RouterError) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            _settle(future, "error", error)


def _child_main(conn: Connection) -> None:
    """The child: build the plugin, answer calls until told to stop or the pipe closes."""
    import importlib

    module, qualname, options, context = _recv(conn)
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    plugin = cls(cls.Options.model_validate(options), context)
    lock = threading.Lock()

    def answer(call_id: int, hook: str, args: tuple[Any, ...]) -> None:
        try:
            reply: tuple[str, int, Any] = ("ok", call_id, getattr(plugin, hook)(*args))
        except RouterError as exc:  # InputError and the like travel as they are
            reply = ("error", call_id, exc)
        except Exception as exc:  # noqa: BLE001  # a plugin bug: its type, message and where, as a ModelError
            refused = undecodable(exc) if hook == "preprocess" else None  # a client's input it cannot decode
            where = traceback.format_exc(limit=3)[-800:]
            failure = RuntimeError(f"{type(exc).__name__}: {exc} (in the instance process: {where})")
            reply = ("error", call_id, refused or failure)
        try:
            with lock:
                _send(conn, reply)
        except Exception as exc:  # noqa: BLE001  # an unpicklable result
            with lock:
                _send(conn, ("error", call_id, ModelError(f"the result of {hook} cannot leave the process: {exc}")))

    with ThreadPoolExecutor(2, thread_name_prefix="remote-hook") as pool, \
            ThreadPoolExecutor(1, thread_name_prefix="remote-instance") as instance:
        while True:
            try:
                kind, call_id, hook, args = _recv(conn)
            except (EOFError, OSError):
                break
            if kind == "stop":
                break
            if hook not in HOOKS:
                with lock:
                    _send(conn, ("error", call_id, InputError(f"no hook named {hook!r}")))
                continue
            # The instance's own hooks run one at a time, in order; pre- and postprocessing beside them.
            own = hook in ("load", "unload", "warmup", "memory_estimate", "predict_batch", "front_state")
            (instance if own else pool).submit(answer, call_id, hook, args)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    _child_main(Connection(int(sys.argv[1])))
