"""The HTTP/1.1 client model calls reach vLLM through: pooled keep-alive connections on httptools' parser.

Every call pays for its upstream request twice over in a proxy (building it, reading the answer), and aiohttp's
general-purpose client was the largest single cost on the gateway's event loop (a sixth of it at 64 concurrent
calls: request objects, header merging, payload wrappers, a task per request). vLLM's API needs far less: a POST of
a JSON body we already hold as bytes, then a status, a content type and a body that is either sized or chunked
(SSE). So this client writes the request as one prebuilt byte string and feeds the answer to httptools (the C
parser uvicorn uses), with no task, no per-request objects beyond one response and no header processing.
The control plane (`/models` probes, token text, publication) keeps aiohttp: it is not on any call's path.

What it keeps from a full client: a connect timeout, a read timeout between bytes (`sock_read`), back pressure
(reading pauses while a slow client leaves 256 KiB unread), connections that the server or a half-read response
closed never going back to the pool, and one transparent retry when a reused keep-alive connection turns out to
have been closed by vLLM before it read the request (nothing was generated: vLLM closes idle connections after 5 s,
and our side drops them after 4).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

# vLLM (uvicorn) closes a keep-alive connection idle for 5 s; reusing one just as it does would lose the request.
IDLE_CLOSE_S = 4.0
MAX_IDLE_PER_HOST = 256
_HIGH_WATER = 256 * 1024  # unread response bytes at which reading from vLLM pauses


class UpstreamError(Exception):
    """vLLM broke the exchange (closed the connection mid-answer, sent something that is not HTTP)."""


class ConnectFailed(UpstreamError):
    """No connection to vLLM could be made: nothing was sent, so the call may go to another replica."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the response it is reading (one at a time: no pipelining)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.started = False  # any byte of the response arrived
        self.headers_done = False
        self.until_eof = False  # a body neither sized nor chunked: the end of the connection ends it
        self.keep_alive = False  # read with the headers: the parser forgets it once the message is complete
        self.complete = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False

    # -- asyncio.Protocol ------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.started = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"vLLM sent a malformed HTTP response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.until_eof and not self.complete:
            self.on_message_complete()
            return
        if not self.complete:
            why = f": {exc}" if exc else ""
            self._fail(UpstreamError(f"vLLM closed the connection before the response was complete{why}"))

    # -- httptools callbacks ---------------------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        self.until_eof = "content-length" not in self.headers and "chunked" not in self.headers.get(
            "transfer-encoding", ""
        ) and self.status not in (204, 304) and self.status >= 200
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- used by the pool and the response -------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    async def wait(self, timeout_s: float) -> None:
        """Until the parser has something new for the reader, or `timeout_s` without a byte (TimeoutError)."""
        if self.error is not None:
            raise self.error
        waiter = self.waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout_s, self._expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None
        if self.error is not None:
            raise self.error

    @staticmethod
    def _expire(waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_exception(TimeoutError())

    def take(self) -> bytes:
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self._reset()
        self.transport.write(data)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None


class UpstreamResponse:
    """vLLM's answer: status and headers are in; the body is read with `read` or `iter_chunks`. Call `release` when
    done (the connection goes back to the pool if the body was read whole) or `close` to hang up mid-answer."""

    __slots__ = ("_conn", "_pool", "_key", "_timeout_s", "status", "headers")

    def __init__(self, conn: _Connection, pool: UpstreamPool, key: tuple[str, int], timeout_s: float) -> None:
        self._conn: _Connection | None = conn
        self._pool = pool
        self._key = key
        self._timeout_s = timeout_s
        self.status = conn.status
        self.headers = conn.headers

    async def read(self) -> bytes:
        conn = self._conn
        assert conn is not None, "response already released"
        parts: list[bytes] = []
        while True:
            if conn.chunks:
                parts.append(conn.take())
            if conn.complete:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            await conn.wait(self._timeout_s)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as vLLM's writes arrive (all that is buffered at once), without waiting for the whole of it."""
        conn = self._conn
        assert conn is not None, "response already released"
        while True:
            if conn.chunks:
                yield conn.take()
            elif conn.complete:
                return
            else:
                await conn.wait(self._timeout_s)

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.reusable():
            self._pool.put_back(self._key, conn)
        else:
            conn.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class UpstreamPool:
    """Keep-alive connections per vLLM host, reused newest first; `headers` go on every request."""

    def __init__(self, headers: dict[str, str], connect_timeout_s: float, read_timeout_s: float) -> None:
        self._extra = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items() if k.lower() != "host")
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._targets: dict[str, tuple[tuple[str, int], bytes, bytes]] = {}  # url -> key, request line, headers
        self._closed = False

    def _target(self, url: str) -> tuple[tuple[str, int], bytes, bytes]:
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise ConnectFailed(f"only http:// upstream URLs are supported, not {url!r}")
            port = parts.port or 80
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            netloc = parts.netloc.rpartition("@")[2]
            head = b"POST " + path.encode("latin-1") + b" HTTP/1.1\r\n"
            fixed = f"host: {netloc}\r\n".encode("latin-1") + self._extra
            target = self._targets[url] = ((parts.hostname, port), head, fixed)
        return target

    async def post(self, url: str, body: bytes) -> UpstreamResponse:
        """POST `body` (JSON) and wait for the status and headers. Raises ConnectFailed (nothing was sent),
        UpstreamError (vLLM broke the exchange) or TimeoutError (no byte within the read timeout)."""
        key, head, fixed = self._target(url)
        request = b"".join((head, fixed, b"content-length: ", str(len(body)).encode(), b"\r\n\r\n", body))
        while True:
            conn = await self._acquire(key)
            conn.send(request)
            try:
                while not conn.headers_done:
                    await conn.wait(self._read_timeout_s)
            except UpstreamError:
                conn.close()
                if conn.reused and not conn.started:
                    continue  # vLLM closed the idle connection as we sent: it never read the request
                raise
            except BaseException:
                conn.close()
                raise
            return UpstreamResponse(conn, self, key, self._read_timeout_s)

    async def _acquire(self, key: tuple[str, int]) -> _Connection:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_CLOSE_S:
                conn.reused = True
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, protocol = await loop.create_connection(lambda: _Connection(loop), key[0], key[1])
        except TimeoutError:
            raise ConnectFailed(f"connecting to {key[0]}:{key[1]} timed out") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {key[0]}:{key[1]}: {exc.strerror or exc}") from None
        return protocol

    def put_back(self, key: tuple[str, int], conn: _Connection) -> None:
        idle = self._idle.setdefault(key, [])
        if self._closed or len(idle) >= MAX_IDLE_PER_HOST:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def close(self) -> None:
        """Close the idle connections; responses still being read close theirs when released."""
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
