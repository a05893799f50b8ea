"""`isolation: process`: a model's instance runs its plugin in a child process, ended on unload.

Some backends keep memory after their models are dropped (TorchScript, some CUDA libraries).
Ending the process that held the model is the one unload that always gives everything back.

`RemotePlugin` stands in for the plugin on the router's side: every hook is a call to the child
over a pipe, with the arguments and results pickled. Calls may overlap (preprocessing runs on
several CPU-pool threads); each carries an id, and the child runs them on a small thread pool.
The same boundary is the seam for serving from several processes per host: the router only ever
talks to a `ModelPlugin`, local or not.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, ClassVar

from pydantic import BaseModel

from router.errors import InputError, ModelError, RouterError
from router.sdk.plugin import MemoryEstimate, ModelPlugin, Payload, PluginContext

__all__ = ["RemotePlugin"]


def _send(conn: Connection, message: Any) -> None:
    """Plain pickling: tensors travel by value (multiprocessing's own pickler would try to share
    them through file descriptors between processes that are not its own)."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())

log = logging.getLogger("router.serving.isolation")
#: Hooks the child answers.
HOOKS = frozenset({"load", "preprocess", "predict_batch", "postprocess", "describe_input", "memory_estimate",
                   "example_payload", "warmup", "unload"})
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


class RemotePlugin(ModelPlugin[BaseModel]):
    """A plugin whose object lives in a child process from `load` to `unload`."""

    torch_memory: ClassVar[bool] = False  # its memory is in another process: no in-process profiling

    def __init__(self, cls: type[ModelPlugin[Any]], options: BaseModel, context: PluginContext) -> None:
        super().__init__(options, context)
        self.cls = cls
        self.accepts = cls.accepts  # type: ignore[misc]
        self._local = cls(options, context)  # for hooks that need no model (example_payload before load)
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self._pending: dict[int, Future[Any]] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()

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

    def warmup(self, batch_size: int) -> None:
        self._call("warmup", batch_size)

    def unload(self) -> None:
        """Let the plugin unload, then end the child: whatever it still held goes with it."""
        try:
            if self.pid is not None:
                self._call("unload")
        finally:
            self._stop()

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
        _send(conn, (self.cls.__module__, self.cls.__qualname__, self.options.model_dump(mode="json"), self.context))
        self._process, self._conn = process, conn
        self._pending.clear()
        self._reader = threading.Thread(target=self._read, args=(conn,), daemon=True,
                                        name=f"remote-{self.context.model_name}")
        self._reader.start()
        log.info("model %s: instance process %d started", self.context.model_name, process.pid,
                 extra={"model": self.context.model_name})

    def _stop(self) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if conn is not None:
            try:
                with self._send_lock:
                    _send(conn, ("stop", 0, "", ()))
            except (OSError, ValueError):
                pass
        if process is not None:
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_TIMEOUT_S)
            log.info("model %s: instance process %d ended (exit code %s)", self.context.model_name, process.pid,
                     process.returncode, extra={"model": self.context.model_name})
        if conn is not None:
            conn.close()
        self._fail_pending("the instance process ended")

    def _call(self, hook: str, *args: Any) -> Any:
        conn = self._conn
        if conn is None:
            raise ModelError(f"model {self.context.model_name!r}: its instance process is not running")
        future: Future[Any] = Future()
        call_id = next(self._ids)
        self._pending[call_id] = future
        try:
            with self._send_lock:
                _send(conn, ("call", call_id, hook, args))
        except (OSError, ValueError) as exc:
            self._pending.pop(call_id, None)
            raise ModelError(f"model {self.context.model_name!r}: its instance process is gone ({exc})") from None
        return future.result(timeout=None if hook != "load" else START_TIMEOUT_S)

    def _read(self, conn: Connection) -> None:
        """Hand each answer to its caller; when the pipe closes, fail whatever still waits."""
        while True:
            try:
                kind, call_id, value = _recv(conn)
            except (EOFError, OSError):
                break
            future = self._pending.pop(call_id, None)
            if future is None:
                continue
            if kind == "ok":
                future.set_result(value)
            else:
                future.set_exception(value)
        self._fail_pending("the instance process ended")

    def _fail_pending(self, why: str) -> None:
        for call_id in list(self._pending):
            future = self._pending.pop(call_id, None)
            if future is not None and not future.done():
                future.set_exception(ModelError(f"model {self.context.model_name!r}: {why} during a call"))


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
            where = traceback.format_exc(limit=3)[-800:]
            reply = ("error", call_id, RuntimeError(f"{type(exc).__name__}: {exc} (in the instance process: {where})"))
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
            own = hook in ("load", "unload", "warmup", "memory_estimate", "predict_batch")
            (instance if own else pool).submit(answer, call_id, hook, args)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    _child_main(Connection(int(sys.argv[1])))
