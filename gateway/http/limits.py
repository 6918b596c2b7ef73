"""Limits on connections, enforced in the HTTP protocol before a request reaches the app.

uvicorn's httptools protocol has none of them: an 8 MiB request header was read in full before any key check (four
unfinished 64 MiB ones took the process from 119 to 371 MiB), and a connection that sent nothing, or a header a
byte at a time, was held for as long as the client liked (its keep-alive timer only starts after a response). Its
own `limit_concurrency` answers a plain-text 503 that no OpenAI SDK can parse. So the protocol is subclassed:

- request headers over `max_header_bytes` get a 431;
- a request whose headers and body are not all received within `request_read_timeout_s` of its first byte is
  refused with a 408 (still in the headers) or its connection closed (in the body; the app sees a disconnect and
  forwards nothing);
- a connection idle before its first request closes after the keep-alive time, as one idle between requests does;
- a connection opened while `max_connections` are already open is answered with an OpenAI-style 503 (and
  `Retry-After`) when it sends its request, unless others have closed by then; the connections already open,
  and the calls on them, are untouched.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.http.errors import error_body
from gateway.http.write_coalescing import CoalescingTransport

log = logging.getLogger("trajgate.http")

# How long a refused connection is drained before it is closed: closing a socket that still has unread input
# resets it, and the client would lose the answer explaining why.
LINGER_S = 2.0
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_header_bytes: int
    request_read_timeout_s: float
    max_connections: int


async def _over_capacity(scope: Scope, receive: Receive, send: Send) -> None:
    body = error_body(
        "the gateway has too many open connections; retry shortly", "server_error", "too_many_connections"
    )
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    limits: ClassVar[HttpLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = False
        self._head_bytes = 0
        self._read_timer: asyncio.TimerHandle | None = None
        self._over_capacity = False
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
        self._over_capacity = len(self.connections) > self.limits.max_connections
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # drained unparsed until the connection closes
        super().data_received(data)
        if self._in_head:
            # Counted per read rather than per header, so a single endless header is refused part-way, before
            # the parser has buffered all of it.
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(431, f"request headers larger than {self.limits.max_header_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        self._cancel_read_timer()
        self._read_timer = self.loop.call_later(self.limits.request_read_timeout_s, self._read_timed_out)

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._over_capacity and len(self.connections) > self.limits.max_connections:
            open_now, limit = len(self.connections), self.limits.max_connections
            log.warning("%d connections open (limit %d): refusing a new one", open_now, limit)
            app, self.app = self.app, _over_capacity
            try:
                super().on_headers_complete()
            finally:
                self.app = app
            return
        self._over_capacity = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._cancel_read_timer()
        super().on_message_complete()

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        timeout = self.limits.request_read_timeout_s
        if self._in_head:
            self._refuse(408, f"request headers not received within {timeout:g} s")
        elif not self.transport.is_closing():
            # The app is already reading the body: a response of our own would interleave with its own, so the
            # connection is closed and the app sees the client gone (nothing is forwarded upstream).
            log.warning("request body not received within %g s; closing the connection", timeout)
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        self._refused = True
        self._cancel_read_timer()
        self._unset_keepalive_if_required()
        log.warning("refused a request: %s", message)
        code = "request_timeout" if status == 408 else "request_header_fields_too_large"
        body = error_body(message, code=code)
        head = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status]) + (
            b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        )
        self.transport.write(head + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


def protocol_class(limits: HttpLimits) -> type[asyncio.Protocol]:
    """The protocol uvicorn should serve with (its `http=` setting), bound to these limits."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})
