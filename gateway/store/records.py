"""Persisting captured calls: the one statement path every record takes into the database.

Writes are upserts so the same record can arrive more than once (spool replay after a crash between commit and
delete, a batch re-spooled after a partial failure) and still leave exactly one row. A client's retry of a call
replaces the attempt it retried: which stored rows an incoming attempt belongs with is decided here, in the writer's
transaction, by content (gateway.store.attempts), so it does not matter which gateway process saw which attempt. The
newest attempt (by created_at) wins whatever order they arrive in, because a record that spilled to the spool can
reach the database after its retry.
"""

from __future__ import annotations

import binascii
import math
import threading
import weakref
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import cache, partial
from typing import Any, NamedTuple, cast

import orjson
from psycopg.pq import ExecStatus
from sqlalchemy import (
    JSON,
    ColumnElement,
    Connection,
    Dialect,
    Engine,
    Executable,
    Float,
    LargeBinary,
    String,
    Table,
    Text,
    any_,
    bindparam,
    column,
    delete,
    func,
    literal_column,
    null,
    select,
    text,
    update,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.types import UserDefinedType

from gateway.store.arrays import PackedArrays, decode_ids, encode_ids, pack_arrays
from gateway.store.attempts import Attempt, Settlement, request_hash, settle
from gateway.store.call_record import CallRecord
from gateway.store.courtesy import give_way
from gateway.store.db import without_nul
from gateway.store.lineage import EXTENDS, FIRST_CALL, Lineage, Predecessor, StoredCall, StoredCalls, classify
from gateway.store.messages import (
    compact_request,
    first_message,
    first_message_digest,
    keeps_key_order,
    message_digests,
    shared_messages,
)
from gateway.store.models import Call, Group, Run, Trajectory, utcnow
from gateway.store.tree import OWN_AGENT_REASONS, Candidate, find_parent, own_key, place, root_anchor, root_reason

_runs = cast(Table, Run.__table__)
_groups = cast(Table, Group.__table__)
_trajectories = cast(Table, Trajectory.__table__)
_calls = cast(Table, Call.__table__)
_CALL_KEY = ("trajectory_id", "seq", "choice_index")
_Seq = tuple[str, int]  # (trajectory_id, seq): one attempt of a call, all its choices


_GROUP_KEYS = ("group_id", "run", "mode", "expected_size")
_TRAJECTORY_KEYS = ("trajectory_id", "run", "group_id", "mode", "created_at")


class _Bulk(NamedTuple):
    """A batch's rows into one table as one statement. On Postgres `INSERT ... SELECT ... FROM
    jsonb_to_recordset(the rows as one JSON document)`: the client's work per batch is one orjson dump, in C, and
    Postgres parses the rows on its own core. psycopg's executemany paid a round of Python per row, and its binary
    array dumper (the path before this one: one array per column) a round of Python per value, together half of the
    writer thread's CPU (bench/writer_cpu.py). Rows go in in the order given, so locks are still taken in key order.
    On SQLite the plain insert, executed once per row."""

    statement: Executable
    rowwise: Executable  # the same upsert as INSERT ... VALUES, executed once per row
    keys: tuple[str, ...]  # what each row gives
    # Columns the rows leave out whose model default is Python-side: SQLAlchemy fills those in for an INSERT ...
    # VALUES but not for INSERT ... SELECT, so they are added to each row, the default evaluated per row.
    defaults: tuple[tuple[str, Callable[[], Any]], ...]
    floats: tuple[str, ...]  # float columns: JSON has no NaN or infinity, so those travel as Postgres spells them
    json: tuple[str, ...]  # JSON columns: a NUL character in them is replaced, as in every other write


def _bulk(table: Table, keys: tuple[str, ...], dialect: str, on_conflict: Callable[[Any], Executable]) -> _Bulk:
    insert: Callable[..., Any] = postgresql.insert if dialect == "postgresql" else sqlite.insert
    rowwise = on_conflict(insert(table))
    if dialect != "postgresql":
        return _Bulk(rowwise, rowwise, keys, (), (), ())
    defaults = tuple(
        (c.name, partial(_default_value, c.default))
        for c in table.columns
        if c.name not in keys and c.default is not None and not getattr(c.default, "is_sequence", False)
    )
    kinds = {name: table.c[name].type for name in (*keys, *(name for name, _ in defaults))}
    source = (
        func.jsonb_to_recordset(sql_cast(bindparam("rows", type_=Text()), postgresql.JSONB))
        .table_valued(*(column(name, _recordset_type(kind)) for name, kind in kinds.items()))
        .render_derived(name="batch", with_types=True)
    )
    values = [_from_recordset(source.c[name], kind) for name, kind in kinds.items()]
    return _Bulk(
        on_conflict(insert(table).from_select(list(kinds), select(*values))),
        rowwise,
        keys,
        defaults,
        floats=tuple(name for name, kind in kinds.items() if isinstance(kind, Float)),
        json=tuple(name for name, kind in kinds.items() if isinstance(kind, JSON)),
    )


def _recordset_type(kind: Any) -> Any:
    """The type a column is read from the JSON rows as. Strings as unbounded text: a varchar(n) there would
    silently cut a longer value, where the insert's own assignment to the column refuses it (the record is then set
    aside, as with a row-by-row insert). Bytes as base64 text, JSON as JSONB."""
    if isinstance(kind, (String, LargeBinary)):
        return Text()
    if isinstance(kind, JSON):
        return postgresql.JSONB()
    return kind


def _from_recordset(value: Any, kind: Any) -> Any:
    if isinstance(kind, LargeBinary):
        return func.decode(value, literal_column("'base64'"))
    if isinstance(kind, JSON):
        # A JSON null reads as SQL NULL; SQLAlchemy stores None in a JSON column as JSON null, and so does this.
        return func.coalesce(value, literal_column("'null'::jsonb"))
    return value


def _default_value(default: Any) -> Any:
    return default.arg(None) if default.is_callable else default.arg


def _bytes_as_base64(value: Any) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return binascii.b2a_base64(value, newline=False).decode("ascii")
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def _recordset(bulk: _Bulk, rows: list[dict[str, Any]]) -> str:
    """The rows as the JSON document `bulk.statement` reads. Each row is dumped on its own, with a `give_way` before
    it: orjson holds the GIL for the whole of one dump, and a batch's document in one dump (hundreds of KB of ids)
    would be the writer's longest stretch without a yield point, a call's delay at c=1."""
    parts = []
    for row in rows:
        give_way()
        parts.append(_dumped_row(bulk, row))
    return "[" + ",".join(parts) + "]"


def _dumped_row(bulk: _Bulk, row: dict[str, Any]) -> str:
    if bulk.defaults:
        row = {**row, **{name: default() for name, default in bulk.defaults}}
    for name in bulk.floats:
        value = row[name]
        if type(value) is float and not math.isfinite(value):
            row[name] = _NON_FINITE.get(value, "NaN")
    try:
        payload = orjson.dumps(row, default=_bytes_as_base64)
    except TypeError:  # keys that are not strings, somewhere in a JSON column's value
        payload = orjson.dumps(row, default=_bytes_as_base64, option=orjson.OPT_NON_STR_KEYS)
    if b"\\u0000" in payload and bulk.json:
        row = {**row, **{name: without_nul(row[name]) for name in bulk.json}}
        payload = orjson.dumps(row, default=_bytes_as_base64, option=orjson.OPT_NON_STR_KEYS)
    return payload.decode()


def _insert_rows(conn: Connection, bulk: _Bulk, rows: list[dict[str, Any]]) -> None:
    """Execute `bulk` for `rows`, whose keys must be its `keys`."""
    if not rows:
        return
    if set(rows[0]) != set(bulk.keys):
        raise ValueError(f"rows with keys {sorted(rows[0])} do not bind {sorted(bulk.keys)}")
    if conn.dialect.name != "postgresql":
        conn.execute(bulk.rowwise, rows)
        return
    compiled = _compile(conn.dialect, bulk.statement, ("rows",))
    for document in _documents(bulk, rows):
        _driver_execute(conn, compiled.sql, {"rows": document})


# A JSONB value holds at most 255 MB, and a batch of long agent calls (a 100k-token prompt is 400 KB of ids alone,
# plus its request) can exceed that: such a batch goes in several statements of the same transaction.
MAX_DOCUMENT_BYTES = 64 * 1024 * 1024


def _documents(bulk: _Bulk, rows: list[dict[str, Any]]) -> Iterator[str]:
    """The rows as one JSON document, or, past MAX_DOCUMENT_BYTES, as documents of halves (in order, so locks are
    still taken in key order)."""
    document = _recordset(bulk, rows)
    if len(document) <= MAX_DOCUMENT_BYTES or len(rows) == 1:
        yield document
        return
    middle = len(rows) // 2
    yield from _documents(bulk, rows[:middle])
    yield from _documents(bulk, rows[middle:])


class _Stored(NamedTuple):
    """A stored call as settling, lineage and tree placement read it, once per row of each trajectory a batch
    touches. A plain tuple, not SQLAlchemy's Row: a Row answers an attribute through `__getattr__` after a failed
    lookup (~740 ns; an index or a NamedTuple field ~50 ns), and these rows are read ~20 times each per batch, which
    made the writer's CPU a record grow with the trajectory's length (bench/writer_cpu.py --turns)."""

    trajectory_id: str
    seq: int
    choice_index: int
    id: str
    created_at: datetime
    parent_seq: int | None
    messages_parent_seq: int | None
    retry_count: int
    idempotency_key: str | None
    request_hash: bytes | None
    first_seq: int | None
    first_retry_count: int | None
    tree_parent_seq: int | None
    tree_parent_choice: int | None
    tokens_len: int | None
    tokens_key: bytes | None

    @property
    def first(self) -> tuple[int, int]:
        """The earliest attempt (seq, retry_count) the row stands for (gateway.store.attempts): itself when the
        row names none (written before revision 0007). The two columns are written together."""
        if self.first_seq is None or self.first_retry_count is None:
            return (self.seq, self.retry_count)
        return (self.first_seq, self.first_retry_count)

    @property
    def tree_parent(self) -> tuple[int, int] | None:
        """Its recorded tree parent (seq, choice), None for a root; the two columns are written together."""
        if self.tree_parent_seq is None or self.tree_parent_choice is None:
            return None
        return (self.tree_parent_seq, self.tree_parent_choice)


class _Statements(NamedTuple):
    runs: Executable
    groups: _Bulk
    trajectories: _Bulk
    calls: _Bulk
    untrainable: Executable
    reopen: Executable
    lock: Executable  # the batch's trajectories FOR UPDATE (Postgres only)
    stored: Executable  # what _lineages reads of the batch's stored calls


class _TextArray(UserDefinedType[list[str]]):
    """A list of strings bound as the text of one Postgres array literal, typed text[] at the placeholder
    (`%(ids)s::TEXT[]`) so Postgres parses it once, as the parameter's value. psycopg's array dumper handles each
    element in Python, and a batch binds four such lists. (A CAST of a text parameter instead would be parsed again for
    every row a sequential scan filters.) Every element is quoted, so none reads as NULL and commas or braces stay
    inside. Escaping each element in a Python generator cost ~1 µs an id: with 256 ids the reopen, untrainable, lock
    and stored statements took 387 / 341 / 315 / 289 µs of the writer's CPU an execution, 263 / 172 / 132 / 197 with
    the literal joined in C, which the usual ids (generated ones, uuids: no quote or backslash) allow."""

    cache_ok = True
    render_bind_cast = True

    def get_col_spec(self, **_: Any) -> str:
        return "TEXT[]"

    def bind_processor(self, dialect: Dialect) -> Callable[[list[str] | None], str | None]:
        def literal(value: list[str] | None) -> str | None:
            if value is None:
                return None
            if not value:
                return "{}"
            every = "".join(value)
            if '"' not in every and "\\" not in every:
                return '{"' + '","'.join(value) + '"}'
            return "{" + ",".join('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in value) + "}"

        return literal


def _one_of(column: ColumnElement[Any], name: str, dialect: str) -> ColumnElement[bool]:
    """`column` is one of the list bound as `name`. On Postgres `= ANY(array)`: one SQL text whatever the list's
    length, so neither SQLAlchemy nor psycopg renders and parses an IN list of a placeholder per id for every batch
    (which was a tenth of the writer's CPU at batches of 64). SQLite has no arrays and keeps the expanding IN."""
    if dialect == "postgresql":
        return column == any_(bindparam(name, type_=_TextArray()))
    return column.in_(bindparam(name, expanding=True))


@cache
def _statements(dialect: str) -> _Statements:
    """Built once per dialect: ON CONFLICT is dialect syntax, and rebuilding the constructs per batch costs more
    than the tiny batches the writer sends when traffic is light."""
    insert: Callable[..., Any] = postgresql.insert if dialect == "postgresql" else sqlite.insert

    def groups_conflict(groups: Any) -> Executable:
        # A later call may be the first to carry the group size; never overwrite a size already known.
        return cast(
            Executable,
            groups.on_conflict_do_update(
                index_elements=["group_id"],
                set_={"expected_size": groups.excluded.expected_size},
                where=_groups.c.expected_size.is_(None) & groups.excluded.expected_size.is_not(None),
            ),
        )

    def calls_conflict(calls: Any) -> Executable:
        return cast(
            Executable,
            calls.on_conflict_do_update(
                index_elements=list(_CALL_KEY),
                set_={c.name: calls.excluded[c.name] for c in _calls.columns if c.name not in _CALL_KEY},
                # A record replayed late from the spool must not roll back a newer attempt already written directly.
                where=_calls.c.created_at <= calls.excluded.created_at,
            ),
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
            _one_of(_trajectories.c.trajectory_id, "ids", dialect),
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
            _one_of(_groups.c.group_id, "group_ids", dialect),
            # Spelled in the SQL: a tuple of values would be an expanding parameter, rendered again at every execution.
            _groups.c.state.in_([literal_column(f"'{state}'") for state in ("ready", "trained", "dropped")]),
            unrewarded,
        )
        .values(state=literal_column("'open'"), ready_at=null())
    )
    lock = (
        select(_trajectories.c.trajectory_id)
        .where(_one_of(_trajectories.c.trajectory_id, "ids", dialect))
        .order_by(_trajectories.c.trajectory_id)
        .with_for_update()
    )
    stored = select(*(_calls.c[name] for name in _Stored._fields)).where(
        _one_of(_calls.c.trajectory_id, "ids", dialect)
    )
    return _Statements(
        runs=insert(_runs).on_conflict_do_nothing(index_elements=["name"]),
        groups=_bulk(_groups, _GROUP_KEYS, dialect, groups_conflict),
        trajectories=_bulk(
            _trajectories,
            _TRAJECTORY_KEYS,
            dialect,
            lambda trajectories: trajectories.on_conflict_do_nothing(index_elements=["trajectory_id"]),
        ),
        calls=_bulk(_calls, tuple(c.name for c in _calls.columns), dialect, calls_conflict),
        untrainable=untrainable,
        reopen=reopen,
        lock=lock,
        stored=stored,
    )


def _call_row(
    record: CallRecord,
    lineage: Lineage,
    hash_: bytes | None = None,
    first: tuple[int, int] | None = None,
    packed: PackedArrays | None = None,
) -> dict[str, Any]:
    prompt, completion, logprobs = packed or _packed(record)
    first_seq, first_retry_count = first if first is not None else (record.seq, record.retry_count)
    tokens = lineage.tokens
    return {
        "id": record.id,
        "trajectory_id": record.trajectory_id,
        "seq": record.seq,
        "choice_index": record.choice_index,
        "run": record.run,
        "policy_version": record.policy_version,
        "endpoint": record.endpoint,
        "stream": record.stream,
        "request": compact_request(record.request, lineage.messages_prefix_len),
        "response": _own_choice(record.response, record.choice_index),
        "prompt_token_ids": prompt[lineage.prefix_len * 4 :] if prompt is not None else None,
        "completion_token_ids": completion,
        "completion_logprobs": logprobs,
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
        "merge_reason": lineage.reason,
        "divergence": lineage.divergence,
        "parent_seq": lineage.parent_seq,
        "prefix_len": lineage.prefix_len,
        "history_key": record.history_key,
        "segment_reason": record.segment_reason,
        "messages_parent_seq": lineage.messages_parent_seq,
        "messages_prefix_len": lineage.messages_prefix_len,
        "request_hash": hash_,
        "first_seq": first_seq,
        "first_retry_count": first_retry_count,
        "tree_parent_seq": lineage.tree_parent[0] if lineage.tree_parent is not None else None,
        "tree_parent_choice": lineage.tree_parent[1] if lineage.tree_parent is not None else None,
        "tokens_len": tokens[0] if tokens is not None else None,
        "tokens_key": tokens[1] if tokens is not None else None,
    }


def write_calls(
    engine: Engine,
    records: Sequence[CallRecord],
    cache: LineageCache | None = None,
    packed: Sequence[PackedArrays | None] | None = None,
) -> None:
    """Upsert the records and the runs, groups and trajectories they name, all in one transaction.

    One transaction per batch so a failure leaves nothing half-written and the whole batch can simply be
    retried or spooled. Rows are sent sorted by key so concurrent writers (several gateway processes) lock
    shared group and trajectory rows in the same order and do not deadlock each other. `cache`: the newest calls this
    caller wrote (the record writer owns one), so the next call of a trajectory usually finds its predecessor there;
    without one every predecessor is read back from the database, as another process's write would need.
    `packed`: each record's arrays as `pack_arrays` packed them from its lists (None where not), one per record, so
    that the writer does not pack again what its write-ahead log line already did.
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
    given = {id(r): arrays for r, arrays in zip(records, packed, strict=True) if arrays is not None} if packed else {}
    hashes: dict[_Seq, bytes | None] = {}
    for record in calls:
        give_way()
        if (record.trajectory_id, record.seq) not in hashes:
            hashes[(record.trajectory_id, record.seq)] = request_hash(record)

    runs: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Any]] = {}
    trajectories: dict[str, dict[str, Any]] = {}
    for record in calls:
        give_way()
        if record.run not in runs:
            now = utcnow()
            runs[record.run] = {
                "name": record.run,
                "base_model": record.base_model,
                "config": {},
                "created_at": now,
                "updated_at": now,
            }
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
    # Between two statements, as between two records, the writer gives way: each statement's execution (SQLAlchemy's
    # and psycopg's Python around the round trip) is 0.1-0.8 ms of the writer's CPU, and five of them back to back
    # were the longest stretches a call waited for the GIL behind the writer at c=1 (bench/gateway_overhead.py).
    with engine.begin() as conn:
        give_way()
        with _prepared(conn):
            for name in sorted(runs):
                _run(conn, statements.runs, runs[name])
            give_way()
            _insert_rows(conn, statements.groups, [groups[k] for k in sorted(groups)])
            give_way()
            _insert_rows(
                conn,
                statements.trajectories,
                [
                    {**row, "created_at": datetime.fromtimestamp(row["created_at"], UTC)}
                    for _, row in sorted(trajectories.items())
                ],
            )
        give_way()
        if conn.dialect.name == "postgresql":
            # One writer at a time per trajectory, so two gateways never derive a call's stored prefix from a
            # predecessor the other is replacing, and each settles retries against the other's committed attempts
            # (gateway.store.attempts). The untrainable update below locks these rows anyway.
            _run(conn, statements.lock, {"ids": sorted(trajectories)})
            give_way()
        # Unprepared: they join the batch against tables that grow (see make_engine).
        digests: dict[str, bytes | None] = {}
        packed_by_id: dict[str, PackedArrays] = {}
        calls, lineages, firsts = _lineages(conn, statements, calls, hashes, digests, given, packed_by_id, cache)
        with _prepared(conn):
            if calls:
                rows = []
                for record, lineage in zip(calls, lineages):
                    give_way()
                    attempt = (record.trajectory_id, record.seq)
                    rows.append(_call_row(record, lineage, hashes[attempt], firsts[attempt], packed_by_id[record.id]))
                if conn.dialect.name == "postgresql":
                    _insert_rows(conn, statements.calls, rows)
                else:
                    _execute_many(conn, statements.calls.rowwise, rows)
        give_way()
        _run(conn, statements.reopen, {"group_ids": sorted(groups)})
        give_way()
        _run(conn, statements.untrainable, {"ids": sorted(trajectories)})
        give_way()
    if cache is None:
        return
    for record in calls:
        give_way()
        if record.choice_index == 0 and not record.generated_trajectory:
            predecessor = _predecessor_of(record, digests[record.id])
            cache.remember(record.trajectory_id, predecessor, record.id, packed_by_id[record.id])


class _Compiled(NamedTuple):
    """An upsert compiled for one dialect and one set of row keys, with the bind processors its parameters need."""

    sql: str
    order: tuple[str, ...] | None  # the parameters' order where the driver takes them by position (SQLite)
    processors: tuple[tuple[str, Callable[[Any], Any]], ...]


_compiled_cache: weakref.WeakKeyDictionary[Dialect, dict[tuple[Executable, tuple[str, ...]], _Compiled]] = (
    weakref.WeakKeyDictionary()
)
_compiled_lock = threading.Lock()


def _compile(dialect: Dialect, statement: Executable, keys: tuple[str, ...]) -> _Compiled:
    with _compiled_lock:
        per_dialect = _compiled_cache.setdefault(dialect, {})
        compiled = per_dialect.get((statement, keys))
    if compiled is not None:
        return compiled
    sql = cast(Any, statement).compile(dialect=dialect, column_keys=list(keys))
    names = tuple(sql.positiontup) if sql.positional else tuple(sql.binds)
    if set(names) != set(keys) or sql.escaped_bind_names:
        raise ValueError(f"rows with keys {sorted(keys)} do not bind {sql.string!r} one to one")
    processors = []
    for name in names:
        processor = sql.binds[name].type.dialect_impl(dialect).bind_processor(dialect)
        if processor is not None:
            processors.append((name, processor))
    compiled = _Compiled(sql.string, names if sql.positional else None, tuple(processors))
    with _compiled_lock:
        per_dialect[(statement, keys)] = compiled
    return compiled


def _execute_many(conn: Connection, statement: Executable, rows: list[dict[str, Any]]) -> None:
    """`conn.execute(statement, rows)` for the calls upsert on SQLite, at a fraction of its cost per row (Postgres
    sends a batch as arrays instead: `_insert_rows`).

    SQLAlchemy compiles each statement once anyway, but on every execution it still builds every row's parameters
    anew through its generic path (construct_params, then the type processors), which was most of the writer
    thread's time for the 39-column calls upsert (bench/gateway_overhead.py --profile). The statement is compiled
    here once per dialect and key set, and each row gets only the type processors it needs (JSON serialisation,
    booleans and datetimes on SQLite): the same SQL and the same values reach the driver. Errors are still
    SQLAlchemy's (exec_driver_sql wraps them), which the writer sorts by. Rows must all have the same keys and
    bind every parameter: a column with a Python-side default (runs, groups, trajectories) needs the generic path.
    """
    if not rows:
        return
    compiled = _compile(conn.dialect, statement, tuple(rows[0]))
    for row in rows:
        for name, processor in compiled.processors:
            row[name] = processor(row[name])
    if compiled.order is None:
        conn.exec_driver_sql(compiled.sql, cast(Any, rows))
    else:
        order = compiled.order
        conn.exec_driver_sql(compiled.sql, [tuple(row[name] for name in order) for row in rows])


def _run(conn: Connection, statement: Executable, params: dict[str, Any]) -> Sequence[Sequence[Any]]:
    """`conn.execute(statement, params).all()` for a statement the writer runs every batch, whose parameters are
    exactly `params`' keys.

    On Postgres the SQL compiled once (`_compile`) goes straight to psycopg's cursor (`_driver_execute`): SQLAlchemy's
    execution around it (the compiled-cache lookup, building the parameters, the result's metadata) cost 35-60 µs of
    the writer's CPU a statement, about as much as psycopg's own, and a batch runs eight: at low traffic, where a
    batch holds a record or two, that is most of its work (one record's batch: 1,055 µs of CPU, 874 through the
    cursor; bench/writer_cpu.py --shapes single --batches 1). SQLite keeps the generic path: its id lists
    are expanding IN lists, rendered per execution, and its datetimes come back as text for SQLAlchemy to parse."""
    if conn.dialect.name != "postgresql":
        result = conn.execute(statement, params)
        return result.all() if result.returns_rows else ()
    compiled = _compile(conn.dialect, statement, tuple(params))
    values = dict(params)
    for name, processor in compiled.processors:
        values[name] = processor(values[name])
    return _driver_execute(conn, compiled.sql, values)


def _driver_execute(conn: Connection, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Execute compiled SQL on the connection's psycopg cursor, inside `conn`'s transaction; its rows as tuples.

    A driver error is raised as SQLAlchemy would raise it (`DBAPIError.instance` picks IntegrityError, DataError,
    OperationalError... by the driver's class), because the writer tells a record the database refuses from a
    database that is down by those classes (gateway.recorder.spool_lines.is_record_error); a lost connection is
    invalidated, as SQLAlchemy does, so the pool does not hand it out again."""
    dbapi = conn.connection.dbapi_connection
    assert dbapi is not None
    driver_error = conn.dialect.loaded_dbapi.Error
    cursor = dbapi.cursor()
    try:
        cursor.execute(sql, params)
        # Asked of the result's status: `cursor.description` builds a column object per column to say the same.
        result = cursor.pgresult
        return list(cursor.fetchall()) if result is not None and result.status == ExecStatus.TUPLES_OK else []
    except driver_error as err:
        lost = conn.dialect.is_disconnect(err, dbapi, cursor)
        if lost:
            conn.invalidate(err)
        raise DBAPIError.instance(
            sql, params, err, driver_error, connection_invalidated=lost, dialect=conn.dialect
        ) from err
    finally:
        cursor.close()


def _own_choice(response: dict[str, Any] | None, choice_index: int) -> dict[str, Any] | None:
    """The response as one choice's row stores it: with only that choice. Every choice of an `n > 1` call has a row
    of its own, and each row holding all n choices made a call's stored response grow with the square of n; every
    reader takes a row's answer from its own choice. A response whose choices are not all indexed is kept whole."""
    choices = (response or {}).get("choices")
    if response is None or not isinstance(choices, list) or len(choices) < 2:
        return response
    if not all(isinstance(c, dict) and isinstance(c.get("index"), int) for c in choices):
        return response
    return {**response, "choices": [c for c in choices if c["index"] == choice_index]}


def _answered_tool_call(response: dict[str, Any] | None, choice_index: int) -> bool:
    for choice in (response or {}).get("choices") or ():
        if choice.get("index", 0) == choice_index:
            return bool((choice.get("message") or {}).get("tool_calls"))
    return False


def _predecessor_of(record: CallRecord, messages: bytes | None) -> Predecessor:
    return Predecessor(
        record.seq,
        record.prompt_token_ids,
        record.completion_token_ids,
        _answered_tool_call(record.response, record.choice_index),
        messages,
    )


def _packed(record: CallRecord) -> PackedArrays:
    """A record's arrays packed once per record and batch, where the caller did not hand them over: its row, the tree
    lookup and the lineage cache each want them, and packing them three times over was a quarter of the writer's
    instructions per record."""
    return pack_arrays(record.prompt_token_ids, record.completion_token_ids, record.completion_logprobs)


class _Entry(NamedTuple):
    call_id: str
    seq: int
    prompt: bytes | None  # packed like the columns: 4 bytes a token, not ~36 as a list of ints
    completion: bytes | None
    tool_call: bool
    messages: bytes | None  # digests of the request's messages, not the messages


class LineageCache:
    """The newest choice-0 call written by this process per trajectory and agent (calls whose requests start with the
    same message: the supervisor's, a sub-agent's), with its full ids and its messages' digests, so that the next call
    of a trajectory usually finds its predecessor here instead of rebuilding it from the database, and a root the last
    call of its own agent (_root_reason) too. An entry is used only when the database still holds that very call (same
    id) at that seq. At most AGENTS_KEPT agents a trajectory (the newest calls stay); bounded by the bytes of ids it
    holds, the least recently written trajectories going first. One per writer, passed to `write_calls`: what it
    holds is what that writer wrote, and two writers (tests, benchmarks, gateways on one database) never share one."""

    AGENTS_KEPT = 4

    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        self._max_bytes = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[str, dict[bytes | None, _Entry]] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, trajectory_id: object) -> bool:
        """Whether it holds any call of the trajectory (a generated one's it never does)."""
        with self._lock:
            return trajectory_id in self._entries

    def get(self, trajectory_id: str, seq: int, call_id: str) -> Predecessor | None:
        with self._lock:
            agents = self._entries.get(trajectory_id) or {}
            entry = next((e for e in agents.values() if e.seq == seq), None)
        if entry is None or entry.call_id != call_id:
            return None
        return Predecessor(
            seq, decode_ids(entry.prompt), decode_ids(entry.completion), entry.tool_call, entry.messages
        )

    def remember(
        self, trajectory_id: str, predecessor: Predecessor, call_id: str, packed: PackedArrays | None = None
    ) -> None:
        """`packed`: the predecessor's arrays packed already, where the caller has them."""
        if packed is None:
            prompt, completion = encode_ids(predecessor.prompt_ids), encode_ids(predecessor.completion_ids)
        else:
            prompt, completion = packed.prompt, packed.completion
        entry = _Entry(call_id, predecessor.seq, prompt, completion, predecessor.tool_call, predecessor.messages)
        agent = first_message(predecessor.messages)
        with self._lock:
            agents = self._entries.setdefault(trajectory_id, {})
            current = agents.get(agent)
            if current is not None:
                if current.seq > entry.seq:
                    return
                self._bytes -= _size(current)
            agents[agent] = entry
            self._bytes += _size(entry)
            if len(agents) > self.AGENTS_KEPT:
                oldest = min(agents, key=lambda a: agents[a].seq)
                self._bytes -= _size(agents.pop(oldest))
            self._entries.move_to_end(trajectory_id)
            while self._bytes > self._max_bytes and self._entries:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= sum(_size(e) for e in evicted.values())


def _size(entry: _Entry) -> int:
    return len(entry.prompt or b"") + len(entry.completion or b"") + len(entry.messages or b"")


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


# Built once: constructing a select and its cache key costs more than running it on a short trajectory, and these
# run for every batch whose predecessor the lineage cache does not hold (another gateway wrote it).
_IDS_COLUMNS = ("seq", "choice_index", "prompt_token_ids", "completion_token_ids", "parent_seq", "prefix_len")
_REQUEST_COLUMNS = ("request", "messages_parent_seq", "messages_prefix_len")
_REBUILD = {
    requests: select(*(_calls.c[name] for name in _IDS_COLUMNS + (_REQUEST_COLUMNS if requests else ()))).where(
        _calls.c.trajectory_id == bindparam("trajectory_id")
    )
    for requests in (False, True)
}
_RESPONSE = select(_calls.c.response).where(
    _calls.c.trajectory_id == bindparam("trajectory_id"),
    _calls.c.seq == bindparam("seq"),
    _calls.c.choice_index == bindparam("choice_index"),
)


def rebuild_calls(conn: Connection, trajectory_id: str, requests: bool = True) -> StoredCalls:
    """Every stored call of the trajectory, each rebuilt in full (its prompt ids and, unless `requests` is false: the
    schema below revision 0006 has no message columns, its request) when asked for, keyed by (seq, choice_index)."""
    rows = conn.execute(_REBUILD[requests], {"trajectory_id": trajectory_id}).all()
    # Unpacked, not read by attribute: a Row's attribute costs ~15 times a tuple field's (see _Stored).
    return StoredCalls({(row[0], row[1]): StoredCall(*row[2:]) for row in rows})


def _lineages(
    conn: Connection,
    statements: _Statements,
    calls: list[CallRecord],
    hashes: dict[_Seq, bytes | None],
    digests: dict[str, bytes | None],
    given: dict[int, PackedArrays],
    packed: dict[str, PackedArrays],
    cache: LineageCache | None,
) -> tuple[list[CallRecord], list[Lineage], dict[_Seq, tuple[int, int]]]:
    """Each record's merge diagnostics and storage prefixes (ids and messages) against its predecessor, in the same
    transaction, and the earliest attempt (first_seq, first_retry_count) each written row stands for; `digests` and
    `packed` get each kept record's message digests and packed arrays, by record id (`given`'s where it has them, by
    the record's `id()`).

    Attempts are first settled into calls (gateway.store.attempts): an attempt older than its call's newest is not
    written, and a stored row whose call now has a newer attempt elsewhere is deleted. Records older than the attempt
    already stored at their key are dropped (the upsert would skip them anyway). A record that replaces or deletes a
    stored choice-0 call would leave that call's compact children pointing at ids or messages that no longer exist,
    so those children get their full prompt and request back first.
    """
    key_order = keeps_key_order(conn.dialect.name)
    trajectory_ids = sorted({record.trajectory_id for record in calls})
    stored: dict[str, dict[tuple[int, int], _Stored]] = {t: {} for t in trajectory_ids}
    # Fetched whole (`all`): iterating the result fetches row by row through SQLAlchemy's Python layers, ~1.5 µs a
    # row more, and a batch of long trajectories reads thousands (bench/writer_cpu.py --turns).
    found = _run(conn, statements.stored, {"ids": trajectory_ids})
    give_way()
    for row in map(_Stored._make, found):
        stored[row.trajectory_id][(row.seq, row.choice_index)] = row

    by_trajectory: dict[str, list[CallRecord]] = {t: [] for t in trajectory_ids}
    for record in calls:
        by_trajectory[record.trajectory_id].append(record)
    kept: dict[str, list[CallRecord]] = {t: [] for t in trajectory_ids}
    lineages: dict[str, list[Lineage]] = {}
    firsts: dict[_Seq, tuple[int, int]] = {}
    # A trajectory's first call alone in the batch (an unattributed call is a trajectory of its own; every other
    # trajectory starts so) has nothing to settle, compare with, place among or re-place: none of that machinery,
    # 10-15 % of the writer's CPU a record for such calls (bench/writer_cpu.py --shapes gateway).
    first_calls = [t for t in trajectory_ids if not stored[t] and len(by_trajectory[t]) == 1]
    general = [t for t in trajectory_ids if stored[t] or len(by_trajectory[t]) != 1]
    for trajectory_id in first_calls:
        give_way()
        record = by_trajectory[trajectory_id][0]
        kept[trajectory_id].append(record)
        firsts[(trajectory_id, record.seq)] = (record.seq, record.retry_count)
        # Only the lineage cache reads a first call's digests, and it keeps nothing of a generated trajectory.
        digests[record.id] = None if record.generated_trajectory else message_digests(record.request, key_order)
        packed[record.id] = given.get(id(record)) or _packed(record)
        # What classify and _in_tree give a call with nothing before it, built at once: a first call, a root, its own
        # tree key (one NamedTuple and a few calls, where classify and _in_tree took 15 µs: ~8 % of its record).
        tokens = own_key(record.prompt_token_ids, record.completion_token_ids, packed[record.id][:2])
        lineages[trajectory_id] = [Lineage(FIRST_CALL, None, None, 0, tokens=tokens)]

    settlements: dict[str, Settlement] = {}
    for trajectory_id in general:
        give_way()
        settlements[trajectory_id] = _settle(stored[trajectory_id], by_trajectory[trajectory_id], hashes)
    # The earliest attempt each kept record's row stands for (only theirs: a settlement covers every stored call).
    firsts.update(
        ((t, r.seq), settlements[t].first[r.seq])
        for t in general
        for r in by_trajectory[t]
        if r.seq not in settlements[t].dropped
    )
    for record in (r for t in general for r in by_trajectory[t]):
        give_way()
        if record.seq in settlements[record.trajectory_id].dropped:
            continue
        existing = stored[record.trajectory_id].get((record.seq, record.choice_index))
        if existing is None or _aware(existing.created_at) <= datetime.fromtimestamp(record.created_at, UTC):
            kept[record.trajectory_id].append(record)
            digests[record.id] = message_digests(record.request, key_order)
            packed[record.id] = given.get(id(record)) or _packed(record)

    for trajectory_id in general:
        give_way()
        lineages[trajectory_id] = []
        records = kept[trajectory_id]
        removed = settlements[trajectory_id].removed
        rows = stored[trajectory_id]
        replaced = removed | {
            r.seq for r in records if r.choice_index == 0 and (r.seq, 0) in rows and rows[(r.seq, 0)].id != r.id
        }
        incoming = {(r.seq, r.choice_index) for r in records}
        orphans = [
            key
            for key, row in (rows.items() if replaced else ())  # (nothing replaced, the usual case: no orphan)
            if (row.parent_seq in replaced or row.messages_parent_seq in replaced)
            and key not in incoming
            and key[0] not in removed
        ]
        rebuilt: StoredCalls | None = None
        if orphans:
            rebuilt = rebuild_calls(conn, trajectory_id)
            for key in orphans:
                conn.execute(
                    update(_calls)
                    .where(
                        _calls.c.trajectory_id == trajectory_id,
                        _calls.c.seq == key[0],
                        _calls.c.choice_index == key[1],
                    )
                    .values(
                        prompt_token_ids=encode_ids(rebuilt.prompt(key)),
                        parent_seq=None,
                        prefix_len=0,
                        request=rebuilt.request(key),
                        messages_parent_seq=None,
                        messages_prefix_len=0,
                    )
                )
        if removed:
            conn.execute(delete(_calls).where(_calls.c.trajectory_id == trajectory_id, _calls.c.seq.in_(removed)))
            rows = {key: row for key, row in rows.items() if key[0] not in removed}
        _update_firsts(conn, trajectory_id, rows, settlements[trajectory_id])
        view = _TrajectoryView(conn, trajectory_id, rows, records, replaced, digests, cache, rebuilt, key_order)
        candidates = _stored_candidates(rows, records)
        for record in records:
            previous = view.previous_of(record.seq)
            own = record.predecessor_seq
            if own is None or own >= record.seq or view.predecessor_at(own, record.predecessor_choice or 0) is None:
                lineage = classify(record.prompt_token_ids, previous)
                lineage = _with_messages(lineage, digests[record.id], previous)
                anchor = partial(view.same_agent_before, record.seq, digests[record.id])
                lineage = _in_tree(
                    lineage, record, packed[record.id], candidates, None, digests[record.id], previous, anchor
                )
                at = lineage.parent_seq
                if at is not None and lineage.tree_parent == (at, 0) and at != lineage.messages_parent_seq:
                    # Its ids are stored against its tree parent (_in_tree): its messages too, where that shares more
                    # (a supervisor resuming after its sub-agent: its agent's newest call, which the cache holds).
                    lineage = _with_messages(lineage, digests[record.id], view.predecessor_at(at, 0), longer=True)
                lineages[trajectory_id].append(lineage)
                continue
            # A token_in call names the recorded choice its prompt was built on: classify against that one (a retry
            # or a parallel branch of a turn extends the turn before it, not its sibling at the previous seq). Its
            # ids and messages are stored against choice 0 of that seq, the only choice a Rebuilder keeps.
            lineage = classify(record.prompt_token_ids, view.predecessor_at(own, record.predecessor_choice or 0))
            storage = view.predecessor_at(own, 0)
            stored_as = classify(record.prompt_token_ids, storage)
            lineage = lineage._replace(parent_seq=stored_as.parent_seq, prefix_len=stored_as.prefix_len)
            lineage = _with_messages(lineage, digests[record.id], storage)
            named_choice = record.predecessor_choice or 0
            anchor = partial(view.same_agent_before, record.seq, digests[record.id])
            lineages[trajectory_id].append(
                _in_tree(
                    lineage, record, packed[record.id], candidates, (own, named_choice), digests[record.id], storage,
                    anchor,
                )
            )
        _reparent_late(conn, trajectory_id, rows, records, candidates, replaced, view)
    ordered = [r for t in trajectory_ids for r in kept[t]]
    return ordered, [lineage for t in trajectory_ids for lineage in lineages[t]], firsts


class _TrajectoryView:
    """One trajectory as the batch being written leaves it (each (seq, choice) is the incoming record if any, else
    the stored row), for the lookups that deriving its records' lineage and tree places make. They share what they
    found: predecessors are memoized, and the trajectory's stored calls are read from the database at most once, and
    only when a lookup needs a stored call the lineage cache does not hold, so a batch in order of arrival with a warm
    cache reads nothing more. `rebuilt`: the trajectory already rebuilt for its orphans, if it was."""

    def __init__(
        self,
        conn: Connection,
        trajectory_id: str,
        rows: dict[tuple[int, int], _Stored],
        records: list[CallRecord],
        replaced: set[int],
        digests: dict[str, bytes | None],
        cache: LineageCache | None,
        rebuilt: StoredCalls | None,
        key_order: bool,
    ) -> None:
        self._conn = conn
        self._trajectory_id = trajectory_id
        self._rows = rows
        self._in_batch = {(r.seq, r.choice_index): r for r in records}
        self._replaced = replaced
        self._digests = digests
        self._cache = cache
        self._rebuilt = rebuilt
        self._key_order = key_order
        self._choice0 = sorted({seq for seq, choice in (*rows, *self._in_batch) if choice == 0})
        self._found: dict[tuple[int, int], Predecessor | None] = {}
        self._firsts: dict[int, bytes | None] = {}

    def predecessor_at(self, seq: int, choice: int) -> Predecessor | None:
        """The call at (seq, choice) as a predecessor: from the batch, else the lineage cache (choice 0 of a call
        this writer wrote and the database still holds), else rebuilt from the database."""
        key = (seq, choice)
        if key not in self._found:
            stored_only = key not in self._in_batch and key in self._rows
            cached = None
            if self._cache is not None and stored_only and choice == 0:
                cached = self._cache.get(self._trajectory_id, seq, self._rows[key].id)
            if cached is None and stored_only and self._rebuilt is None:
                self._rebuilt = rebuild_calls(self._conn, self._trajectory_id)
            self._found[key] = cached or _predecessor_at(
                self._conn, self._trajectory_id, key, self._in_batch, self._rows, self._rebuilt, self._digests
            )
        return self._found[key]

    def previous_of(self, seq: int) -> Predecessor | None:
        """The choice-0 call just before `seq`: what a call without a named predecessor is classified against."""
        before = bisect_left(self._choice0, seq)
        return self.predecessor_at(self._choice0[before - 1], 0) if before else None

    def full_calls(self) -> StoredCalls:
        """Every stored call of the trajectory in full (late arrivals re-place stored calls by their whole prompt)."""
        if self._rebuilt is None:
            self._rebuilt = rebuild_calls(self._conn, self._trajectory_id)
        return self._rebuilt

    def same_agent_before(self, seq: int, own: bytes | None) -> Predecessor | None:
        """The latest earlier choice-0 call whose request starts with the same message as `own` (gateway.store.tree
        root_anchor): looked for only for a root that shares no message with the call before it."""
        first = first_message(own)
        if first is None:
            return None
        for earlier in reversed(self._choice0[: bisect_left(self._choice0, seq)]):
            if (earlier, 0) in self._in_batch:
                theirs = first_message(self._digests[self._in_batch[(earlier, 0)].id])
            else:
                theirs = self._stored_first(earlier)
            if theirs == first:
                return self.predecessor_at(earlier, 0)
        return None

    def _stored_first(self, seq: int) -> bytes | None:
        """A stored call's first message digest. It is its messages' storage parent's (they share at least that
        one), down to a call that stores its request whole: one read per such call, not a rebuild of the
        trajectory."""
        chain = []
        at = seq
        while at not in self._firsts:
            row = self._rows.get((at, 0))
            if row is None:
                self._firsts[at] = None
            elif row.messages_parent_seq is None or row.messages_parent_seq in self._replaced:
                # (a call whose storage parent this batch replaces got its whole request back above)
                request = self._conn.execute(
                    select(_calls.c.request).where(
                        _calls.c.trajectory_id == self._trajectory_id, _calls.c.seq == at, _calls.c.choice_index == 0
                    )
                ).scalar_one_or_none()
                self._firsts[at] = first_message_digest(request, self._key_order)
            else:
                chain.append(at)
                at = row.messages_parent_seq
        for link in chain:
            self._firsts[link] = self._firsts[at]
        return self._firsts[seq]


def _stored_candidates(rows: dict[tuple[int, int], _Stored], records: list[CallRecord]) -> list[Candidate]:
    """The stored calls of the trajectory that can be a tree parent (they have ids) and that no incoming record
    replaces; each incoming record joins the list once placed (`_in_tree`)."""
    incoming = {(record.seq, record.choice_index) for record in records}
    return [
        Candidate(seq, choice, row.tokens_len, row.tokens_key)
        for (seq, choice), row in sorted(rows.items())
        if row.tokens_len is not None and row.tokens_key is not None and (seq, choice) not in incoming
    ]


def _in_tree(
    lineage: Lineage,
    record: CallRecord,
    packed: PackedArrays,
    candidates: list[Candidate],
    named: tuple[int, int] | None,
    own: bytes | None,
    compared: Predecessor | None,
    same_agent: Callable[[], Predecessor | None],
) -> Lineage:
    """The lineage with the call's tree parent (gateway.store.tree) and tree keys; the call then joins `candidates`
    (records come in (seq, choice) order, so every earlier one of the batch is there). A call that extends the
    predecessor it names (token_in) keeps it; any other is looked up among the trajectory's earlier calls by its
    prompt's ids. A root gets its reason from `_root_reason`. The Lineage is built once, not through `_replace`."""
    earlier = (c for c in candidates if c.seq < record.seq)
    parent, tokens = place(record.prompt_token_ids, record.completion_token_ids, earlier, packed=packed[:2])
    if tokens is not None:
        candidates.append(Candidate(record.seq, record.choice_index, *tokens))
    reason, divergence, tree_parent = lineage.reason, lineage.divergence, lineage.tree_parent
    if lineage.reason == EXTENDS and named is not None:
        tree_parent = named
    elif parent is not None:
        reason, divergence, tree_parent = EXTENDS, None, (parent.seq, parent.choice_index)
    elif lineage.reason == EXTENDS and compared is not None:
        # It extends a call written before calls kept tree keys (revision 0009), which no lookup can find.
        tree_parent = (compared.seq, 0)
    else:
        reason, divergence = _root_reason(record.prompt_token_ids, own, compared, lineage, same_agent)
    parent_seq, prefix_len = lineage.parent_seq, lineage.prefix_len
    if parent is not None and parent.choice_index == 0 and parent.tokens_len > prefix_len:
        # Stored against the tree parent, not the call before it: a supervisor resuming after its sub-agent's calls
        # stores its new turn, not its whole history again, so stored ids stay about the trajectory's distinct ids
        # whatever its shape. (Rebuilder keeps choice 0's ids per seq; a parent at another choice keeps the above.)
        parent_seq, prefix_len = parent.seq, parent.tokens_len
    return Lineage(
        reason=reason,
        divergence=divergence,
        parent_seq=parent_seq,
        prefix_len=prefix_len,
        messages_parent_seq=lineage.messages_parent_seq,
        messages_prefix_len=lineage.messages_prefix_len,
        tree_parent=tree_parent,
        tokens=tokens,
    )


def _root_reason(
    prompt: list[int] | None,
    own: bytes | None,
    compared: Predecessor | None,
    lineage: Lineage,
    same_agent: Callable[[], Predecessor | None],
) -> tuple[str, int | None]:
    """A root's (reason, divergence): told against the call before it (`compared`, whose classification `lineage`
    holds), except that a root sharing no message with it is told against its own agent's last call when it plainly
    continues that one (gateway.store.tree.root_anchor and OWN_AGENT_REASONS: an agent compacting, or resuming on a
    re-rendered reply, right after a sub-agent's call)."""
    anchor = root_anchor(own, compared.messages if compared is not None else None, same_agent)
    if anchor is not None:
        told = classify(prompt, anchor)
        reason = root_reason(told.reason, own, anchor.messages)
        if reason in OWN_AGENT_REASONS:
            return reason, told.divergence
    return root_reason(lineage.reason, own, compared.messages if compared is not None else None), lineage.divergence


def _reparent_late(
    conn: Connection,
    trajectory_id: str,
    rows: dict[tuple[int, int], _Stored],
    records: list[CallRecord],
    candidates: list[Candidate],
    replaced: set[int],
    view: _TrajectoryView,
) -> None:
    """Stored calls whose place in the tree a record arriving late changes (it reached the database after them:
    another gateway's writer, the spool) are looked up again: those it extends further than their recorded parent,
    those whose parent this batch replaced, and roots it now precedes (their reason is told against an earlier call).
    In order of arrival there are none and nothing is read."""
    newest = max((seq for seq, _ in rows), default=None)
    if not replaced and (newest is None or all(r.seq > newest for r in records)):
        return
    lengths = {(c.seq, c.choice_index): c.tokens_len for c in candidates}
    incoming = [(r.seq, r.choice_index, lengths.get((r.seq, r.choice_index))) for r in records]
    in_batch = {(r.seq, r.choice_index) for r in records}
    suspects = []
    for key, row in sorted(rows.items()):
        if key in in_batch or row.tokens_len is None:
            continue
        # A root's reason is told against an earlier call: the one before it, or past other agents' calls its own
        # agent's latest (_root_reason), so any earlier call arriving late may change it.
        if row.tree_parent_seq is None and any(seq < key[0] and choice == 0 for seq, choice, _ in incoming):
            suspects.append((key, row))
            continue
        parent = row.tree_parent
        held = lengths.get(parent, 0) if parent is not None else 0
        if row.tree_parent_seq in replaced or any(
            seq < key[0] and _better_parent((seq, choice), n, row.tokens_len, parent, held)
            for seq, choice, n in incoming
        ):
            suspects.append((key, row))
    if not suspects:
        return
    rebuilt = view.full_calls()
    key_order = keeps_key_order(conn.dialect.name)
    for key, _row in suspects:
        prompt = rebuilt.prompt(key)
        found = find_parent(prompt, (c for c in candidates if c.seq < key[0]))
        if found is not None:
            values: dict[str, Any] = {
                "tree_parent_seq": found.seq,
                "tree_parent_choice": found.choice_index,
                "merge_reason": EXTENDS,
                "divergence": None,
            }
        else:
            previous = view.previous_of(key[0])
            own = message_digests(rebuilt.request(key), key_order)
            anchor = partial(view.same_agent_before, key[0], own)
            reason, divergence = _root_reason(prompt, own, previous, classify(prompt, previous), anchor)
            values = {"tree_parent_seq": None, "tree_parent_choice": None, "merge_reason": reason}
            values["divergence"] = divergence
        conn.execute(
            update(_calls)
            .where(_calls.c.trajectory_id == trajectory_id, _calls.c.seq == key[0], _calls.c.choice_index == key[1])
            .values(**values)
        )


def _better_parent(
    candidate: tuple[int, int], length: int | None, tokens_len: int, parent: tuple[int, int] | None, held: int
) -> bool:
    """Whether an incoming call (at `candidate`, `length` ids of its own) would be a better tree parent for a stored
    call (`tokens_len` ids) than its recorded `parent` (`held` ids; None: a root): a prefix of it, longer, or as long
    and at a lower (seq, choice), the tie rule gateway.store.tree.find_parent applies. Only then must a late arrival
    re-place the stored call."""
    if length is None or length > tokens_len:
        return False
    return length > held or (length == held and parent is not None and candidate < parent)


def _settle(
    rows: dict[tuple[int, int], _Stored], calls: list[CallRecord], hashes: dict[_Seq, bytes | None]
) -> Settlement:
    """One trajectory's incoming records folded into its stored calls; each seq is seen through its newest row."""
    incoming: dict[int, Attempt] = {}
    for record in calls:
        hash_ = hashes[(record.trajectory_id, record.seq)]
        attempt = _attempt(record.seq, hash_, record.retry_count, record.created_at, record.idempotency_key, None)
        if record.seq not in incoming or attempt.created_at > incoming[record.seq].created_at:
            incoming[record.seq] = attempt
    if _unrelated(rows, incoming):
        return _apart(rows, incoming)
    stored: dict[int, Attempt] = {}
    for (seq, _), row in sorted(rows.items(), key=lambda item: _aware(item[1].created_at)):
        created_at = _aware(row.created_at).timestamp()
        stored[seq] = _attempt(seq, row.request_hash, row.retry_count, created_at, row.idempotency_key, row.first)
    return settle(stored.values(), incoming.values())


def _unrelated(rows: dict[tuple[int, int], _Stored], incoming: dict[int, Attempt]) -> bool:
    """Whether no incoming attempt can be an attempt of another call, stored or incoming: none is at a stored seq
    and none shares its request hash with a stored row or another incoming attempt (gateway.store.attempts matches
    attempts by hash only). The usual case: an agent's next turn, whose request differs from every earlier one."""
    hashes = [attempt.request_hash for attempt in incoming.values() if attempt.request_hash is not None]
    distinct = set(hashes)
    if len(distinct) != len(hashes):
        return False
    if any(seq in incoming for seq, _ in rows):
        return False
    return not any(row.request_hash in distinct for row in rows.values())


def _apart(rows: dict[tuple[int, int], _Stored], incoming: dict[int, Attempt]) -> Settlement:
    """What `settle` gives for unrelated attempts (`_unrelated`), without matching each one against every stored
    call of the trajectory: nothing dropped or removed, each incoming attempt its own first, each stored seq the
    first its newest row holds (the last by created_at in stored order, as _settle's stable sort leaves it)."""
    newest: dict[int, _Stored] = {}
    for (seq, _), row in rows.items():
        held = newest.get(seq)
        if held is None or _aware(row.created_at) >= _aware(held.created_at):
            newest[seq] = row
    first = {seq: row.first for seq, row in newest.items()}
    first.update((seq, (attempt.first_seq, attempt.first_retry_count)) for seq, attempt in incoming.items())
    return Settlement(first=first)


def _attempt(
    seq: int, hash_: bytes | None, retry_count: int, created_at: float, key: str | None, first: tuple[int, int] | None
) -> Attempt:
    first_seq, first_retry_count = first if first is not None else (seq, retry_count)
    # Rounded to the microsecond the timestamp columns keep, so a record and its own stored row compare equal.
    return Attempt(seq, hash_, retry_count, round(created_at, 6), key is not None, first_seq, first_retry_count)


def _update_firsts(
    conn: Connection, trajectory_id: str, rows: dict[tuple[int, int], _Stored], settlement: Settlement
) -> None:
    """A stored call that an earlier attempt (arriving late) joined now stands for that attempt too."""
    changed: set[int] = set()
    for (seq, _), row in rows.items():
        first = settlement.first.get(seq)
        if first is not None and row.first != first:
            changed.add(seq)
    for seq in sorted(changed):
        first_seq, first_retry_count = settlement.first[seq]
        conn.execute(
            update(_calls)
            .where(_calls.c.trajectory_id == trajectory_id, _calls.c.seq == seq)
            .values(first_seq=first_seq, first_retry_count=first_retry_count)
        )


def _predecessor_at(
    conn: Connection,
    trajectory_id: str,
    key: tuple[int, int],
    in_batch: dict[tuple[int, int], CallRecord],
    rows: dict[tuple[int, int], _Stored],
    rebuilt: StoredCalls | None,
    digests: dict[str, bytes | None],
) -> Predecessor | None:
    """The call at (seq, choice) as a predecessor after this batch: the incoming record if any, else the stored row
    rebuilt in full (`rebuilt` holds the trajectory when it is stored); None when neither holds it."""
    if key in in_batch:
        return _predecessor_of(in_batch[key], digests[in_batch[key].id])
    if key not in rows or rebuilt is None:
        return None
    seq, choice = key
    response = conn.execute(_RESPONSE, {"trajectory_id": trajectory_id, "seq": seq, "choice_index": choice}).scalar_one()
    return Predecessor(
        seq,
        rebuilt.prompt(key),
        rebuilt.completion(key),
        _answered_tool_call(response, choice),
        message_digests(rebuilt.request(key), keeps_key_order(conn.dialect.name)),
    )


def _with_messages(
    lineage: Lineage, own: bytes | None, predecessor: Predecessor | None, longer: bool = False
) -> Lineage:
    """The lineage with the messages' storage prefix: the leading messages shared with the predecessor's request
    (`longer`: only if that is more than the lineage's prefix already)."""
    if predecessor is None:
        return lineage
    shared = shared_messages(own, predecessor.messages)
    if not shared or (longer and shared <= lineage.messages_prefix_len):
        return lineage
    return lineage._replace(messages_parent_seq=predecessor.seq, messages_prefix_len=shared)


def materialize_prompts(conn: Connection) -> int:
    """Give every compact call its full prompt back (parent_seq null, prefix_len 0); returns how many were
    rewritten. For a downgrade below revision 0004, which drops the columns that explain a compact prompt."""
    return _materialize(
        conn,
        _calls.c.parent_seq,
        False,
        lambda prompt, _: {"prompt_token_ids": encode_ids(prompt), "parent_seq": None, "prefix_len": 0},
    )


def materialize_requests(conn: Connection) -> int:
    """Give every call with compact messages its full request back (messages_parent_seq null, messages_prefix_len
    0); returns how many were rewritten. For a downgrade below revision 0006, which drops the columns that explain a
    compact request."""
    return _materialize(
        conn,
        _calls.c.messages_parent_seq,
        True,
        lambda _, request: {"request": request, "messages_parent_seq": None, "messages_prefix_len": 0},
    )


def _materialize(
    conn: Connection,
    parent: Any,
    requests: bool,
    values: Callable[[list[int] | None, dict[str, Any] | None], dict[str, Any]],
) -> int:
    """Rewrite every row whose `parent` column is set with the `values` its full prompt and request give it."""
    trajectory_ids = conn.execute(select(_calls.c.trajectory_id).where(parent.is_not(None)).distinct()).scalars().all()
    count = 0
    for trajectory_id in trajectory_ids:
        every = rebuild_calls(conn, trajectory_id, requests=requests).every_call()
        compact = conn.execute(
            select(_calls.c.seq, _calls.c.choice_index).where(
                _calls.c.trajectory_id == trajectory_id, parent.is_not(None)
            )
        ).all()
        for row in compact:
            conn.execute(
                update(_calls)
                .where(
                    _calls.c.trajectory_id == trajectory_id,
                    _calls.c.seq == row.seq,
                    _calls.c.choice_index == row.choice_index,
                )
                .values(**values(*every[(row.seq, row.choice_index)]))
            )
            count += 1
    return count


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
