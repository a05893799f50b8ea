"""The engine process's server: requests from the fronts onto the runtime's queues, answers back.

Each front's `Submit` is committed here (`Turn.admit`: the same rules the front screened it with
on the board, on live figures, taking the queue slot and the hold), queued with its ticket's
outcome going to `EngineServer.answered`, and answered with exactly one `Reply` whatever happens:
served, refused, expired, withdrawn, the front gone (then the answer is dropped). A model that is
not serving makes its request wait for its load in a task; hooks that run in the engine
(`preprocess_needs_model`, or a front with no front state yet) go through `Runtime.submit` whole.

Beside the request path: the board (figures for the fronts' refusals, every 2 ms while busy), the
`Models` the fronts build their plugin objects from, the `Snapshot`s they answer `/models` and
`/metrics` from, and the admin `Call`s.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

from router.errors import ClientDisconnected, ConfigError, ModelError, RouterError
from router.host.board import BOARD_BYTES, BoardWriter
from router.host.fleet_news import FleetNews
from router.host.links import FrontLink, Outgoing, Writer, accept_front, read_front
from router.host.messages import Call, CallReply, Cancel, Failure, Lags, Observed, Submit
from router.host.packing import unpack
from router.scheduling.queue import BatchFacts, Outcome, Served, Ticket, reject
from router.sdk.plugin import Payload
from router.serving.intake import Accepted, Turn
from router.serving.rules import Terms
from router.serving.runtime import Runtime, expired
from router.tracing.api import SpanRef

__all__ = ["EngineServer"]

log = logging.getLogger("router.host.engine")
BUSY_PUBLISH_S = 0.002
IDLE_PUBLISH_S = 0.1


@dataclass(eq=False)
class Pending:
    """A front's request the engine has taken and not yet answered."""

    link: FrontLink
    id: int
    accepted: Accepted | None = None
    ticket: Ticket | None = None
    task: asyncio.Task[None] | None = None
    engine_hooks: bool = False


class EngineServer:
    """Listens on the engine's socket; one `FrontLink` per connected front."""

    def __init__(self, runtime: Runtime, socket_path: Path, epoch: int,
                 on_message: Callable[[str], None] | None = None, board_fd: int | None = None) -> None:
        self.runtime = runtime
        self.socket_path = socket_path
        self.epoch = epoch
        self.links: dict[int, FrontLink] = {}
        self.board = BoardWriter(board_fd)  # the parent's (it watches the heartbeat), or a board of its own
        self.news = FleetNews(runtime, self.board)
        self.writer = Writer()
        self._on_message = on_message or (lambda kind: None)
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._flush_due = False
        self._last_activity = 0.0

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if self.socket_path.exists():
            self.socket_path.unlink()
        listener.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o600)
        listener.listen(64)
        self._listener = listener
        self.writer.start()
        threading.Thread(target=self._accept_loop, name="engine-accept", daemon=True).start()
        self._spawn(self._publish_loop(), "board")
        self._spawn(self._news_loop(), "fleet-news")
        log.info("engine listening on %s (epoch %d)", self.socket_path, self.epoch)

    async def until_answered(self, timeout_s: float) -> None:
        """Wait until every front's requests are answered; TimeoutError after `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            while any(link.requests for link in self.links.values()):
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        for link in list(self.links.values()):
            link.alive = False
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.writer.stop()

    def _spawn(self, work: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _accept_loop(self) -> None:
        """Accept fronts (a thread: the handshake passes descriptors on blocking sockets)."""
        assert self._listener is not None and self._loop is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # the listener closed: stopping
            try:
                link = accept_front(sock, self.epoch, self.board.fd, BOARD_BYTES)
            except (OSError, ValueError) as exc:
                log.warning("a front's handshake failed: %s: %s", type(exc).__name__, exc)
                sock.close()
                continue
            self._loop.call_soon_threadsafe(self._attach, link)
            threading.Thread(target=read_front, args=(link, self._loop, self._deliver, self._lost, self.writer),
                             name=f"engine-read-{link.index}", daemon=True).start()

    def _attach(self, link: FrontLink) -> None:
        self.links[id(link)] = link
        log.info("%s connected", link.name)
        self.writer.put(link, [Outgoing(message=self.news.models_message()), Outgoing(message=self.news.snapshot())])

    def _lost(self, link: FrontLink) -> None:
        """A front went away: withdraw its queued tickets, cancel its tasks; running batches finish
        and their answers are dropped."""
        if not link.alive:
            return
        link.alive = False
        self.links.pop(id(link), None)
        log.warning("%s disconnected with %d request(s) open", link.name, len(link.requests))
        for pending in list(link.requests.values()):
            self._cancel(pending, ClientDisconnected(f"{link.name} went away"))
        self.writer.forget(link)

    # -- requests -----------------------------------------------------------------------------

    def _deliver(self, link: FrontLink, batch: list[Any]) -> None:
        """One read's messages, in order; its requests admitted as one turn (`Turn`)."""
        self._last_activity = time.monotonic()
        turn = Turn(self.runtime.intake)
        for message in batch:
            if isinstance(message, tuple):
                submit, item = message
                self._on_message("submit")
                self._submit(link, submit, item, turn)
            elif isinstance(message, Cancel):
                self._on_message("cancel")
                pending = link.requests.get(message.id)
                if pending is not None and not (pending.engine_hooks and message.expired):
                    error = expired(pending.accepted) if message.expired and pending.accepted else \
                        ClientDisconnected("the client disconnected before its answer")
                    self._cancel(pending, error)
            elif isinstance(message, Lags):
                self._on_message("lags")
                self.news.observe_lags(message)
            elif isinstance(message, Observed):
                self._on_message("observed")
                for observation in message.observations:
                    self.runtime.report_versions(observation)
            elif isinstance(message, Call):
                self._on_message("call")
                self._spawn(self._call(link, message), f"call-{type(message.verb).__name__}")

    def _submit(self, link: FrontLink, submit: Submit, item: Any, turn: Turn) -> None:
        pending = Pending(link, submit.id)
        link.requests[submit.id] = pending
        terms = submit.terms
        if submit.payload is not None:
            pending.engine_hooks = True
            pending.task = self._spawn(self._whole(pending, submit), f"request-{submit.request_id}")
            return
        if terms.wait_for_room:  # a pipeline's later step: waits here for room in a full queue
            pending.task = self._spawn(self._after_room(pending, submit, item, terms), f"room-{submit.request_id}")
            return
        try:
            pending.accepted = turn.admit(terms, generation=submit.generation)
        except RouterError as exc:
            self._answer(pending, Outgoing(submit.id, failure=Failure.of(exc)))
            return
        if not pending.accepted.deployment.serving:
            pending.task = self._spawn(self._cold(pending, submit, item), f"cold-{submit.request_id}")
            return
        self._enqueue(pending, submit, item)

    def _enqueue(self, pending: Pending, submit: Submit, item: Any) -> None:
        assert pending.accepted is not None
        try:
            pending.ticket = self.runtime.intake.enqueue(pending.accepted, item, partial(self.answered, pending),
                                                         submit.request_id, submit.input_bytes,
                                                         None if submit.trace is None else SpanRef.from_bytes(submit.trace))
        except RouterError as exc:
            self.runtime.intake.unreserve(pending.accepted)
            self.failed(pending, exc)

    async def _after_room(self, pending: Pending, submit: Submit, item: Any, terms: Terms) -> None:
        """Wait for room in the model's queue (`Runtime.until_room`), then admit and queue."""
        try:
            await self.runtime.until_room(self.runtime.intake.deployment(terms.model, submit.generation), terms)
            pending.accepted = self.runtime.intake.admit(terms, generation=submit.generation)
        except RouterError as exc:
            self.failed(pending, exc)
            return
        except asyncio.CancelledError:
            self.failed(pending, ClientDisconnected("cancelled"))
            return
        if not pending.accepted.deployment.serving:
            await self._cold(pending, submit, item)
            return
        self._enqueue(pending, submit, item)

    async def _cold(self, pending: Pending, submit: Submit, item: Any) -> None:
        """A request for a model that is not loaded waits for its load, then queues."""
        assert pending.accepted is not None
        try:
            await self.runtime.until_serving(pending.accepted)
        except BaseException as exc:
            self.runtime.intake.unreserve(pending.accepted)
            self.failed(pending, exc if isinstance(exc, RouterError) else ClientDisconnected("cancelled"))
            if not isinstance(exc, (RouterError, asyncio.CancelledError)):
                raise
            return
        self._enqueue(pending, submit, item)

    async def _whole(self, pending: Pending, submit: Submit) -> None:
        """Hooks in the engine: the raw body committed by `Runtime.run` (the front counted the
        request and screened it), the answer back whole."""
        assert submit.payload is not None
        ref = submit.payload
        body = unpack(ref.body, pending.link.request_arena)
        pixels = unpack(ref.pixels, pending.link.request_arena) if ref.pixels is not None else None
        terms = submit.terms
        try:
            payload = Payload(bytes(body), ref.media_type, ref.filename, pixels=pixels)
            answer, _ = await self.runtime.run(self.runtime.lookup(terms.model), terms, None, payload,
                                               submit.request_id, None)
        except RouterError as exc:
            self.failed(pending, exc)
            return
        except asyncio.CancelledError:
            self.failed(pending, ClientDisconnected("cancelled"))
            return
        facts = BatchFacts(answer.batch_size, 0.0, answer.execution_s, memory_delta_bytes=answer.memory_delta_bytes,
                           queue_wait_s=answer.queue_wait_s)
        self._answer(pending, Outgoing(submit.id, answer=self.news.encode(answer.output),
                                       input_info=self.news.encode(answer.input_info), facts=facts))

    def _cancel(self, pending: Pending, error: RouterError) -> None:
        """Withdraw a queued ticket (answered with `error`), or cancel the request's task; a running
        batch is left to finish."""
        if pending.task is not None and not pending.task.done():
            pending.task.cancel()
        elif pending.ticket is not None and pending.accepted is not None and \
                self.runtime.intake.withdraw(pending.accepted, pending.ticket):
            reject(pending.ticket, error)

    def answered(self, pending: Pending, outcome: Outcome) -> None:
        """The ticket's outcome. Served: the output goes to the front, which postprocesses it with
        its own plugin object, so the instance's use ends here."""
        if not isinstance(outcome, Served):
            self.failed(pending, outcome.error)
            return
        if outcome.lease is not None:
            outcome.lease.end()
        ticket, batch = pending.ticket, outcome.batch
        assert ticket is not None
        facts = msgspec.structs.replace(batch, queue_wait_s=batch.dispatched_at - ticket.arrived_at)
        self._answer(pending, Outgoing(pending.id, output=outcome.output, facts=facts, packs=True))

    def failed(self, pending: Pending, error: BaseException) -> None:
        if not isinstance(error, RouterError):
            error = ModelError(f"{type(error).__name__}: {error}")
        self._answer(pending, Outgoing(pending.id, failure=Failure.of(error)))

    def _answer(self, pending: Pending, outgoing: Outgoing) -> None:
        """The one answer of a request: release what it held, queue the reply for its front."""
        link = pending.link
        if link.requests.pop(pending.id, None) is None:
            return  # answered already
        if pending.accepted is not None:
            self.runtime.intake.release(pending.accepted, pending.ticket)
        if not link.alive:
            return
        link.outbox.append(outgoing)
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Once per loop turn: every front's replies of this turn to the writer, in one hand-over each."""
        self._flush_due = False
        for link in self.links.values():
            if link.outbox:
                items, link.outbox = link.outbox, []
                self.writer.put(link, items)

    async def _call(self, link: FrontLink, call: Call) -> None:
        """Run one admin verb on the runtime; its result, or its error as a `Failure`, to the front."""
        verb = type(call.verb).__name__
        try:
            reply = CallReply(call.id, msgspec.msgpack.encode(await call.verb.apply(self.runtime)))
        except RouterError as exc:
            reply = CallReply(call.id, failure=Failure.of(exc))
        except ConfigError as exc:
            reply = CallReply(call.id, failure=Failure("ConfigError", str(exc)))
        except Exception as exc:  # a bug: the front answers 500, the engine logs it once
            log.exception("admin call %s failed", verb)
            reply = CallReply(call.id, failure=Failure("ModelError", f"{verb} failed: {type(exc).__name__}: {exc}"))
        # The news first: once a front has the reply (a model loaded, a pipeline added), every
        # front's next request reads the board and the fleet that follow from it, not the ones before.
        self.news.changed()
        self._send_news()
        if link.alive:
            self.writer.put(link, [Outgoing(message=reply)])

    # -- what the fronts read -------------------------------------------------------------------

    async def _publish_loop(self) -> None:
        """The board: every 2 ms while requests are open or arriving, every 100 ms otherwise."""
        while True:
            self.news.publish_board(self.epoch)
            busy = any(link.requests for link in self.links.values()) or \
                time.monotonic() - self._last_activity < IDLE_PUBLISH_S
            await asyncio.sleep(BUSY_PUBLISH_S if busy else IDLE_PUBLISH_S)

    async def _news_loop(self) -> None:
        """`Models` when the fleet changes, `Snapshot` after any change or every half second."""
        while True:
            self._send_news()
            await asyncio.sleep(0.05)

    def _send_news(self) -> None:
        models, snapshot = self.news.due()
        if models or snapshot:
            self.news.publish_board(self.epoch)  # first: a front that reads the change finds the board agreeing
        for link in list(self.links.values()):
            items = ([Outgoing(message=models)] if models else []) + ([Outgoing(message=snapshot)] if snapshot else [])
            if items:
                self.writer.put(link, items)
