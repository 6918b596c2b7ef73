"""Server-sent events, written and read in one place: every stream the gateway sends or reads goes through here.

The chat relay, token_in, the Messages and Responses translators and the runs API's event stream all speak SSE; one
framer and one line reader keep them from drifting apart (a stray `\\r`, a line split across two reads, a comment).
It sits in the HTTP plumbing so that the proxy, the edge translators and the endpoints may all import it.

The chat client's answer (`gateway.proxy.asgi_io.ChatAnswer`) frames the events of a read together from `DATA` and
`END` (one join, no Python call per event): the chat relay relays thousands of events a second, and `frame` is for
everyone else.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.types import Send

from gateway.http.errors import error_body

EVENT_STREAM = b"text/event-stream"
DATA = b"data: "  # what starts an event's data line as the gateway writes it
END = b"\n\n"  # what ends an event
DONE = b"data: [DONE]\n\n"  # OpenAI's last event of a stream
DONE_PAYLOAD = b"[DONE]"
KEEPALIVE = b": keep-alive\n\n"  # a comment: readers skip it, proxies see the connection in use
_DATA_FIELD = b"data:"  # what a reader looks for (the space after it is optional in SSE)
_NOTHING: tuple[bytes, ...] = ()


def frame(payload: bytes, event: str | None = None, id: int | str | None = None) -> bytes:
    """One event. `payload` must be a single line (orjson's output always is): a newline in it would end the
    event early. `id` is what a reconnecting client sends back as Last-Event-ID."""
    if event is None and id is None:
        return DATA + payload + END
    head = b"" if event is None else b"event: " + event.encode() + b"\n"
    if id is not None:
        head += b"id: " + str(id).encode() + b"\n"
    return head + DATA + payload + END


def error_event(message: str) -> bytes:
    """A stream's failure told in-band, OpenAI-style (an `error` object where a chunk was due): the status line has
    already gone out, so this is the only way left to tell the client."""
    return DATA + error_body(message, "upstream_error") + END


async def start_stream(
    send: Send, headers: Sequence[tuple[bytes, bytes]], status: int = 200, content_type: bytes = EVENT_STREAM
) -> None:
    """The status line and headers of an event stream (never cached: each event is news)."""
    headers = [(b"content-type", content_type), (b"cache-control", b"no-cache"), *headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})


class DataLines:
    """Reads an SSE byte stream as it arrives: `feed` each read, get the payloads of the `data:` lines it completed
    (stripped of surrounding whitespace, so `\\r\\n` line ends and `data:x` without a space read alike); `end` gives
    the last line's if the stream stopped without a newline. Every other line (`event:`, `id:`, comments, the blank
    line between events) is skipped: the gateway reads only streams with one data line per event.

    A line may be split across any number of reads and has no length limit (vLLM sends all of a prompt's token ids
    in its first event); its pieces are kept as they came and joined once.
    """

    __slots__ = ("_partial",)

    def __init__(self) -> None:
        self._partial: list[bytes] = []

    def feed(self, data: bytes) -> Sequence[bytes]:
        partial = self._partial
        if b"\n" not in data:
            if data:
                partial.append(data)
            return _NOTHING
        if partial:
            partial.append(data)
            data = b"".join(partial)
            partial.clear()
        lines = data.split(b"\n")
        rest = lines.pop()  # (cheaper than unpacking into `*lines, rest`, which copies the list)
        if rest:
            partial.append(rest)
        return [line[5:].strip() for line in lines if line[:5] == _DATA_FIELD]

    def end(self) -> bytes | None:
        """The payload of an unterminated last line, if it is a `data:` line; the reader is empty afterwards."""
        if not self._partial:
            return None
        line = b"".join(self._partial)
        self._partial.clear()
        return line[5:].strip() if line.startswith(_DATA_FIELD) else None
