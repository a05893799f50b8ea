"""The HTTP/1.1 connection: uvicorn's httptools protocol with bounds on what one client can make
the server hold, or wait for, before a request reaches the app.

uvicorn reads headers of any size and count, and has no timeout while a request's headers or body
trickle in. This protocol refuses, at the connection and before any ASGI work:

- request line and headers over `max_header_bytes`, or more than `max_headers` fields: 431;
- headers not complete `header_timeout_s` after the connection opened or the request began: 408;
- a body still arriving `body_timeout_s` (plus a grace second) after its headers: the connection
  closes. The app answers 408 itself at `body_timeout_s` while it reads the body
  (`router.http.app`); this is the backstop for a body nobody reads.

Refusals are JSON like the app's errors (`{"error": ...}` under /v2), as is uvicorn's own 400 for
a request it cannot parse. After a refusal the connection reads and discards for a short linger,
so the client can read the answer before the connection closes.

A `screen` (`router.http.early`) may answer a request from its request line and headers alone:
the connection writes that `EarlyAnswer`, discards the request's body as it arrives and stays
open for the next request, and the app never sees the request. Only a request on an idle
connection is screened, so answers keep the order of pipelined requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from router.http.answers import error_body

__all__ = ["PASSED", "PRECHECKED", "EarlyAnswer", "HttpLimits", "Passed", "Screen", "guarded_protocol"]

log = logging.getLogger("router.access")
LINGER_S = 2.0
BODY_GRACE_S = 1.0


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0


@dataclass(frozen=True)
class EarlyAnswer:
    """A whole response the connection writes itself, before the app would have seen the request."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]  # besides content-length, date and server
    body: bytes


#: A screen's word for a request it checked and let through: the app need not check it again
#: (the request's scope state then holds `PRECHECKED: True`).
PASSED: Final = "passed"
PRECHECKED: Final = "prechecked"
Passed = Literal["passed"]
#: (method, URL as sent, headers with lower-case names) -> the answer, PASSED, or None (not screened).
Screen = Callable[[bytes, bytes, Sequence[tuple[bytes, bytes]]], EarlyAnswer | Passed | None]


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; the protocol answers `status`."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    limits = HttpLimits()
    screen: Screen | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading = "idle"  # idle (between requests), headers, body
        self._header_bytes = 0
        self._header_count = 0
        # One timer per connection, moved lazily: arming a request's deadline only writes `_due`,
        # and the timer, when it fires before `_due`, sleeps again. It never sleeps longer than the
        # shortest deadline there is, so a deadline set later can never fall before it. (A timer
        # per request and phase cost a tenth of a small request's CPU time.)
        self._due: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._refusal: _Refused | None = None  # answered; the connection lingers, then closes
        self._failed: _Refused | None = None  # raised in a parser callback, not yet answered

    # -- the connection ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s)  # the first request's headers, from the connection's opening

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        for handle in (self._timer, self._linger):
            if handle is not None:
                handle.cancel()
        self._timer = self._linger = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """uvicorn's, with the refusals and the header byte count."""
        if self._refusal is not None:
            return  # lingering after a refusal: discard
        self._unset_keepalive_if_required()
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
        if self._reading == "headers":
            # Bytes of headers not yet complete; counted here because httptools gathers a long
            # header before any callback sees it.
            self._header_bytes += len(data)
            if self._header_bytes > self.limits.max_header_bytes:
                self._refuse(_Refused(431, f"the request line and headers exceed {self.limits.max_header_bytes} bytes"))

    # -- parser callbacks -------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading = "headers"
        self._header_bytes = self._header_count = 0
        if self._due is None:
            self._arm(self.limits.header_timeout_s)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            self._fail(_Refused(431, f"the request has more than {self.limits.max_headers} header fields"))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.limits.max_header_bytes:
            self._fail(_Refused(431, f"the request line and headers exceed {self.limits.max_header_bytes} bytes"))
        self._reading = "body"
        self._arm(self.limits.body_timeout_s + BODY_GRACE_S)
        answer = self._screened()
        if isinstance(answer, EarlyAnswer):
            self._answer_early(answer)
            return
        if answer == PASSED:
            self.scope["state"][PRECHECKED] = True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._reading = "idle"
        self._disarm()
        super().on_message_complete()

    # -- answers before the app --------------------------------------------------------------------

    def _screened(self) -> EarlyAnswer | Passed | None:
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

    def _answer_early(self, answer: EarlyAnswer) -> None:
        """Write `answer` and take the request as answered: uvicorn discards the body of an answered
        request as it arrives. The connection stays open unless the client asked to close it or sent
        `Expect: 100-continue` (it may then send no body, so its next bytes could not be told apart)."""
        keep_alive = (self.parser.get_http_version() == "1.1" and self.parser.should_keep_alive()
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
        """Answer `refusal` as JSON, stop reading requests, and close after a linger."""
        self._refusal = refusal
        self._disarm()
        url = getattr(self, "url", b"")  # set when a request begins
        log.info("request refused before the app", extra={"status": refusal.status, "detail": refusal.detail,
                                                           "path": url[:256].decode("latin-1")})
        body = json.dumps(error_body(refusal.detail, v2=url.startswith(b"/v2"))).encode()
        head = [STATUS_LINE[refusal.status], b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n"]
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
    """The protocol class to give uvicorn (`Config(http=...)`), bound to `limits` and `screen`."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"limits": limits, "screen": None if screen is None else staticmethod(screen)})
