"""Persisting captured calls: the one statement path every record takes into the database.

Writes are upserts so the same record can arrive more than once (spool replay after a crash between commit and
delete, a batch re-spooled after a partial failure) and still leave exactly one row, and so a client's retry of a
call (same trajectory and seq) replaces the attempt it retried. The newest attempt (by created_at) wins whatever
order they arrive in, because a record that spilled to the spool can reach the database after its retry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import cache
from typing import Any, NamedTuple, cast

from sqlalchemy import Connection, Engine, Executable, Table, bindparam, func, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError

from gateway.records import CallRecord
from gateway.store.arrays import encode_ids, encode_logprobs
from gateway.store.models import Call, Group, Run, Trajectory

_runs = cast(Table, Run.__table__)
_groups = cast(Table, Group.__table__)
_trajectories = cast(Table, Trajectory.__table__)
_calls = cast(Table, Call.__table__)
_CALL_KEY = ("trajectory_id", "seq", "choice_index")


class _Statements(NamedTuple):
    runs: Executable
    groups: Executable
    trajectories: Executable
    calls: Executable
    untrainable: Executable
    reopen: Executable


@cache
def _statements(dialect: str) -> _Statements:
    """Built once per dialect: ON CONFLICT is dialect syntax, and rebuilding the constructs per batch costs more
    than the tiny batches the writer sends when traffic is light."""
    insert: Callable[..., Any] = postgresql.insert if dialect == "postgresql" else sqlite.insert

    groups = insert(_groups)
    # A later call may be the first to carry the group size; never overwrite a size already known.
    groups = groups.on_conflict_do_update(
        index_elements=["group_id"],
        set_={"expected_size": groups.excluded.expected_size},
        where=_groups.c.expected_size.is_(None) & groups.excluded.expected_size.is_not(None),
    )

    calls = insert(_calls)
    calls = calls.on_conflict_do_update(
        index_elements=list(_CALL_KEY),
        set_={c.name: calls.excluded[c.name] for c in _calls.columns if c.name not in _CALL_KEY},
        # A record replayed late from the spool must not roll back a newer attempt already written directly.
        where=_calls.c.created_at <= calls.excluded.created_at,
    )

    untrainable_count = (
        select(func.count())
        .select_from(_calls)
        .where(_calls.c.trajectory_id == _trajectories.c.trajectory_id, _calls.c.trainable.is_(False))
        .scalar_subquery()
    )
    untrainable = (
        update(_trajectories)
        .where(
            _trajectories.c.trajectory_id.in_(bindparam("ids", expanding=True)),
            # Skip rows whose count is unchanged: on Postgres every UPDATE leaves a dead tuple behind.
            _trajectories.c.untrainable_calls != untrainable_count,
        )
        .values(untrainable_calls=untrainable_count)
    )
    # A trajectory that joins a ready group (more than the expected size, or after a close) has no reward yet, so
    # the group is no longer ready; its reward will make it ready again (see gateway.store.rewards). One that joins
    # a trained or dropped group reopens it the same way, and the group's next claim trains only what no step has
    # trained (a claimed group is reopened when its step ends: gateway.store.training).
    unrewarded = (
        select(_trajectories.c.trajectory_id)
        .where(_trajectories.c.group_id == _groups.c.group_id, _trajectories.c.reward.is_(None))
        .exists()
    )
    reopen = (
        update(_groups)
        .where(
            _groups.c.group_id.in_(bindparam("group_ids", expanding=True)),
            _groups.c.state.in_(("ready", "trained", "dropped")),
            unrewarded,
        )
        .values(state="open", ready_at=None)
    )
    return _Statements(
        runs=insert(_runs).on_conflict_do_nothing(index_elements=["name"]),
        groups=groups,
        trajectories=insert(_trajectories).on_conflict_do_nothing(index_elements=["trajectory_id"]),
        calls=calls,
        untrainable=untrainable,
        reopen=reopen,
    )


def _call_row(record: CallRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "trajectory_id": record.trajectory_id,
        "seq": record.seq,
        "choice_index": record.choice_index,
        "run": record.run,
        "policy_version": record.policy_version,
        "endpoint": record.endpoint,
        "stream": record.stream,
        "request": record.request,
        "response": record.response,
        "prompt_token_ids": encode_ids(record.prompt_token_ids),
        "completion_token_ids": encode_ids(record.completion_token_ids),
        "completion_logprobs": encode_logprobs(record.completion_logprobs),
        "finish_reason": record.finish_reason,
        "usage": record.usage,
        "status_code": record.status_code,
        "error": record.error,
        "trainable": record.trainable,
        "untrainable_reason": record.untrainable_reason,
        "latency_ms": record.latency_ms,
        "ttft_ms": record.ttft_ms,
        "retry_count": record.retry_count,
        "idempotency_key": record.idempotency_key,
        "created_at": datetime.fromtimestamp(record.created_at, UTC),
    }


def write_calls(engine: Engine, records: Sequence[CallRecord]) -> None:
    """Upsert the records and the runs, groups and trajectories they name, all in one transaction.

    One transaction per batch so a failure leaves nothing half-written and the whole batch can simply be
    retried or spooled. Rows are sent sorted by key so concurrent writers (several gateway processes) lock
    shared group and trajectory rows in the same order and do not deadlock each other.
    """
    if not records:
        return
    latest: dict[tuple[str, int, int], CallRecord] = {}
    for record in records:
        # Postgres refuses an ON CONFLICT that touches one row twice in a statement. Keep the newest attempt (the
        # later one on a tie), the same rule the upsert applies to rows already stored.
        key = (record.trajectory_id, record.seq, record.choice_index)
        if key not in latest or record.created_at >= latest[key].created_at:
            latest[key] = record
    calls = [latest[key] for key in sorted(latest)]

    runs: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Any]] = {}
    trajectories: dict[str, dict[str, Any]] = {}
    for record in calls:
        runs.setdefault(record.run, {"name": record.run, "base_model": record.base_model, "config": {}})
        group = groups.setdefault(
            record.group_id,
            {"group_id": record.group_id, "run": record.run, "mode": record.mode, "expected_size": None},
        )
        if group["expected_size"] is None:
            group["expected_size"] = record.group_size
        trajectory = trajectories.setdefault(
            record.trajectory_id,
            {
                "trajectory_id": record.trajectory_id,
                "run": record.run,
                "group_id": record.group_id,
                "mode": record.mode,
                "created_at": record.created_at,
            },
        )
        # A trajectory starts with its first call, not when a batch happened to write it (exports use this order).
        trajectory["created_at"] = min(trajectory["created_at"], record.created_at)

    statements = _statements(engine.dialect.name)
    with engine.begin() as conn:
        with _prepared(conn):
            conn.execute(statements.runs, [runs[k] for k in sorted(runs)])
            conn.execute(statements.groups, [groups[k] for k in sorted(groups)])
            conn.execute(
                statements.trajectories,
                [
                    {**row, "created_at": datetime.fromtimestamp(row["created_at"], UTC)}
                    for _, row in sorted(trajectories.items())
                ],
            )
            conn.execute(statements.calls, [_call_row(record) for record in calls])
        conn.execute(statements.reopen, {"group_ids": sorted(groups)})
        conn.execute(statements.untrainable, {"ids": sorted(trajectories)})


@contextmanager
def _prepared(conn: Connection) -> Iterator[None]:
    """Let Postgres keep server-side prepared plans for the plain upserts, which read no other table, instead of
    parsing and planning the 24-column calls upsert for every row (bench/capture_write.py: ~4,000 -> ~6,100 rows/s
    from this alone). Statements that join (the reopen and untrainable updates) stay unprepared: see make_engine."""
    driver = conn.connection.driver_connection if conn.dialect.name == "postgresql" else None
    if driver is None:
        yield
        return
    driver.prepare_threshold = 0
    try:
        yield
    finally:
        driver.prepare_threshold = None


def count_calls(engine: Engine, trajectory_id: str | None = None) -> int:
    """Rows in `calls`, optionally for one trajectory: what tests and operators check after a flush or replay."""
    query = select(func.count()).select_from(_calls)
    if trajectory_id is not None:
        query = query.where(_calls.c.trajectory_id == trajectory_id)
    with engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


def ping(engine: Engine) -> bool:
    """Whether the database answers now; never raises, so the writer's retry loop and /ready can poll it freely."""
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return True
    except SQLAlchemyError:
        return False
