"""The one SSE framer and reader every stream goes through (gateway/http/sse.py): frames byte for byte as the clients
read them, and a reader that gives the same payloads however the stream is cut into reads."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.http import sse


def test_frames_are_what_openai_anthropic_and_eventsource_clients_read() -> None:
    assert sse.frame(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert sse.frame(b"{}", event="message_stop") == b"event: message_stop\ndata: {}\n\n"
    assert sse.frame(b"{}", id=7) == b"id: 7\ndata: {}\n\n"
    assert sse.frame(b"{}", event="step", id="7") == b"event: step\nid: 7\ndata: {}\n\n"
    assert sse.DONE == sse.frame(sse.DONE_PAYLOAD) == b"data: [DONE]\n\n"
    assert sse.frame(b"x") == sse.DATA + b"x" + sse.END  # what the chat relay writes inline


def test_the_in_band_error_is_an_openai_error_object() -> None:
    event = sse.error_event("vLLM stream ended unexpectedly")
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    assert json.loads(event[6:]) == {
        "error": {"message": "vLLM stream ended unexpectedly", "type": "upstream_error", "param": None, "code": None}
    }


async def test_start_stream_sends_the_status_and_event_stream_headers_first() -> None:
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    request_id = (b"x-request-id", b"req-1")
    await sse.start_stream(send, [request_id])
    await sse.start_stream(send, [], 201, sse.EVENT_STREAM + b"; charset=utf-8")
    assert sent == [
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), request_id],
        },
        {
            "type": "http.response.start",
            "status": 201,
            "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")],
        },
    ]


STREAM = (
    b": a comment\n"
    b"event: message\n"
    b'data: {"id":1}\n'
    b"\n"
    b'data:{"id":2}\r\n'
    b"\r\n"
    b"id: 3\n"
    b"retry: 100\n"
    b'data:   {"id":3}  \n'
    b"\n"
    b"data: [DONE]\n"
    b"\n"
)
PAYLOADS = [b'{"id":1}', b'{"id":2}', b'{"id":3}', b"[DONE]"]


def read(pieces: list[bytes]) -> list[bytes]:
    lines = sse.DataLines()
    out = [payload for piece in pieces for payload in lines.feed(piece)]
    last = lines.end()
    return out + ([last] if last is not None else [])


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 16, len(STREAM)])
def test_data_payloads_are_the_same_however_the_stream_is_cut(size: int) -> None:
    """Only `data:` lines count (comments, event:, id:, retry: and blank lines are skipped), with `\\r\\n` ends and
    no space after the colon read alike, and a line split anywhere across reads, even mid `\\r\\n`."""
    assert read([STREAM[i : i + size] for i in range(0, len(STREAM), size)]) == PAYLOADS


def test_a_long_line_in_many_reads_and_an_unterminated_last_line() -> None:
    ids = b"[" + b",".join(b"%d" % i for i in range(20_000)) + b"]"
    line = b'data: {"prompt_token_ids":' + ids + b"}\n\n"
    pieces = [line[i : i + 1000] for i in range(0, len(line), 1000)]
    assert read(pieces) == [b'{"prompt_token_ids":' + ids + b"}"]
    assert read([b"data: [DO", b"NE]"]) == [b"[DONE]"]  # a stream cut before its newline still ends
    assert read([b": only a comment"]) == []
    assert read([b"", b"\n", b""]) == []
    lines = sse.DataLines()
    assert list(lines.feed(b"data: 1\ndata: 2")) == [b"1"] and lines.end() == b"2" and lines.end() is None
