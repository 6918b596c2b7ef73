"""The ASGI side of a model call: the chat client's answer (`ChatAnswer`), and the relay's watch for a hang-up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.types import Receive, Send

from gateway.http import sse
from gateway.http.errors import GatewayError, UpstreamFailure
from gateway.http.sse import DATA, DONE, END
from gateway.proxy.exchange import Headers
from gateway.upstream.client import UpstreamError

log = logging.getLogger("trajgate.proxy")


_BETWEEN = END + DATA  # what separates two data-only events
_dumps = orjson.dumps


class ChatAnswer:
    """The chat and completions clients' answer (`gateway.proxy.exchange.Answer`): the chat path's dicts serialised
    as vLLM's endpoint would send them. It is the one place a chat answer becomes bytes; the edge translators read
    the same dicts instead.

    `chunk` runs for every event the chat relay relays, so it is the held list's own `append` (no Python call per
    event): the chunks of an upstream read are serialised and framed together when it is flushed (one join), and go
    out in one `send` (see `Proxy._relay_stream`). Nothing the relay does between a chunk and the flush changes the
    chunk (recording the call reads it), so the client gets what the chunk was when it was handed over."""

    __slots__ = ("_out", "_pending", "_send", "chunk")

    def __init__(self, send: Send) -> None:
        self._send = send
        self._pending: list[dict[str, Any]] = []  # chunks held, not serialised yet
        self._out: list[bytes] = []  # what the held events give the client, in order
        self.chunk: Callable[[dict[str, Any]], None] = self._pending.append

    async def error(self, error: GatewayError, headers: Headers) -> None:
        await send_bytes(self._send, error.status, error.body(), [(b"content-type", b"application/json"), *headers])

    async def answer(self, response: dict[str, Any], content_type: bytes, headers: Headers) -> None:
        await send_bytes(self._send, 200, orjson.dumps(response), [(b"content-type", content_type), *headers])

    async def passthrough(self, status: int, body: bytes, content_type: bytes, headers: Headers) -> None:
        await send_bytes(self._send, status, body, [(b"content-type", content_type), *headers])

    async def start(self, headers: Headers) -> None:
        await sse.start_stream(self._send, headers)

    def _serialise(self) -> list[bytes]:
        """The held chunks framed into their events, after what was held before them."""
        out = self._out
        pending = self._pending
        if pending:
            # The events framed at once: `data: <chunk>` joined by the blank line that ends each.
            out += (DATA, _BETWEEN.join([_dumps(chunk) for chunk in pending]), END)
            pending.clear()
        return out

    def error_chunk(self, chunk: dict[str, Any], payload: bytes) -> None:
        self._serialise().extend((DATA, payload, END))

    def done(self) -> None:
        self._serialise().append(DONE)

    async def flush(self) -> None:
        out = self._out
        pending = self._pending
        if pending:  # (`_serialise` inline, with one bytes object when nothing else is held: this runs per read)
            if len(pending) == 1:  # vLLM's usual read: one event
                framed = b"".join((DATA, _dumps(pending.pop()), END))
            else:
                framed = b"".join((DATA, _BETWEEN.join([_dumps(chunk) for chunk in pending]), END))
                pending.clear()
            if not out:
                await self._send({"type": "http.response.body", "body": framed, "more_body": True})
                return
            out.append(framed)
        if out:
            body = b"".join(out)
            out.clear()
            await self._send({"type": "http.response.body", "body": body, "more_body": True})

    async def broke(self, message: str) -> None:
        self._pending.clear()
        self._out.clear()
        await self._send({"type": "http.response.body", "body": sse.error_event(message), "more_body": True})

    async def end(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


async def send_bytes(send: Send, status: int, body: bytes, headers: Headers) -> None:
    """A whole answer: status line, headers (with the body's length) and body."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns once the client hangs up; run beside a stream to stop generating for a client that left."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def relay_until_done(
    relay: Awaitable[None],
    receive: Receive,
    tell: Callable[[str], Awaitable[None]],
    done: Callable[[], bool],
    record: Callable[[str], None],
) -> str | None:
    """Run a stream relay until it ends or the client hangs up; returns why the stream ended early (for the call's
    record), None when it did not. Cancelling the relay on a hang-up stops reading from vLLM, which lets it abort
    the generation; every failure other than a client that left is told in-band (`tell`: the call's
    `Answer.broke`), so a stream is never cut silently, and `record(error)` runs before the client is told, so the
    failed call is in the write-ahead log first.

    The relay runs in the calling task and only the watch for a hang-up gets a task of its own: a second task and
    `asyncio.wait` around them cost more per stream than relaying a short answer's events.
    """
    task = asyncio.current_task()
    assert task is not None
    left = False

    async def watch() -> None:
        nonlocal left
        try:
            await wait_for_disconnect(receive)
        except Exception:  # a receive that fails is a client we can no longer hear: the same as one that left
            pass
        left = True
        task.cancel()  # never after the relay: `hangup` is cancelled before the caller next awaits

    hangup = asyncio.ensure_future(watch())
    error: str | None = None
    told: str | None = None
    try:
        await relay
    except asyncio.CancelledError:
        if not left or task.uncancel() > 0:
            raise  # cancelled from outside: the server is shutting down
        if not done():
            error = "client disconnected mid-stream"
    except UpstreamFailure as failure:
        error = told = failure.error.message
    except (UpstreamError, TimeoutError) as exc:
        error, told = f"vLLM stream broke: {type(exc).__name__}: {exc}", "vLLM stream ended unexpectedly"
    except OSError:  # a write to a client that already left
        if not done():
            error = "client disconnected mid-stream"
    except Exception as exc:
        log.exception("stream relay failed")
        error = f"stream relay failed: {type(exc).__name__}: {exc}"
        told = "the gateway could not relay vLLM's stream"
    finally:
        hangup.cancel()
    if told is not None:
        assert error is not None
        record(error)
        with contextlib.suppress(OSError):
            await tell(told)
    return error
