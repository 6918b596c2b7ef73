"""Connection limits (issue 11): oversized headers, slow and idle connections, too many connections. Each is a clear
OpenAI-style answer or a closed connection, never a held resource and never a forwarded call."""

from __future__ import annotations

import json
import socket
import time

import httpx

from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import running_gateway
from tests.support.stored import count_calls
from tests.support.waiting import SocketReader, wait_until


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _status_and_error(conn: socket.socket) -> tuple[int, dict[str, object]]:
    """The status and OpenAI-style error of the next whole response on `conn`."""
    head, body = SocketReader(conn).http_response(timeout_s=10)
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]


def _closed_by_server(conn: socket.socket, deadline_s: float) -> bool:
    """Whether the server closes the connection (EOF) within the deadline, reading and discarding what it sends."""
    conn.settimeout(deadline_s)
    end = time.monotonic() + deadline_s
    try:
        while time.monotonic() < end:
            if conn.recv(65536) == b"":
                return True
    except (TimeoutError, ConnectionResetError):
        return False
    return False


def test_an_8_mib_header_is_431_before_the_app_sees_it(gateway_settings: dict[str, object]) -> None:
    with running_gateway(**gateway_settings) as gw, _connect(gw.port) as conn:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (8 * 1024 * 1024) + b"\r\n\r\n"
        try:
            conn.sendall(head)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may stop reading once it has answered; the answer is what counts
        status, error = _status_and_error(conn)
    assert status == 431 and error["code"] == "request_header_fields_too_large"


def test_headers_sent_a_byte_at_a_time_are_408_after_the_read_timeout(
    gateway_settings: dict[str, object], upstream: FakeUpstream, db_url: str
) -> None:
    before = len(upstream.received)
    with running_gateway(**{**gateway_settings, "request_read_timeout_s": 1.0}) as gw, _connect(gw.port) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        status, error = _status_and_error(conn)
        assert status == 408 and error["code"] == "request_timeout"
        assert _closed_by_server(conn, 10)
    assert len(upstream.received) == before


def test_a_body_that_never_finishes_is_closed_and_not_forwarded(
    gateway_settings: dict[str, object], upstream: FakeUpstream, db_url: str
) -> None:
    before = len(upstream.received)
    with running_gateway(**{**gateway_settings, "request_read_timeout_s": 1.0}) as gw:
        with _connect(gw.port) as conn:
            conn.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n{\"model\": \"r\""
            )
            assert _closed_by_server(conn, 10)
        gw.flush()
    assert len(upstream.received) == before
    assert count_calls(db_url) == 0


def test_a_connection_that_never_sends_a_request_is_closed_after_the_keep_alive(
    gateway_settings: dict[str, object],
) -> None:
    with running_gateway(**{**gateway_settings, "keep_alive_s": 1.0}) as gw, _connect(gw.port) as conn:
        assert _closed_by_server(conn, 10)


def test_connections_over_the_cap_get_an_openai_style_503(gateway_settings: dict[str, object]) -> None:
    with running_gateway(**{**gateway_settings, "max_connections": 2}) as gw:
        held = [_connect(gw.port), _connect(gw.port)]
        with _connect(gw.port) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, error = _status_and_error(extra)
        assert status == 503 and error["code"] == "too_many_connections"
        for conn in held:
            conn.close()
        # The server notices the closes asynchronously.
        wait_until(lambda: httpx.get(gw.url + "/health").status_code == 200, 10, "the gateway to accept connections again")
