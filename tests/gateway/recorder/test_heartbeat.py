"""The heartbeat other gateways wait on: each beat stores this gateway's row with the moment its writer has caught up
with, and deletes long-silent gateways' rows only when asked, which the gateway does once per alive window."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, insert, select

from gateway.http.metrics import GatewayMetrics
from gateway.recorder import heartbeat
from gateway.recorder.heartbeat import FORGET_AFTER_ALIVE, Peers
from gateway.recorder.writer import RecordWriter
from gateway.store import peers as store
from gateway.store.models import GatewayPeer


def _rows(engine: Engine) -> dict[str, tuple[float, int | None]]:
    with engine.connect() as conn:
        rows = conn.execute(select(GatewayPeer.gateway_id, GatewayPeer.seen_at, GatewayPeer.flushed_through))
        return {gateway_id: (seen_at, flushed) for gateway_id, seen_at, flushed in rows}


def test_a_beat_stores_the_moment_and_forgets_only_when_asked(engine: Engine) -> None:
    with engine.begin() as conn:
        now = store.clock(conn)
        conn.execute(insert(GatewayPeer).values(gateway_id="old", started_at=now - 2000, seen_at=now - 1000))
    moments: list[int] = []

    def flushed(moment: int) -> int:
        moments.append(moment)
        return moment

    store.beat(engine, "gw", flushed, None)
    rows = _rows(engine)
    assert set(rows) == {"gw", "old"}  # not asked to forget
    assert rows["gw"][1] == moments[0] and rows["gw"][0] >= now
    store.beat(engine, "gw", flushed, 500.0)
    rows = _rows(engine)
    assert set(rows) == {"gw"}  # silent for 1,000 s > 500 s
    assert moments[1] > moments[0] and rows["gw"][1] == moments[1]
    store.beat(engine, "gw", lambda _: None, None)  # no news: the published moment stays
    assert _rows(engine)["gw"][1] == moments[1]


def test_the_gateway_forgets_once_per_alive_window(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    asked: list[float | None] = []
    real_beat = store.beat

    def beat(*args: Any) -> None:
        asked.append(args[3])
        real_beat(*args)

    monkeypatch.setattr(heartbeat.store, "beat", beat)
    writer = RecordWriter(engine, tmp_path / "spool")
    try:
        peers = Peers(
            engine, writer, GatewayMetrics(), poll_s=0.1, alive_s=10.0, wait_s=1.0, writer_wait_s=1.0,
            clock=lambda: clock[0],
        )  # fmt: skip
        for step in (0.0, 0.1, 5.0, 9.9, 10.0, 10.1, 25.0):
            clock[0] = 1000.0 + step
            asyncio.run(peers.beat())
    finally:
        writer.close()
    forget = 10.0 * FORGET_AFTER_ALIVE
    assert asked == [forget, None, None, None, forget, None, forget]
    assert set(_rows(engine)) == {peers.gateway_id}
