"""The model-call HTTP client (gateway/upstream/client.py) against raw sockets that misbehave on purpose: what it
sends, keep-alive reuse, streaming as bytes arrive, back pressure, timeouts, and every way vLLM can break the
exchange. The gateway-level behaviour on top of it (502/504, in-band stream errors, records) is in
test_gateway_faults.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.upstream.client import ConnectFailed, UpstreamError, UpstreamPool
from tests.support.pgcluster import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class RawServer:
    """A TCP server running `handler(reader, writer, connection_number)` per connection, counting connections and
    the requests (head + body) it read."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.hangups = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1/chat/completions"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self.connections)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client left, or the test is over
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """One request (head and content-length body), or None at EOF."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.hangups += 1
            return None
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        request = head + await reader.readexactly(length)
        self.requests.append(request)
        return request


def sized(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), extra, body
    )


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    pool = UpstreamPool({"content-type": "application/json", "authorization": "Bearer k"}, 2.0, 2.0)
    yield pool
    pool.close()


async def test_sends_one_request_and_reuses_the_connection(pool: UpstreamPool) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while (request := await server.read_request(reader)) is not None:
            writer.write(sized(b'{"echo":%d}' % len(request)))

    async with RawServer(answer) as server:
        host = server.url.split("/")[2]
        bodies = []
        for i in range(5):
            response = await pool.post(server.url, b'{"n":%d}' % i)
            assert response.status == 200 and response.headers["content-type"] == "application/json"
            bodies.append(await response.read())
            response.release()
    assert server.connections == 1  # keep-alive: five calls, one connection
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/chat/completions HTTP/1.1"
    assert set(lines[1:]) == {
        b"host: " + host.encode(),
        b"content-type: application/json",
        b"authorization: Bearer k",
        b"content-length: 7",
    }
    assert body == b'{"n":0}'
    assert bodies[0] == b'{"echo":%d}' % len(server.requests[0])


async def test_a_stream_arrives_as_it_is_written_not_when_it_ends(pool: UpstreamPool) -> None:
    go_on = asyncio.Event()

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(chunk(b"data: first\n\n"))
        await go_on.wait()  # the rest only once the client has the first event
        writer.write(chunk(b"data: second\n\n") + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await server.read_request(reader)
        writer.write(sized(b"next"))
        await writer.drain()

    async with RawServer(stream) as server:
        response = await pool.post(server.url, b"{}")
        received = []
        async for data in response.iter_chunks():
            received.append(data)
            go_on.set()
        response.release()
        assert received[0] == b"data: first\n\n"
        assert b"".join(received) == b"data: first\n\ndata: second\n\ndata: [DONE]\n\n"
        second = await pool.post(server.url, b"{}")  # the chunked response ended cleanly: the connection is reused
        assert await second.read() == b"next"
        second.release()
    assert server.connections == 1


async def test_a_slow_reader_pauses_vllm_and_loses_nothing(pool: UpstreamPool) -> None:
    pieces = [bytes([65 + i % 26]) * 65_536 for i in range(64)]  # 4 MiB, far past the pause threshold

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for piece in pieces:
            writer.write(chunk(piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with RawServer(stream) as server:
        response = await pool.post(server.url, b"{}")
        received = []
        async for data in response.iter_chunks():
            received.append(data)
            await asyncio.sleep(0.005)
        response.release()
    assert b"".join(received) == b"".join(pieces)
    # Reading paused while the client lagged: what piled up between two reads stayed near the 256 KiB threshold
    # (plus what the socket held) instead of the whole 4 MiB stream.
    assert max(len(data) for data in received) < 1024 * 1024


async def test_no_byte_within_the_read_timeout_is_a_timeout(pool: UpstreamPool) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await server.read_request(reader)
        await asyncio.sleep(10)

    fast = UpstreamPool({}, 2.0, 0.2)
    async with RawServer(silent) as server:
        with pytest.raises(TimeoutError):
            await fast.post(server.url, b"{}")
    fast.close()


async def test_a_stream_that_stalls_times_out_between_bytes(pool: UpstreamPool) -> None:
    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(3):  # bytes keep coming faster than the timeout: no timeout while they do
            writer.write(chunk(b"data: x\n\n"))
            await asyncio.sleep(0.1)
        await asyncio.sleep(10)

    fast = UpstreamPool({}, 2.0, 0.25)
    async with RawServer(stalls) as server:
        response = await fast.post(server.url, b"{}")
        received = []
        with pytest.raises(TimeoutError):
            async for data in response.iter_chunks():
                received.append(data)
        response.close()
    assert b"".join(received) == b"data: x\n\n" * 3
    fast.close()


async def test_nothing_listening_is_a_connect_failure(pool: UpstreamPool) -> None:
    with pytest.raises(ConnectFailed, match="cannot connect"):
        await pool.post(f"http://127.0.0.1:{free_port()}/v1/chat/completions", b"{}")


async def test_a_keep_alive_connection_vllm_closed_is_retried_on_a_new_one(pool: UpstreamPool) -> None:
    async def closes_the_second_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.read_request(reader)
        writer.write(sized(b"first" if n == 1 else b"again"))
        await writer.drain()
        if n == 1:  # the next request on this connection is dropped unanswered, as an idle close racing it would
            await reader.readuntil(b"\r\n\r\n")
            return

    async with RawServer(closes_the_second_request) as server:
        first = await pool.post(server.url, b"{}")
        assert await first.read() == b"first"
        first.release()
        second = await pool.post(server.url, b"{}")
        assert await second.read() == b"again"
        second.release()
    assert server.connections == 2


async def test_a_fresh_connection_closed_before_an_answer_is_an_error_not_a_retry(pool: UpstreamPool) -> None:
    async def hangs_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await server.read_request(reader)

    async with RawServer(hangs_up) as server:
        with pytest.raises(UpstreamError, match="closed the connection"):
            await pool.post(server.url, b"{}")
    assert server.connections == 1  # vLLM may have started generating: the call is not sent twice


async def test_a_body_cut_short_is_an_error_and_the_connection_is_not_reused(pool: UpstreamPool) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.read_request(reader)
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 50)
            return
        writer.write(sized(b"whole"))
        await server.read_request(reader)

    async with RawServer(cut) as server:
        response = await pool.post(server.url, b"{}")
        with pytest.raises(UpstreamError, match="before the response was complete"):
            await response.read()
        response.release()
        again = await pool.post(server.url, b"{}")
        assert await again.read() == b"whole"
        again.release()
    assert server.connections == 2


async def test_a_body_that_ends_with_the_connection(pool: UpstreamPool) -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n{\"a\":")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"1}")

    async with RawServer(until_close) as server:
        for _ in range(2):
            response = await pool.post(server.url, b"{}")
            assert await response.read() == b'{"a":1}'
            response.release()
    assert server.connections == 2  # `connection: close` is honoured


async def test_closing_mid_stream_hangs_up_on_vllm(pool: UpstreamPool) -> None:
    hung_up = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(chunk(b"data: 1\n\n"))
        await writer.drain()
        await reader.read()  # EOF: the client hung up, which is how vLLM learns to stop generating
        hung_up.set()

    async with RawServer(endless) as server:
        response = await pool.post(server.url, b"{}")
        async for data in response.iter_chunks():
            assert data == b"data: 1\n\n"
            break
        response.close()
        await asyncio.wait_for(hung_up.wait(), 5)


async def test_a_reply_that_is_not_http_is_an_error(pool: UpstreamPool) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await server.read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await asyncio.sleep(1)

    async with RawServer(garbage) as server:
        with pytest.raises(UpstreamError, match="malformed HTTP"):
            await pool.post(server.url, b"{}")


async def test_an_error_status_is_returned_with_its_body(pool: UpstreamPool) -> None:
    async def refuses(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await server.read_request(reader) is not None:
            body = b'{"error":{"message":"bad"}}'
            writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

    async with RawServer(refuses) as server:
        for _ in range(2):
            response = await pool.post(server.url, b"{}")
            assert response.status == 400 and await response.read() == b'{"error":{"message":"bad"}}'
            response.release()
    assert server.connections == 1


async def test_only_plain_http_urls(pool: UpstreamPool) -> None:
    with pytest.raises(ConnectFailed, match="only http://"):
        await pool.post("https://vllm.example/v1/chat/completions", b"{}")
