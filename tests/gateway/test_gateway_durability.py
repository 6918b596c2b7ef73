"""Nothing lost: a database outage during a burst, and SIGTERM while calls are in flight."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from sqlalchemy import select, text

from gateway.app import build_state
from gateway.runs.settings import load_settings
from gateway.store import db
from gateway.store.call_record import CallRecord
from gateway.store.db import make_engine
from gateway.store.models import Call
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import running_gateway, start_serve
from tests.support.openai_calls import client_body
from tests.support.pgcluster import PgCluster, create_database, free_port
from tests.support.stored import count_calls
from tests.support.waiting import SocketReader, wait_until


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
    def seen() -> int:
        try:
            return count_calls(url)
        except Exception:  # the database may still be coming back
            return -1

    wait_until(lambda: seen() >= expected, timeout_s, f"{expected} calls stored")
    return seen()


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
        assert gw.app.state.writer.counters.records_spooled > 0  # the outage really hit the writer
        own_cluster.start()
        assert wait_for_count(url, n) == n
    assert count_calls(url) == n  # exactly once: nothing lost, nothing duplicated
    assert not any((tmp_path / "spool").glob("*.jsonl")) or all(
        p.stat().st_size == 0 for p in (tmp_path / "spool").glob("*.jsonl")
    )


def test_idle_keep_alive_connection_outlives_client_pools(
    upstream: FakeUpstream, sqlite_url: str, tmp_path: Path
) -> None:
    """A connection a client's pool kept idle for 6 s (httpx and the OpenAI SDK keep them 5 s) is still open:
    the server never closes one just as the client reuses it."""
    process, _, port = start_serve(upstream.base_url, sqlite_url, tmp_path / "spool")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            reader = SocketReader(conn)
            request = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
            for idle_s in (0, 6):
                time.sleep(idle_s)  # the idle time under test, not a wait for anything
                conn.sendall(request)
                head, body = reader.http_response(timeout_s=10)
                assert head.startswith(b"HTTP/1.1 200"), head
                assert json.loads(body)["status"] == "ok", body
            assert reader.buffer == b""  # nothing more was sent than the two responses
    finally:
        process.terminate()
        process.wait(30)


def test_sigterm_mid_burst_finishes_calls_and_loses_nothing(
    upstream: FakeUpstream, sqlite_url: str, tmp_path: Path
) -> None:
    process, output, port = start_serve(upstream.base_url, sqlite_url, tmp_path / "spool")
    base = f"http://127.0.0.1:{port}/v1"
    try:
        upstream.mode = "slow_stream"  # each stream takes ~2 s
        body = client_body(upstream.fixture("chat_stream"))
        n = 12

        async def stream_all() -> list[bytes]:
            streaming: list[int] = []
            all_streaming = asyncio.Event()
            async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=n)) as client:

                async def one(i: int) -> bytes:
                    async with client.stream(
                        "POST", base + "/chat/completions", json=body, headers={"X-Trajectory-Id": f"term-{i}"}
                    ) as response:
                        chunks = response.aiter_bytes()
                        first = await anext(chunks)  # the upstream stream has begun: this call is in flight
                        streaming.append(i)
                        if len(streaming) == n:
                            all_streaming.set()
                        return first + b"".join([chunk async for chunk in chunks])

                async def terminate() -> None:
                    await asyncio.wait_for(all_streaming.wait(), 30)
                    process.send_signal(signal.SIGTERM)

                results = await asyncio.gather(*(one(i) for i in range(n)), terminate())
                return results[:n]  # type: ignore[return-value]

        outputs = asyncio.run(stream_all())
        assert all(out.rstrip().endswith(b"data: [DONE]") for out in outputs)  # in-flight calls finished
        # uvicorn re-raises the signal once its graceful shutdown is done, so -SIGTERM is a clean exit here.
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
        log = output.finish()
        assert "Traceback" not in log, log
    finally:
        upstream.mode = "replay"
        if process.poll() is None:
            process.kill()
    assert count_calls(sqlite_url) == n


async def _answered_burst(
    base: str, bodies: tuple[dict, dict], n: int, concurrency: int, on_answered: int, kill: object
) -> set[str]:
    """Send n calls (every fourth a stream) and call `kill` once `on_answered` have been answered; the ids of the
    calls the client saw answered in full: a 200 body, or a stream through `data: [DONE]`."""
    answered: set[str] = set()
    killed = asyncio.Event()
    limit = asyncio.Semaphore(concurrency)
    plain, stream = bodies

    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency)) as client:

        async def one(i: int) -> None:
            async with limit:
                if killed.is_set():
                    return
                headers = {"X-Trajectory-Id": f"kill-{i}"}
                try:
                    if i % 4 == 3:
                        async with client.stream("POST", base, json=stream, headers=headers) as response:
                            body = b"".join([chunk async for chunk in response.aiter_bytes()])
                            ok = response.status_code == 200 and body.rstrip().endswith(b"data: [DONE]")
                    else:
                        response = await client.post(base, json=plain, headers=headers)
                        ok = response.status_code == 200 and bool(response.json()["choices"])
                except (httpx.HTTPError, ValueError):
                    return  # cut by the kill: never answered
                if ok and not killed.is_set():
                    answered.add(response.headers["x-request-id"])
                    if len(answered) >= on_answered:
                        killed.set()
                        await asyncio.to_thread(kill)  # type: ignore[arg-type]

        await asyncio.gather(*(one(i) for i in range(n)))
    return answered


def _stored_ids(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return set(conn.execute(select(Call.id)).scalars())
    finally:
        engine.dispose()


def _sigkill_mid_burst(
    upstream: FakeUpstream, url: str, spool: Path, n: int, kill_after: int, stall: bool
) -> tuple[set[str], set[str]]:
    """Run a burst against `trajgate serve`, SIGKILL it after `kill_after` answers (with writes to `calls` blocked
    by a held lock if `stall`), restart it on the same spool dir and return (answered ids, stored ids)."""
    bodies = (client_body(upstream.fixture("chat")), client_body(upstream.fixture("chat_stream")))
    upstream.mode = "replay"
    process, output, port = start_serve(upstream.base_url, url, spool)
    blocker = make_engine(url)
    conn = blocker.connect()
    try:
        if stall:
            conn.execute(text("LOCK TABLE calls IN ACCESS EXCLUSIVE MODE"))  # held until rollback: writes wait
        answered = asyncio.run(
            _answered_burst(f"http://127.0.0.1:{port}/v1/chat/completions", bodies, n, 32, kill_after, process.kill)
        )
        assert process.wait(30) == -signal.SIGKILL
        output.finish()
    finally:
        conn.rollback()
        conn.close()
        blocker.dispose()
        if process.poll() is None:
            process.kill()
    assert len(answered) >= kill_after
    successor, successor_output, _ = start_serve(upstream.base_url, url, spool)
    try:
        with contextlib.suppress(AssertionError):  # the test's assertion says how many are missing
            wait_until(lambda: answered <= _stored_ids(url), 30, "every answered call stored after the restart")
    finally:
        successor.terminate()
        successor.wait(30)
        log = successor_output.finish()
    assert "Traceback" not in log, log
    return answered, _stored_ids(url)


def test_sigkill_mid_burst_with_a_healthy_database_loses_no_answered_call(
    upstream: FakeUpstream, pg_url: str, tmp_path: Path
) -> None:
    answered, stored = _sigkill_mid_burst(upstream, pg_url, tmp_path / "spool", 1200, 800, stall=False)
    assert not answered - stored, f"{len(answered - stored)} of {len(answered)} answered calls lost"


def test_sigkill_while_the_database_is_stalled_loses_no_answered_call(
    upstream: FakeUpstream, pg_url: str, tmp_path: Path
) -> None:
    """Writes to `calls` block on a lock, so every answered call is still in the writer's hands when it dies."""
    answered, stored = _sigkill_mid_burst(upstream, pg_url, tmp_path / "spool", 800, 600, stall=True)
    assert not answered - stored, f"{len(answered - stored)} of {len(answered)} answered calls lost"


@pytest.mark.parametrize(
    ("mode", "stream", "hang_up"),
    [
        ("replay", False, False),
        ("error500", False, False),
        ("unreachable", False, False),
        ("replay", True, False),
        ("cut_stream", True, False),
        ("slow_stream", True, True),
    ],
)
async def test_every_answer_completes_only_after_its_record_is_logged(
    upstream: FakeUpstream, sqlite_url: str, tmp_path: Path, mode: str, stream: bool, hang_up: bool
) -> None:
    """Whatever the outcome (an answer, an upstream error, a broken stream, a client that leaves), the record is
    in the write-ahead log before the client is sent the end of the answer, `[DONE]`, or an error."""
    upstream_url = f"http://127.0.0.1:{free_port()}/v1" if mode == "unreachable" else upstream.base_url
    state = build_state(load_settings(_env_file=None, database_url=sqlite_url, upstream_url=upstream_url,
                                      base_model="smollm2", spool_dir=tmp_path / "spool"))  # fmt: skip
    events: list[str] = []
    real_submit = state.writer.submit

    def submit(record: CallRecord) -> None:
        real_submit(record)
        events.append("logged")

    state.writer.submit = submit  # type: ignore[method-assign]
    body = orjson.dumps(client_body(upstream.fixture("chat_stream" if stream else "chat")))
    first_chunk = asyncio.Event()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        if hang_up:
            await first_chunk.wait()
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        if message["type"] != "http.response.body":
            return
        data = message.get("body", b"")
        if not message.get("more_body", False):
            events.append("end")
        elif b"[DONE]" in data:
            events.append("done")
        elif b'"error"' in data:
            events.append("error")
        else:
            events.append("chunk")
            first_chunk.set()

    upstream.mode = "replay" if mode == "unreachable" else mode
    db.upgrade(sqlite_url)
    await state.proxy.start()
    try:
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
        await asyncio.wait_for(state.proxy.handle(scope, receive, send, None), 30)
    finally:
        upstream.mode = "replay"
        await state.proxy.close()
        state.writer.close()
        state.engine.dispose()
    assert "logged" in events and events[-1] == "end", events
    first_sign_of_an_end = min(events.index(kind) for kind in ("done", "error", "end") if kind in events)
    assert events.index("logged") < first_sign_of_an_end, events
    if mode == "cut_stream":
        assert "error" in events  # the broken stream was told in-band
    assert state.writer.counters.records_logged == 1
