"""Several gateway processes on one Postgres, no sticky sessions: a reward, close or judge request reaching any
gateway counts every call answered before it, whichever gateway answered it.

A call's record reaches the database through its own gateway's asynchronous writer, so a reward posted to gateway A
right after the episode's last call was answered by gateway B can overtake that call: it would find the trajectory
unknown (404), or make the group ready without its last call. Waiting on B's writer needs B to say how far it got.

Each gateway keeps a row in `gateway_peers` (gateway.store.peers) and beats every `TRAJGATE_PEER_POLL_S`: one
transaction that takes a moment `t` (the next value of a Postgres sequence: a moment taken later is always larger)
and publishes, as `flushed_through`, `t` itself if every record submitted so far is in the database (an idle
writer), else an earlier beat's `t` once every record submitted before that beat is. A record is submitted before
its call is answered (the write-ahead log comes first), so when B publishes `flushed_through > T`, every call B
answered before moment T was taken is written. A request for rewards (or close, or judge) takes a moment T when it
arrives and waits, polling, until every other gateway seen in the last `TRAJGATE_PEER_ALIVE_S` has
`flushed_through > T` (this gateway's own writer it flushes directly). One sequence orders everything, so gateways
need not agree on a clock, and none can be stepped back.

The wait is bounded by `TRAJGATE_PEER_WAIT_S`: a writer behind by seconds (a burst, a slow disk) delays the reward by
as much, and past the bound the request is refused with a 503 the client retries, having stored nothing: a group is
never made ready on one gateway's word while another live one may still hold its last call. A gateway that stops
cleanly removes its row after its last write; one that dies stops beating
and is no longer waited for after `TRAJGATE_PEER_ALIVE_S` (its answered calls are in its spool and replayed when it
starts again). Postgres only: several gateways on one SQLite file do not wait for each other.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from gateway.http.errors import GatewayError
from gateway.http.metrics import GatewayMetrics
from gateway.recorder.writer import RecordWriter
from gateway.store import peers as store

log = logging.getLogger("trajgate.peers")

# Rows of gateways silent for this many alive-windows are deleted (one killed without removing its own).
FORGET_AFTER_ALIVE = 100
# A request refused because some writer is behind says when to retry: the wait it already made bounds the backlog.
RETRY_AFTER_S = 1


class Peers:
    """This gateway's heartbeat on the database, and the wait for every other gateway's writer."""

    def __init__(
        self,
        engine: Engine,
        writer: RecordWriter,
        metrics: GatewayMetrics,
        poll_s: float,
        alive_s: float,
        wait_s: float,
        writer_wait_s: float,
        routes_read_at: Callable[[], float | None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gateway_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"[-128:]
        self.enabled = engine.dialect.name == "postgresql"
        self._engine = engine
        self._writer = writer
        self._metrics = metrics
        self._poll_s = poll_s
        self._alive_s = alive_s
        self._wait_s = wait_s
        self._writer_wait_s = writer_wait_s
        self._routes_read_at = routes_read_at
        # A beat's moment and the writer's mark taken right after it: published once the mark is reached.
        self._pending: tuple[int, int] | None = None
        self._failing = False
        self._clock = clock  # what the window between two deletes of long-silent gateways' rows is timed on
        self._forget_at = 0.0  # on that clock: the next beat that deletes them

    async def beat(self) -> None:
        """One heartbeat; a database that is away is logged once and tried again at the next beat."""
        forget_after_s = None
        now = self._clock()
        if now >= self._forget_at:  # once per alive window: the rows it deletes are 100 windows old
            forget_after_s = self._alive_s * FORGET_AFTER_ALIVE
            self._forget_at = now + self._alive_s
        try:
            await asyncio.to_thread(
                store.beat, self._engine, self.gateway_id, self._flushed_through, forget_after_s,
                self._routes_read_at(),
            )
        except SQLAlchemyError as exc:
            if not self._failing:
                log.warning("cannot tell other gateways how far this one's writer got: %s", type(exc).__name__)
            self._failing = True
            return
        self._failing = False

    def _flushed_through(self, now: int) -> int | None:
        """Called by the beat right after it took the moment `now`: the latest moment before which this gateway can
        say every call it answered is written. A writer with nothing outstanding is caught up with `now` itself (so
        an idle gateway holds a reward up for one beat at most); a busy one with an earlier beat's moment once the
        records submitted before that beat are written."""
        writer = self._writer
        mark = writer.mark()  # taken after `now`: counts every record submitted before it
        if not writer.db_up:
            return None  # records in the log only are not in the database yet
        if writer.reached(mark):
            self._pending = None
            return now
        pending = self._pending
        published = pending[0] if pending is not None and writer.reached(pending[1]) else None
        if pending is None or published is not None:
            self._pending = (now, mark)
        return published

    async def beat_forever(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(self._poll_s)

    def leave(self) -> None:
        """Called once this gateway's writer has closed: other gateways stop waiting for it."""
        if not self.enabled:
            return
        try:
            store.leave(self._engine, self.gateway_id)
        except SQLAlchemyError as exc:
            log.warning("cannot remove this gateway from gateway_peers (%s): others wait for it until it is "
                        "silent for %.0f s", type(exc).__name__, self._alive_s)  # fmt: skip

    async def settled(self) -> None:
        """Wait until every call answered before now, by this gateway or any other live one, is in the database,
        at most `TRAJGATE_WRITER_WAIT_S` for this gateway's writer and `TRAJGATE_PEER_WAIT_S` for the others'.
        Raises a 503 GatewayError when one of them has not caught up by then: the request would otherwise find a
        trajectory unknown (a 404 for one just answered) or make its group ready without its last call."""
        await asyncio.gather(self._own_caught_up(), self._others_caught_up())

    async def _own_caught_up(self) -> None:
        if await self._writer.settled(self._writer_wait_s):
            return
        self._metrics.writer_wait_timeouts.inc()
        message = (
            f"this gateway has not yet stored the calls it answered before this request ({self._writer_wait_s:g} s, "
            "TRAJGATE_WRITER_WAIT_S): nothing was stored; retry later"
        )
        log.warning("refused a request after %.1f s waiting for this gateway's writer (TRAJGATE_WRITER_WAIT_S)",
                    self._writer_wait_s)  # fmt: skip
        raise GatewayError(503, message, "server_error", "calls_not_written", retry_after_s=RETRY_AFTER_S)

    async def others_written(self, wait_s: float) -> bool:
        """Whether, within `wait_s`, every other live gateway (if any) wrote every call it answered before now
        (token_in's predecessor lookup reads once more then: a record not yet written would be missed). False when
        peers are off (SQLite) or a gateway is still behind at the deadline."""
        if not self.enabled or wait_s <= 0:
            return False
        return not await others_caught_up(self._engine, self.gateway_id, self._poll_s, self._alive_s, wait_s)

    async def _others_caught_up(self) -> None:
        if not self.enabled or self._wait_s <= 0:
            return
        started = time.monotonic()
        behind = await others_caught_up(self._engine, self.gateway_id, self._poll_s, self._alive_s, self._wait_s)
        self._metrics.peer_wait.observe(time.monotonic() - started)
        if behind:
            self._metrics.peer_wait_timeouts.inc()
            message = (
                f"gateway(s) {', '.join(behind)} have not yet written the calls they answered before this request "
                f"({self._wait_s:g} s, TRAJGATE_PEER_WAIT_S): nothing was stored; retry later"
            )
            raise GatewayError(503, message, "server_error", "gateways_behind", retry_after_s=RETRY_AFTER_S)


async def others_caught_up(engine: Engine, own_id: str, poll_s: float, alive_s: float, wait_s: float) -> list[str]:
    """Wait until every gateway but `own_id` seen in the last `alive_s` seconds has written every call it answered
    before now (a moment taken on the database), at most `wait_s`. Returns the gateways still behind then (logged),
    [] when all caught up or the database cannot say (the caller's own statements meet the same database and fail
    there: a 503 of their own)."""
    if engine.dialect.name != "postgresql" or wait_s <= 0:
        return []
    started = time.monotonic()
    try:
        moment, behind = await asyncio.to_thread(store.behind, engine, own_id, None, alive_s)
        while behind and time.monotonic() - started < wait_s:
            await asyncio.sleep(poll_s / 2)
            _, behind = await asyncio.to_thread(store.behind, engine, own_id, moment, alive_s)
    except SQLAlchemyError:
        return []
    if behind:
        log.warning(
            "gave up after %.1f s waiting for gateway(s) %s to write the calls they answered (TRAJGATE_PEER_WAIT_S)",
            wait_s, ", ".join(behind),
        )  # fmt: skip
    return behind
