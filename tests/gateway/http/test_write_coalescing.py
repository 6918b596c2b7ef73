"""Client writes joined per event-loop turn (gateway/http/write_coalescing.py), over a transport that records writes."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.http.write_coalescing import CoalescingTransport


class RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.events: list[str] = []
        self.closing = False
        self.paused = False

    def write(self, data: bytes) -> None:
        assert not self.closing, "written after close"
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.events.append("close")
        self.closing = True

    def abort(self) -> None:
        self.events.append("abort")
        self.closing = True

    def write_eof(self) -> None:
        self.events.append("eof")

    def get_write_buffer_size(self) -> int:
        return 5

    def pause_reading(self) -> None:
        self.paused = True


def wrapped() -> tuple[CoalescingTransport, RecordingTransport]:
    inner = RecordingTransport()
    return CoalescingTransport(inner, asyncio.get_running_loop()), inner  # type: ignore[arg-type]


async def test_writes_in_one_turn_leave_as_one() -> None:
    transport, inner = wrapped()
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    transport.write(b"")
    transport.write(b'{"a":1}')
    assert inner.writes == [] and transport.get_write_buffer_size() == 5 + 26
    await asyncio.sleep(0)
    assert inner.writes == [b'HTTP/1.1 200 OK\r\n\r\n{"a":1}']
    transport.write(b"data: 1\n\n")  # a later turn: a write of its own
    await asyncio.sleep(0)
    assert inner.writes[1:] == [b"data: 1\n\n"]


async def test_close_and_eof_send_what_is_pending_first() -> None:
    transport, inner = wrapped()
    transport.write(b"last words")
    transport.write_eof()
    assert inner.writes == [b"last words"] and inner.events == ["eof"]
    transport.write(b"bye")
    transport.close()
    assert inner.writes[-1] == b"bye" and inner.events[-1] == "close"
    await asyncio.sleep(0)  # the scheduled flush finds nothing left and writes nothing to the closed transport
    assert len(inner.writes) == 2


async def test_abort_drops_what_is_pending_and_a_closed_transport_gets_nothing() -> None:
    transport, inner = wrapped()
    transport.write(b"never sent")
    transport.abort()
    await asyncio.sleep(0)
    assert inner.writes == [] and inner.events == ["abort"]
    other, other_inner = wrapped()
    other.write(b"too late")
    other_inner.closing = True  # the client left before the flush
    await asyncio.sleep(0)
    assert other_inner.writes == []


async def test_everything_else_is_the_transport_s() -> None:
    transport, inner = wrapped()
    transport.pause_reading()
    assert inner.paused and transport.is_closing() is False
    lines: Any = [b"a", b"b"]
    transport.writelines(lines)
    await asyncio.sleep(0)
    assert inner.writes == [b"ab"]
