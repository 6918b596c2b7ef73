"""The statements behind gateway/recorder/heartbeat.py: each gateway's heartbeat row in `gateway_peers`, and which other live
gateways have not yet written every call they answered before a given moment.

A moment is a value of the Postgres sequence `gateway_peers_moment`: one taken after another is larger, whichever
session took it, so "answered before the reward arrived" means the same on every gateway, with no clock to agree
on (a wall clock can be stepped back; a sequence cannot). Liveness (`seen_at`) is the database's clock, in
seconds.
On SQLite (one host; gateways there do not wait for each other) a moment is that host's clock in microseconds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, cast

from sqlalchemy import BigInteger, ColumnElement, Connection, Engine, Float, Table, bindparam, delete, func, select
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects import postgresql, sqlite

from gateway.store.models import GatewayPeer

_peers = cast(Table, GatewayPeer.__table__)
MOMENTS = "gateway_peers_moment"


def _clock(dialect: str) -> ColumnElement[float]:
    """Seconds since the epoch, as the database sees them now (not at the start of the transaction)."""
    if dialect == "postgresql":
        return sql_cast(func.extract("epoch", func.clock_timestamp()), Float)
    return (func.julianday("now") - 2440587.5) * 86400.0


def _moment(dialect: str) -> ColumnElement[int]:
    if dialect == "postgresql":
        return func.nextval(MOMENTS)
    return sql_cast((func.julianday("now") - 2440587.5) * 86_400_000_000, BigInteger)


# The heartbeat's statements are built once per dialect: built ten times a second, their constructs were reference
# cycles the gateway's cyclic garbage collector had to find, with pauses on the hot path.
@functools.cache
def _clock_query(dialect: str) -> Any:
    return select(_clock(dialect))


@functools.cache
def _moment_query(dialect: str) -> Any:
    return select(_moment(dialect))


@functools.cache
def _clock_and_moment_query(dialect: str) -> Any:
    return select(_clock(dialect), _moment(dialect))


@functools.cache
def _beat_statements(dialect: str, with_flushed: bool) -> tuple[Any, Any]:
    insert = (postgresql.insert if dialect == "postgresql" else sqlite.insert)(_peers)
    updates: dict[str, Any] = {"seen_at": insert.excluded.seen_at, "routes_read_at": insert.excluded.routes_read_at}
    if with_flushed:
        updates["flushed_through"] = insert.excluded.flushed_through
    upsert = insert.on_conflict_do_update(index_elements=["gateway_id"], set_=updates)
    forget = delete(_peers).where(_peers.c.seen_at < bindparam("before"))
    return upsert, forget


def clock(conn: Connection) -> float:
    """The database's time now, in seconds since the epoch."""
    return float(conn.execute(_clock_query(conn.dialect.name)).scalar_one())


def moment(conn: Connection) -> int:
    """A new moment: larger than every moment taken before this call began, on any connection."""
    return int(conn.execute(_moment_query(conn.dialect.name)).scalar_one())


def beat(
    engine: Engine,
    gateway_id: str,
    flushed_through: Callable[[int], int | None],
    forget_after_s: float | None,
    routes_read_at: float | None = None,
) -> None:
    """Say this gateway is alive, how far its writer got, and when it last read its route table: `flushed_through
    (moment)`, called with a moment taken at the beat, returns a moment before which every call this gateway answered
    is written (or None: no news); `routes_read_at` is the database's clock before that read (`routes_behind`). With
    `forget_after_s`, rows of gateways silent that long are deleted (a process killed without a chance to remove its
    own); the caller asks for that now and then, not at every beat.

    Ten beats a second, whether or not the gateway is busy, so each is two statements in autocommit (the clock and
    the moment in one): a transaction of four statements cost ~1.2 ms of the gateway's CPU a beat, this ~0.6-0.7
    (bench/README.md, "the heartbeat"). Nothing needs the beat's statements to be atomic: the moment is a sequence's
    value, taken outside any transaction's rollback, and the row is one upsert."""
    with _autocommit(engine) as conn:
        now, taken = conn.execute(_clock_and_moment_query(conn.dialect.name)).one()
        now = float(now)
        flushed = flushed_through(int(taken))
        upsert, forget = _beat_statements(conn.dialect.name, flushed is not None)
        row = {"gateway_id": gateway_id, "started_at": now, "seen_at": now, "flushed_through": flushed,
               "routes_read_at": routes_read_at}  # fmt: skip
        conn.execute(upsert, row)
        if forget_after_s is not None:
            conn.execute(forget, {"before": now - forget_after_s})


def _autocommit(engine: Engine) -> AbstractContextManager[Connection]:
    """A connection whose statements commit one by one, on Postgres. SQLite keeps a transaction: its BEGIN is
    issued by an event handler (gateway.store.db), which AUTOCOMMIT would leave open."""
    if engine.dialect.name == "postgresql":
        return engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    return engine.begin()


def behind(engine: Engine, gateway_id: str, at: int | None, alive_s: float) -> tuple[int, list[str]]:
    """The other gateways seen in the last `alive_s` seconds whose writers have not yet caught up with the moment
    `at` (None: a new moment), and that moment. A gateway has caught up with a moment when every call it answered
    before it is in the database."""
    with engine.connect() as conn:
        now = clock(conn)
        if at is None:
            at = moment(conn)
        rows = conn.execute(
            select(_peers.c.gateway_id)
            .where(
                _peers.c.gateway_id != gateway_id,
                _peers.c.seen_at > now - alive_s,
                func.coalesce(_peers.c.flushed_through, 0) <= at,
            )
            .order_by(_peers.c.gateway_id)
        )
        return at, list(rows.scalars())


def leave(engine: Engine, gateway_id: str) -> None:
    """Remove this gateway's row after its last records are written: no one waits for a gateway that stopped."""
    with engine.begin() as conn:
        conn.execute(delete(_peers).where(_peers.c.gateway_id == gateway_id))


def routes_behind(conn: Connection, since: float, alive_s: float) -> list[str]:
    """The gateways seen in the last `alive_s` seconds that have not read their route table since the database's
    clock said `since` (they may still route to what was retired then), at most `alive_s` after `since`: a gateway
    that cannot reload its routes for that long is waited for no longer than a silent one (a call it then routes to
    an unloaded adapter is sent again by its proxy to the run's version)."""
    now = clock(conn)
    if now - since > alive_s:
        return []
    rows = conn.execute(
        select(_peers.c.gateway_id)
        .where(
            _peers.c.seen_at > now - alive_s,
            func.coalesce(_peers.c.routes_read_at, 0.0) <= since,
        )
        .order_by(_peers.c.gateway_id)
    )
    return list(rows.scalars())
