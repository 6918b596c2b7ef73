"""Nothing lost: a database outage during a burst, and SIGTERM while calls are in flight."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.store import db
from tests.fake_upstream import FakeUpstream
from tests.gateway_harness import running_gateway
from tests.pgcluster import PgCluster, create_database, free_port
from tests.stored import count_calls
from tests.test_gateway_capture import client_body


@pytest.fixture
def own_cluster() -> Iterator[PgCluster]:
    """A Postgres this test may stop and start."""
    cluster = PgCluster()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.destroy()


def wait_for_count(url: str, expected: int, timeout_s: float = 30) -> int:
    deadline = time.monotonic() + timeout_s
    seen = -1
    while time.monotonic() < deadline:
        try:
            seen = count_calls(url)
        except Exception:  # the database may still be coming back
            seen = -1
        if seen >= expected:
            return seen
        time.sleep(0.2)
    return seen


async def _burst(url: str, body: dict, n: int, concurrency: int, on_half: object) -> list[int]:
    statuses: list[int] = []
    limit = asyncio.Semaphore(concurrency)

    async with httpx.AsyncClient(timeout=30) as client:

        async def one(i: int) -> None:
            async with limit:
                response = await client.post(url, json=body, headers={"X-Trajectory-Id": f"burst-{i}"})
                statuses.append(response.status_code)
                if len(statuses) == n // 2:
                    await asyncio.to_thread(on_half)  # type: ignore[arg-type]

        await asyncio.gather(*(one(i) for i in range(n)))
    return statuses


def test_database_outage_during_burst_loses_nothing(
    own_cluster: PgCluster, upstream: FakeUpstream, tmp_path: Path
) -> None:
    url = create_database(own_cluster.url())
    n = 300
    with running_gateway(
        database_url=url, upstream_url=upstream.base_url, base_model="smollm2", spool_dir=tmp_path / "spool"
    ) as gw:
        statuses = asyncio.run(
            _burst(gw.base_url + "/chat/completions", client_body(upstream.fixture("chat")), n, 16, own_cluster.stop)
        )
        assert statuses == [200] * n  # every request answered while the database was down
        gw.flush()
        assert gw.app.state.writer.records_spooled > 0  # the outage really hit the writer
        own_cluster.start()
        assert wait_for_count(url, n) == n
    assert count_calls(url) == n  # exactly once: nothing lost, nothing duplicated
    assert not any((tmp_path / "spool").glob("*.jsonl")) or all(
        p.stat().st_size == 0 for p in (tmp_path / "spool").glob("*.jsonl")
    )


def start_serve(upstream: FakeUpstream, sqlite_url: str, tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """`trajgate serve` as users run it, on a free port, once it answers /health."""
    db.upgrade(sqlite_url)
    port = free_port()
    env = {
        **os.environ,
        "TRAJGATE_DATABASE_URL": sqlite_url,
        "TRAJGATE_UPSTREAM_URL": upstream.base_url,
        "TRAJGATE_BASE_MODEL": "smollm2",
        "TRAJGATE_SPOOL_DIR": str(tmp_path / "spool"),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--log-level", "warning"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return process, port
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            raise AssertionError("gateway did not start")
        time.sleep(0.1)


def read_http_response(conn: socket.socket) -> bytes:
    """One whole response (head and its content-length body) off a raw connection: a single recv may return the
    head alone, and the body would then be read as the next response."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
    )
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_idle_keep_alive_connection_outlives_client_pools(
    upstream: FakeUpstream, sqlite_url: str, tmp_path: Path
) -> None:
    """A connection a client's pool kept idle for 6 s (httpx and the OpenAI SDK keep them 5 s) is still open:
    the server never closes one just as the client reuses it."""
    process, port = start_serve(upstream, sqlite_url, tmp_path)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            request = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
            for idle_s in (0, 6):
                time.sleep(idle_s)
                conn.sendall(request)
                reply = read_http_response(conn)
                assert reply.startswith(b"HTTP/1.1 200"), reply
    finally:
        process.terminate()
        process.wait(30)


def test_sigterm_mid_burst_finishes_calls_and_loses_nothing(
    upstream: FakeUpstream, sqlite_url: str, tmp_path: Path
) -> None:
    process, port = start_serve(upstream, sqlite_url, tmp_path)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        upstream.mode = "slow_stream"  # each stream takes ~2 s
        body = client_body(upstream.fixture("chat_stream"))
        n = 12

        async def stream_all() -> list[bytes]:
            async with httpx.AsyncClient(timeout=30) as client:

                async def one(i: int) -> bytes:
                    async with client.stream(
                        "POST", base + "/chat/completions", json=body, headers={"X-Trajectory-Id": f"term-{i}"}
                    ) as response:
                        return b"".join([chunk async for chunk in response.aiter_bytes()])

                async def terminate() -> None:
                    await asyncio.sleep(0.6)
                    process.send_signal(signal.SIGTERM)

                results = await asyncio.gather(*(one(i) for i in range(n)), terminate())
                return results[:n]  # type: ignore[return-value]

        outputs = asyncio.run(stream_all())
        assert all(out.rstrip().endswith(b"data: [DONE]") for out in outputs)  # in-flight calls finished
        # uvicorn re-raises the signal once its graceful shutdown is done, so -SIGTERM is a clean exit here.
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
        log = process.stdout.read().decode() if process.stdout else ""
        assert "Traceback" not in log, log
    finally:
        upstream.mode = "replay"
        if process.poll() is None:
            process.kill()
    assert count_calls(sqlite_url) == n
