"""Engines and migrations: how every process reaches the database and brings it to the current schema."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event, func, select

# Postgres channel a committed ready group is announced on (payload: the run), so trainers wake at once.
READY_CHANNEL = "trajgate_ready"
MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
_IMMEDIATE = "trajgate_sqlite_immediate"


def _json_dumps(value: object) -> str:
    """JSON for a JSON column. Postgres JSONB cannot hold a NUL character (`\\u0000`), which a prompt can carry
    legitimately: it is stored as U+FFFD, on both backends alike, rather than the whole record being refused.
    The check is a byte search on the output, so values without one pay nothing more."""
    data = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    if b"\\u0000" in data:
        data = orjson.dumps(without_nul(value), option=orjson.OPT_NON_STR_KEYS)
    return data.decode()


def without_nul(value: object) -> object:
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {without_nul(k): without_nul(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_nul(item) for item in value]
    return value


def make_engine(url: str, **kwargs: object) -> Engine:
    """Create an engine tuned per backend.

    JSON columns are (de)serialised with orjson, several times faster than the stdlib json SQLAlchemy uses by
    default; keys that are not strings become strings, as with json.dumps.

    SQLite gets WAL (readers don't block the writer), a busy timeout (several processes share one file) and
    enforced foreign keys (off by default in SQLite, and they guard attribution). Its transactions are begun by
    SQLAlchemy rather than by the sqlite3 module, so `write_transaction` can ask for BEGIN IMMEDIATE.
    """
    kwargs.setdefault("json_serializer", _json_dumps)
    kwargs.setdefault("json_deserializer", orjson.loads)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False}, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()
            # Stop sqlite3 from issuing its own (deferred, DML-only) BEGIN; `_sqlite_begin` issues ours.
            dbapi_connection.isolation_level = None

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Connection) -> None:
            immediate = conn.get_execution_options().get(_IMMEDIATE, False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return engine
    kwargs.setdefault("pool_pre_ping", True)
    # No server-side prepared statements: psycopg prepares a statement after its 5th execution and Postgres then
    # keeps the generic plan it chose at that moment. The writer's statements join a batch against calls and
    # trajectories, and a plan chosen while those tables were nearly empty (a sequential scan) stays in use as they
    # grow to millions of rows. Planned per execution, each statement sees the tables' current size.
    kwargs.setdefault("connect_args", {"prepare_threshold": None})
    return create_engine(url, **kwargs)


@contextmanager
def write_transaction(engine: Engine) -> Iterator[Connection]:
    """A transaction for read-decide-write work (rewards, readiness, run config) that must not interleave with
    another one doing the same, across processes.

    On SQLite it starts with BEGIN IMMEDIATE: the database's one write lock is taken before the first read, so
    what the transaction reads cannot change before it writes (a deferred BEGIN would read a snapshot another
    writer can invalidate). On Postgres the caller locks the rows it decides on (SELECT ... FOR UPDATE).
    """
    with engine.connect() as conn:
        conn.execution_options(**{_IMMEDIATE: True})
        with conn.begin():
            yield conn


def notify_ready(conn: Connection, run: str) -> None:
    """Announce, on commit, that one of `run`'s groups became ready (Postgres only; SQLite trainers poll)."""
    if conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_notify(READY_CHANNEL, run)))


def alembic_config(url: str) -> Config:
    """Alembic configured in code, so `trajgate migrate` works from an installed package with no alembic.ini."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database to `revision`; running it again at head is a no-op."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
