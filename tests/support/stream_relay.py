"""Drive the real `Proxy._relay_stream` in-process: no sockets, no aiohttp, no database.

Only the ends are stubbed — the upstream response (`iter_chunks()` and `close()`, the part of
gateway.upstream.client's response the relay reads), the ASGI `send` (behind the chat client's `ChatAnswer`) and `receive`, and the writer (records are kept in a list) — so what comes
out is exactly what a client would receive and what would be written. Shared by the relay's equivalence tests
(tests/gateway/proxy/test_stream_relay.py) and its CPU benchmark (bench/sse_relay.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import Send

from gateway.http.metrics import GatewayMetrics
from gateway.proxy import capture
from gateway.proxy.asgi_io import ChatAnswer
from gateway.proxy.attribution import Attribution
from gateway.proxy.exchange import Exchange
from gateway.proxy.hot_path import Proxy
from gateway.proxy.routing import Route
from gateway.store.call_record import CallRecord


class ReadsUpstream:
    """An upstream response whose body arrives as the given reads."""

    def __init__(self, reads: list[bytes]) -> None:
        self._reads = reads
        self.closed = False

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        for data in self._reads:
            yield data

    def close(self) -> None:
        self.closed = True


class ListWriter:
    """The writer's `submit`, keeping the records."""

    def __init__(self) -> None:
        self.records: list[CallRecord] = []

    def submit(self, record: CallRecord) -> None:
        self.records.append(record)


class _Router:
    base_model = "base-model"


def relay_proxy() -> tuple[Proxy, ListWriter]:
    """A Proxy holding just what `_relay_stream` and `submit` touch (no session, replicas or database)."""
    proxy = Proxy.__new__(Proxy)
    writer = ListWriter()
    proxy.writer = writer  # type: ignore[assignment]
    proxy.metrics = GatewayMetrics()
    proxy.router = _Router()  # type: ignore[assignment]
    return proxy, writer


def new_call(endpoint: str, asks: capture.ClientAsks, send: Send) -> Exchange:
    """A call as `Proxy.handle` makes it for a stream, just before the upstream answers."""
    now = time.perf_counter()
    return Exchange(
        request_id="req-relay",
        endpoint=endpoint,
        capture=endpoint,
        received=now,
        created_at=time.time(),
        request={"model": "my-agent", "stream": True},
        receive=_never,
        answer=ChatAnswer(send),
        attribution=Attribution("t-relay", "g-relay", None, "train", False),
        seq=1,
        retry_count=0,
        idempotency_key=None,
        stream=True,
        route=Route("my-agent", 0, "served"),
        off_policy=None,
        asks=asks,
        headers=[],
        upstream_started=now,
    )


def sse_reads(payloads: list[str]) -> list[bytes]:
    """One upstream read per SSE event, as vLLM sends each event in its own HTTP chunk."""
    return [b"data: " + payload.encode() + b"\n\n" for payload in payloads]


async def _never() -> dict[str, Any]:
    """An ASGI `receive` for a client that never hangs up."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def relay(proxy: Proxy, reads: list[bytes], endpoint: str, asks: capture.ClientAsks, send: Send) -> Exchange:
    """One stream through the real relay; its record goes to the proxy's writer."""
    call = new_call(endpoint, asks, send)
    await proxy._relay_stream(ReadsUpstream(reads), call)  # type: ignore[arg-type]
    return call

