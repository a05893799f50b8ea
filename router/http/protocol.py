"""The HTTP/1.1 connection: uvicorn's httptools protocol with bounds on what one client can make
the server hold, or wait for, before a request reaches the app.

uvicorn reads headers of any size and count, and has no timeout while a request's headers or body
trickle in. This protocol refuses, at the connection and before any ASGI work:

- request line and headers over `max_header_bytes`, or more than `max_headers` fields: 431.
  Chunked trailers count toward both limits, and never reach the app (RFC 9110 §6.5: a trailer
  must not be taken for a header; a proxy that filters headers would be bypassed);
- headers not complete `header_timeout_s` after the connection opened or the request began: 408;
- a body still arriving `body_timeout_s` (plus a grace second) after its headers: the connection
  closes. The app answers 408 itself at `body_timeout_s` while it reads the body
  (`router.http.app`); this is the backstop for a body nobody reads;
- an HTTP/1.1 request without exactly one Host header: 400 (RFC 9112 §3.2).

Open connections and running requests are bounded as nginx bounds them (`router.http.connections`):
a connection over `max_connections` closes the longest-idle one, and a request over
`max_requests` running is answered 503; liveness (`/health/live`, `/v2/health/live`) is always
served.

Refusals are JSON like the app's errors (`{"error": ...}` under /v2), as is uvicorn's own 400 for
a request it cannot parse. A request is answered once and in order: a refusal of a pipelined
request waits for the answers before it, and a request already answered (by the app, or early)
gets no second answer; its connection just closes. After a refusal the connection reads and
discards for a short linger, so the client can read the answer before the connection closes.

A `screen` (`router.http.early`) may answer a request from its request line and headers alone:
the connection writes that `EarlyAnswer`, discards the request's body as it arrives and stays
open for the next request, and the app never sees the request; or let it through with the value
it made of it (the serving core's `Screened`), which the app finds in the request's scope state
under `SCREENED` and carries on with instead of screening the request again. Only a request on an
idle connection is screened, so answers keep the order of pipelined requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from router.http.answers import error_body
from router.http.connections import OpenConnections
from router.http.request import WATCH_LOSS

__all__ = ["ANSWERED", "BODY_IN", "SCREENED", "EarlyAnswer", "HttpLimits", "Screen", "guarded_protocol"]

log = logging.getLogger("router.access")
LINGER_S = 2.0
BODY_GRACE_S = 1.0
#: After a client's EOF and the probe that follows it: when to look for its reset (then it is taken
#: as half-closed, and answered).
PEER_CHECKS_S: Final = (0.02, 0.1, 0.4, 1.5)
TCP_CLOSE: Final = 7  # linux/tcp_states.h
#: Always served, whatever the load: an orchestrator restarts a server whose liveness fails.
LIVENESS: Final = frozenset({b"/health/live", b"/v2/health/live"})


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int | None = None  # open connections; over it, the longest-idle one is closed
    max_requests: int | None = None  # requests running at once; over it, 503


@dataclass(frozen=True)
class EarlyAnswer:
    """A whole response the connection writes itself, before the app would have seen the request."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]  # besides content-length, date and server
    body: bytes


#: Where the request's scope state holds what the screen made of a request it let through.
SCREENED: Final = "screened"
#: Set in the request's scope state once its whole body has arrived: reading it waits for nothing.
BODY_IN: Final = "body_in"
#: The status the connection answered a request with while the app held it (bad framing in its
#: body): the scope state holds `ANSWERED: status`, for the app's access line.
ANSWERED: Final = "answered_by_connection"
#: (method, URL as sent, headers with lower-case names) -> the answer; or the value the screen made
#: of a request it let through (kept in its scope state as `SCREENED`); or None (not screened).
Screen = Callable[[bytes, bytes, Sequence[tuple[bytes, bytes]]], object]
_BUSY: Final = EarlyAnswer(503, ((b"retry-after", b"1"), (b"content-type", b"application/json")),
                           b'{"detail":"the server is at its limit of connections and running requests; retry shortly"}')


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; the protocol answers `status`."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


#: A body up to this size is joined to its answer's head; a larger one is written beside it.
COPY_BODY_BELOW = 64 * 1024


class _HeadWithBody:
    """The cycle's transport from a response's head to its first body write: the head is held and
    goes out with that write, one write and one segment where uvicorn makes two (a client then
    reads its answer in one wake). Anything else (a close after an error) sends the head first."""

    __slots__ = ("cycle", "head", "transport")

    def __init__(self, cycle: RequestResponseCycle, transport: asyncio.Transport) -> None:
        self.cycle, self.transport, self.head = cycle, transport, b""

    def write(self, data: bytes) -> None:
        if not self.head:  # the head itself
            self.head = data
            return
        self.cycle.transport = self.transport
        if len(data) <= COPY_BODY_BELOW:
            self.transport.write(self.head + data)
        else:  # not copied: one gathered write (uvloop's)
            self.transport.writelines((self.head, data))

    def close(self) -> None:
        self.cycle.transport = self.transport
        if self.head:
            self.transport.write(self.head)
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class _OneWriteCycle(RequestResponseCycle):
    """A request whose answer's head and body go out in one write (`_HeadWithBody`); a HEAD
    request's answer has no body write, so its head is written as it comes."""

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start" and not self.response_started:
            self.transport = _HeadWithBody(self, self.transport)  # type: ignore[assignment]
        await super().send(message)


class _ContinueCycle(_OneWriteCycle):
    """A request sent with `Expect: 100-continue`. If the app answers before it asked for the body
    (no 100 was sent), the client may never send that body, and whatever it sends next would be
    read as the body: the connection closes after the answer (RFC 9110 §10.1.1)."""

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start" and self.waiting_for_100_continue:
            self.keep_alive = False
        await super().send(message)


class _LossWatch:
    """A connection's `Watch` (`router.http.request`): it calls back the request waiting for its
    answer once the connection is lost; one callback at a time, since the connection runs one
    request at a time. It holds no reference to the connection: a scope that keeps it must not
    keep the connection, and the body its state caches, alive past the connection's end."""

    __slots__ = ("callback", "lost")

    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None
        self.lost = False

    def __call__(self, callback: Callable[[], None], on: bool) -> bool:
        if not on:
            if self.callback is callback:
                self.callback = None
            return True
        if self.lost:
            return False
        self.callback = callback
        return True

    def fire(self) -> None:
        self.lost = True
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    limits = HttpLimits()
    screen: Screen | None = None
    open_connections: OpenConnections[GuardedHttpToolsProtocol] = OpenConnections(None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading = "idle"  # idle (between requests), headers, body
        self._header_bytes = 0  # received for a head still arriving (an estimate; exact once complete)
        self._header_count = 0
        self._began_in_feed = False  # a request began in the bytes being parsed
        self._in_trailers = False  # after a chunk header, before any chunk data: maybe trailers
        self._body_in_feed = False
        self._trailer_pending = 0  # bytes received for a trailer field not yet complete
        # One timer per connection, moved lazily: arming a request's deadline only writes `_due`,
        # and the timer, when it fires before `_due`, sleeps again. It never sleeps longer than the
        # shortest deadline there is, so a deadline set later can never fall before it. (A timer
        # per request and phase cost a tenth of a small request's CPU time.)
        self._due: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._refusal: _Refused | None = None  # answered (or to answer); the connection then lingers and closes
        self._failed: _Refused | None = None  # raised in a parser callback, not yet answered
        self._deferred: _Refused | None = None  # to answer once the answers before it are written
        self._running: RequestResponseCycle | None = None  # the request the app is answering
        self._over_limit = False  # opened over max_connections with no idle one to close
        self._peer_done = False  # the client half-closed after a complete request
        self._peer_check: asyncio.TimerHandle | None = None
        self._loss = _LossWatch()  # each request's scope state gets it (WATCH_LOSS)

    # -- the connection ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s)  # the first request's headers, from the connection's opening
        victim = self.open_connections.opened(self)
        if victim is not None:
            victim.transport.close()
        elif self.open_connections.over_limit():
            self._over_limit = True
        self._report_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        for handle in (self._timer, self._linger, self._peer_check):
            if handle is not None:
                handle.cancel()
        self._timer = self._linger = self._peer_check = None
        self.open_connections.closed(self)
        super().connection_lost(exc)
        self._loss.fire()

    def eof_received(self) -> bool | None:
        """The client sent its last byte: it half-closed, or closed and left. A request cut short
        cannot complete, so the connection closes (the app sees a disconnect). A complete one is
        answered to a client that only half-closed (then the connection closes), and not run for
        one that left: a `100 Continue` (which HTTP/1.1 clients must accept before any answer) is
        sent, and a client that closed answers it with a reset, which the TCP state shows."""
        pending = self._reading == "idle" and self.cycle is not None and not self._done(self.cycle)
        running = self._running
        if not pending or running is None or running.response_started or not self._tcp_state():
            return None
        if self.parser.get_http_version() != "1.1":
            return None
        self._peer_done = True
        running.waiting_for_100_continue = False
        self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._peer_check = self.loop.call_later(PEER_CHECKS_S[0], self._check_peer, 1)
        return True  # our side stays open for the answer

    def _tcp_state(self) -> int | None:
        """The connection's TCP state (Linux's TCP_INFO), or None where it cannot be read."""
        sock = self.transport.get_extra_info("socket")
        try:
            return int(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0])
        except (AttributeError, OSError, TypeError):
            return None

    def _check_peer(self, step: int) -> None:
        """After the probe: a peer that closed has reset the connection (TCP_CLOSE): it left."""
        self._peer_check = None
        if self.transport.is_closing():
            return
        if self._tcp_state() == TCP_CLOSE:
            self.transport.abort()
        elif step < len(PEER_CHECKS_S):
            self._peer_check = self.loop.call_later(PEER_CHECKS_S[step], self._check_peer, step + 1)

    def data_received(self, data: bytes) -> None:
        """uvicorn's, with the refusals and the head's byte count."""
        if self._refusal is not None:
            return  # refused: discard
        self._unset_keepalive_if_required()
        self._began_in_feed = self._body_in_feed = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            refusal, self._failed = self._failed, None
            self._refuse(refusal or _Refused(400, f"invalid HTTP request: {exc}"))
            return
        # httptools gathers a long header (or trailer) before any callback sees it, so bytes of a
        # head not yet complete are counted here. A feed in which the request began also holds the
        # end of the one before (its body): that feed is not counted, so a pipelined request is
        # never refused for its predecessor's body; the exact check follows when the head completes.
        if self._reading == "headers" and not self._began_in_feed:
            self._header_bytes += len(data)
            if self._header_bytes > self.limits.max_header_bytes:
                self._refuse(_Refused(431, f"the request line and headers exceed {self.limits.max_header_bytes} bytes"))
        elif self._reading == "body" and self._in_trailers and not self._body_in_feed:
            self._trailer_pending += len(data)
            self._check_head(0, in_callback=False)

    # -- parser callbacks -------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading = "headers"
        self._began_in_feed = True
        self._in_trailers = False
        self._header_bytes = self._header_count = self._trailer_pending = 0
        self.open_connections.busy(self)
        if self._due is None:
            self._arm(self.limits.header_timeout_s)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._reading == "body":  # a chunked body's trailer: counted, then dropped
            self._trailer_pending = 0
            self._check_head(len(name) + len(value) + 4, in_callback=True)
            return
        if self._header_count > self.limits.max_headers:
            self._fail(_Refused(431, f"the request has more than {self.limits.max_headers} header fields"))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        head, hosts = len(self.url), 0
        for name, value in self.headers:  # one pass for both counts
            head += len(name) + len(value) + 4
            hosts += name == b"host"
        self._header_bytes = head
        if self._header_bytes > self.limits.max_header_bytes:
            self._fail(_Refused(431, f"the request line and headers exceed {self.limits.max_header_bytes} bytes"))
        if self.parser.get_http_version() == "1.1" and hosts != 1:
            self._fail(_Refused(400, "an HTTP/1.1 request needs exactly one Host header (RFC 9112, section 3.2)"))
        busy = self._overloaded()
        if busy and self.cycle is not None and not self._done(self.cycle):  # pipelined behind an answer still due
            self._fail(_Refused(503, "the server is at its limit of connections and running requests; retry shortly"))
        self._reading = "body"
        self._arm(self.limits.body_timeout_s + BODY_GRACE_S)
        answer = _BUSY if busy else self._screened()
        if isinstance(answer, EarlyAnswer):
            self._answer_early(answer, close=busy)
            return
        state = self.scope["state"]
        if answer is not None:
            state[SCREENED] = answer
        state[WATCH_LOSS] = self._loss
        super().on_headers_complete()
        if self.cycle is not None and self.scope["method"] != "HEAD":
            self.cycle.__class__ = _ContinueCycle if self.cycle.waiting_for_100_continue else _OneWriteCycle

    def on_chunk_header(self) -> None:
        self._in_trailers = True  # until chunk data arrives: after the last chunk, trailers follow

    def on_body(self, body: bytes) -> None:
        self._in_trailers = False
        self._body_in_feed = True
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._reading = "idle"
        self._in_trailers = False
        self._disarm()
        self.scope["state"][BODY_IN] = True
        super().on_message_complete()
        self._settle()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._settle()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    # -- bounds -------------------------------------------------------------------------------------

    def _check_head(self, trailer_field_bytes: int, *, in_callback: bool) -> None:
        """Count a trailer field (or bytes of one still arriving) toward the head's limits."""
        self._header_bytes += trailer_field_bytes
        refusal = None
        if self._header_count > self.limits.max_headers:
            refusal = _Refused(431, f"the request has more than {self.limits.max_headers} header fields, "
                                    "trailers included")
        elif self._header_bytes + self._trailer_pending > self.limits.max_header_bytes:
            refusal = _Refused(431, f"the request's headers and trailers exceed {self.limits.max_header_bytes} bytes")
        if refusal is not None and in_callback:
            self._fail(refusal)
        elif refusal is not None:
            self._refuse(refusal)

    def _overloaded(self) -> bool:
        """Too many connections or running requests for this one: 503, liveness excepted."""
        if self.url.partition(b"?")[0] in LIVENESS:
            return False
        limit = self.limits.max_requests
        return self._over_limit or (limit is not None and len(self.tasks) >= limit)

    def _report_room(self) -> None:
        closed = self.open_connections.report_due(self.loop.time())
        if closed:
            log.warning("%d connection(s) open, over the limit of %s: closed %d idle connection(s) to make room",
                        self.open_connections.count, self.limits.max_connections, closed,
                        extra={"open_connections": self.open_connections.count, "closed_idle": closed})

    def _settle(self) -> None:
        """After a request's body or answer: answer a deferred refusal once every answer before it is
        written; close a half-closed connection once answered; else, with nothing left, it is idle."""
        if self.transport.is_closing() or self._reading != "idle" and self._deferred is None:
            return
        if self.pipeline or (self._running is not None and not self._done(self._running)):
            return
        if self._deferred is not None:
            refusal, self._deferred = self._deferred, None
            self._write_refusal(refusal)
        elif self.cycle is None or self._done(self.cycle):
            if self._peer_done:
                self.transport.close()
            else:
                self.open_connections.idle(self)

    @staticmethod
    def _done(cycle: RequestResponseCycle) -> bool:
        return cycle.response_complete or cycle.disconnected

    # -- answers before the app --------------------------------------------------------------------

    def _screened(self) -> object:
        """The screen's answer for a request on an idle connection (none pipelined before it)."""
        if self.screen is None or (self.cycle is not None and not self.cycle.response_complete):
            return None
        if self.parser.should_upgrade():
            return None
        try:
            return self.screen(self.parser.get_method(), self.url, self.headers)
        except Exception:  # the app decides instead: a screen's bug must not cost the request
            log.exception("the early refusal screen failed; the app answers this request")
            return None

    def _answer_early(self, answer: EarlyAnswer, *, close: bool = False) -> None:
        """Write `answer` and take the request as answered: uvicorn discards the body of an answered
        request as it arrives. The connection stays open unless the client asked to close it or sent
        `Expect: 100-continue` (it may then send no body, so its next bytes could not be told apart),
        or `close`."""
        keep_alive = (not close and self.parser.get_http_version() == "1.1" and self.parser.should_keep_alive()
                      and not self.expect_100_continue)
        cycle = RequestResponseCycle(
            scope=self.scope, transport=self.transport, flow=self.flow, logger=self.logger,
            access_logger=self.access_logger, access_log=self.access_log,
            default_headers=self.server_state.default_headers, message_event=asyncio.Event(),
            expect_100_continue=False, keep_alive=keep_alive, on_response=self.on_response_complete,
        )
        cycle.response_started = cycle.response_complete = True
        self.cycle = cycle
        head = [STATUS_LINE[answer.status]]
        head += [b"%s: %s\r\n" % field for field in (*self.server_state.default_headers, *answer.headers)]
        head.append(b"content-length: %d\r\n" % len(answer.body))
        if not keep_alive:
            head.append(b"connection: close\r\n")
        self.transport.write(b"".join(head) + b"\r\n" + answer.body)
        if keep_alive:
            self.on_response_complete()
        else:
            self._refusal = _Refused(answer.status, "answered before the app; closing")
            self._close_after_linger()

    # -- refusals ---------------------------------------------------------------------------------

    def _fail(self, refusal: _Refused) -> None:
        """Stop parsing from inside a callback (httptools wraps the exception); answered in data_received."""
        self._failed = refusal
        raise refusal

    def _refuse(self, refusal: _Refused) -> None:
        """Stop reading requests and answer `refusal` once, in order: at once, or once the answers
        before it are written; not at all for a request that was answered already (its connection
        closes). A request the app holds unanswered is taken from it."""
        self._disarm()
        current = self.cycle if self._reading == "body" else None  # the refused request, if the app has it
        if current is not None and current.response_started:
            self._refusal = refusal
            log.info("connection closed after the request was answered: %s", refusal.detail,
                     extra={"detail": refusal.detail, "path": self.url[:256].decode("latin-1")})
            if not current.response_complete:
                current.disconnected = True
            self._close_after_linger()
            return
        if current is not None:
            current.disconnected = True  # the app's answer, if it makes one, goes nowhere
            current.scope["state"][ANSWERED] = refusal.status
            current.message_event.set()
            self.pipeline = deque(queued for queued in self.pipeline if queued[0] is not current)
        self._defer(refusal)

    def _defer(self, refusal: _Refused) -> None:
        self._refusal = self._deferred = refusal  # parsing stops; answered by _settle, in order
        self._disarm()
        self._reading = "idle"
        self._settle()

    def _write_refusal(self, refusal: _Refused) -> None:
        """Answer `refusal` as JSON and close after a linger."""
        url = getattr(self, "url", b"")  # set when a request begins
        log.info("request refused before the app", extra={"status": refusal.status, "detail": refusal.detail,
                                                           "path": url[:256].decode("latin-1")})
        body = json.dumps(error_body(refusal.detail, v2=url.startswith(b"/v2"))).encode()
        head = [STATUS_LINE[refusal.status], b"content-type: application/json\r\n"]
        if refusal.status == 503:
            head.append(b"retry-after: 1\r\n")
        head += [b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self._close_after_linger()

    def _close_after_linger(self) -> None:
        """Stop sending, read and discard a while (so the client reads the answer), then close."""
        self._disarm()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger = self.loop.call_later(LINGER_S, self.transport.close)

    # -- deadlines --------------------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        self._due = self.loop.time() + seconds
        if self._timer is None:
            self._timer = self.loop.call_later(min(seconds, self._longest_sleep()), self._on_timer)

    def _longest_sleep(self) -> float:
        return min(self.limits.header_timeout_s, self.limits.body_timeout_s + BODY_GRACE_S)

    def _disarm(self) -> None:
        self._due = None

    def _on_timer(self) -> None:
        self._timer = None
        if self._due is None:
            return
        left = self._due - self.loop.time()
        if left > 0:
            self._timer = self.loop.call_later(min(left, self._longest_sleep()), self._on_timer)
            return
        self._due = None
        self._on_deadline()

    def _on_deadline(self) -> None:
        if self.transport.is_closing():
            return
        if self._reading == "headers":
            self._refuse(_Refused(408, f"the request headers did not arrive within {self.limits.header_timeout_s:g} s"))
        else:  # a connection that never sent a request, or a body nobody finished reading
            self.transport.close()


def guarded_protocol(limits: HttpLimits, screen: Screen | None = None) -> type[GuardedHttpToolsProtocol]:
    """The protocol class to give uvicorn (`Config(http=...)`), bound to `limits`, `screen` and
    a fresh count of the server's open connections."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {
        "limits": limits, "screen": None if screen is None else staticmethod(screen),
        "open_connections": OpenConnections(limits.max_connections)})
