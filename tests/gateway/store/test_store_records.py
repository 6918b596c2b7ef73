"""write_calls: one transaction that upserts runs, groups, trajectories and calls, exactly once, on both backends."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import Engine, select, text
from sqlalchemy.exc import DataError, OperationalError

from gateway.recorder.spool_lines import is_record_error
from gateway.store import db, records
from gateway.store.arrays import decode_ids, decode_logprobs, pack_arrays
from gateway.store.models import Call, Group, Run, Trajectory
from gateway.store.records import count_calls, ping, write_calls
from tests.support.factories import make_record
from tests.support.pgcluster import free_port


def _calls(engine: Engine, trajectory_id: str) -> list[dict]:
    with engine.connect() as conn:
        rows = conn.execute(select(Call.__table__).where(Call.trajectory_id == trajectory_id).order_by(Call.seq))
        return [dict(row._mapping) for row in rows]


def _one(engine: Engine, table: type, key: str) -> dict:
    with engine.connect() as conn:
        pk = list(table.__table__.primary_key.columns)[0]
        return dict(conn.execute(select(table.__table__).where(pk == key)).one()._mapping)


def test_creates_parents_and_stores_arrays_exactly(engine: Engine) -> None:
    record = make_record(prompt_tokens=1000, completion_tokens=200, seed=1, group_size=4, created_at=1_700_000_000.25)
    write_calls(engine, [record])

    run = _one(engine, Run, "run-a")
    assert run["base_model"] == "base-model" and run["config"] == {}
    group = _one(engine, Group, "group-1")
    assert (group["run"], group["mode"], group["expected_size"], group["state"]) == ("run-a", "train", 4, "open")
    trajectory = _one(engine, Trajectory, "traj-1")
    assert (trajectory["run"], trajectory["group_id"], trajectory["untrainable_calls"]) == ("run-a", "group-1", 0)

    [row] = _calls(engine, "traj-1")
    assert row["id"] == record.id
    assert decode_ids(row["prompt_token_ids"]) == record.prompt_token_ids
    assert decode_ids(row["completion_token_ids"]) == record.completion_token_ids
    logprobs = decode_logprobs(row["completion_logprobs"])
    assert logprobs == record.completion_logprobs and logprobs[0] == -math.inf
    assert row["request"] == record.request and row["usage"] == record.usage
    assert row["created_at"].replace(tzinfo=None).isoformat() == "2023-11-14T22:13:20.250000"


def _stored_as(engine: Engine, trajectory_id: str, group_id: str) -> list[dict]:
    """Write one varied batch under `trajectory_id` and return its stored rows (calls, then its group and
    trajectory) without the columns that name them (request_hash covers the trajectory id too) or that hold the
    time of writing, with which JSON columns hold SQL NULL (the JSON null reads back as None too)."""
    batch = [
        make_record(
            trajectory_id, 0, seed=2, group_id=group_id, stream=True, ttft_ms=3.25, created_at=1_700_000_000.5,
            latency_ms=7, group_size=3,
        ),
        make_record(
            trajectory_id, 1, seed=3, group_id=group_id, created_at=1_700_000_001.0, prompt_token_ids=None,
            completion_token_ids=None, completion_logprobs=None, response=None, usage=None, status_code=502,
            error="boom \u00e9", trainable=False, untrainable_reason="upstream status 502", idempotency_key="k-1",
            retry_count=2,
        ),
        make_record(
            trajectory_id, 2, seed=4, group_id=group_id, created_at=1_700_000_002.0, choice_index=1,
            finish_reason="length",
            request={"model": "run-a", "messages": [{"role": "user", "content": "hi \u2603", "extra": [1, None]}]},
            response={"choices": [{"index": 0}, {"index": 1, "message": {"content": "x"}}]},
        ),
        make_record(
            trajectory_id, 3, seed=5, group_id=group_id, created_at=1_700_000_003.0, latency_ms=math.inf,
            ttft_ms=-math.inf, error='quote " backslash \\ newline \n',
            request={"model": "run-a", "messages": [{"role": "user", "content": "nul \x00 inside"}]},
            usage={1: "a key that is not a string", "nested": {"x": 1.5e300}},
        ),
    ]
    write_calls(engine, batch)
    calls = [
        {k: v for k, v in row.items() if k not in ("id", "trajectory_id", "request_hash")}
        for row in _calls(engine, trajectory_id)
    ]
    with engine.connect() as conn:
        nulls = conn.execute(
            text(
                "SELECT request IS NULL, response IS NULL, usage IS NULL FROM calls WHERE trajectory_id = :t "
                "ORDER BY seq"
            ),
            {"t": trajectory_id},
        ).all()
    group = {k: v for k, v in _one(engine, Group, group_id).items() if k not in ("group_id", "created_at")}
    trajectory = _one(engine, Trajectory, trajectory_id)
    trajectory = {k: v for k, v in trajectory.items() if k not in ("trajectory_id", "group_id")}
    return [*calls, [tuple(row) for row in nulls], group, trajectory]


def test_calls_are_stored_as_sqlalchemys_own_upsert_stores_them(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """write_calls binds the calls upsert's parameters itself (records._execute_many on SQLite) and sends groups,
    trajectories and calls as one statement of arrays each on Postgres (records._insert_rows), to skip per-row work
    in SQLAlchemy and psycopg; every column must still be stored exactly as SQLAlchemy's own `conn.execute(upsert,
    rows)` stores it, on both backends: JSON nulls, booleans, datetimes, bytes, text, ints among floats, the
    columns the models default."""
    direct = _stored_as(engine, "traj-direct", "group-direct")
    monkeypatch.setattr(records, "_execute_many", lambda conn, statement, rows: conn.execute(statement, rows))
    monkeypatch.setattr(records, "_insert_rows", lambda conn, bulk, rows: conn.execute(bulk.rowwise, rows))
    generic = _stored_as(engine, "traj-generic", "group-generic")
    assert len(direct) == 7 and direct == generic
    assert direct[3]["latency_ms"] == math.inf and direct[3]["request"]["messages"][0]["content"] == "nul \ufffd inside"


def test_a_batch_too_big_for_one_json_document_goes_in_parts(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Postgres takes a batch as one JSONB document (records._insert_rows), which holds at most 255 MB: past
    MAX_DOCUMENT_BYTES the rows go in several documents, every row stored and none sent twice."""
    db.upgrade(pg_url)
    engine = db.make_engine(pg_url)
    sizes: list[int] = []
    real = records._recordset

    def measured(bulk: Any, rows: Any) -> str:
        document = real(bulk, rows)
        sizes.append(len(document))
        return document

    monkeypatch.setattr(records, "MAX_DOCUMENT_BYTES", 20_000)
    monkeypatch.setattr(records, "_recordset", measured)
    try:
        batch = [make_record(f"big-{n}", 0, prompt_tokens=1000, seed=n) for n in range(12)]
        write_calls(engine, batch)
        stored = {row["id"]: row for n in range(12) for row in _calls(engine, f"big-{n}")}
    finally:
        engine.dispose()
    assert sorted(stored) == sorted(record.id for record in batch)
    assert all(decode_ids(stored[r.id]["prompt_token_ids"]) == r.prompt_token_ids for r in batch)
    sent = [size for size in sizes if size <= 20_000]
    assert len(sent) > 3 and max(sent) <= 20_000  # the calls went in parts, each within the limit


def test_missing_arrays_stay_null(engine: Engine) -> None:
    record = make_record(
        prompt_token_ids=None, completion_token_ids=None, completion_logprobs=None, status_code=500, error="boom"
    )
    write_calls(engine, [record])
    [row] = _calls(engine, "traj-1")
    assert row["prompt_token_ids"] is None and row["completion_logprobs"] is None and row["error"] == "boom"


def test_group_size_is_filled_by_a_later_call_and_then_kept(engine: Engine) -> None:
    write_calls(engine, [make_record("t1", 0, group_size=None)])
    assert _one(engine, Group, "group-1")["expected_size"] is None
    write_calls(engine, [make_record("t1", 1, group_size=4)])
    assert _one(engine, Group, "group-1")["expected_size"] == 4
    write_calls(engine, [make_record("t2", 0, group_size=8)])
    assert _one(engine, Group, "group-1")["expected_size"] == 4


def test_retry_replaces_the_earlier_attempt(engine: Engine) -> None:
    first = make_record(seq=3, seed=1, finish_reason="length", created_at=100.0)
    retry = make_record(seq=3, seed=2, finish_reason="stop", retry_count=1, created_at=101.0)
    write_calls(engine, [first])
    write_calls(engine, [retry])

    assert count_calls(engine, "traj-1") == 1
    [row] = _calls(engine, "traj-1")
    assert (row["id"], row["finish_reason"], row["retry_count"]) == (retry.id, "stop", 1)
    assert decode_ids(row["prompt_token_ids"]) == retry.prompt_token_ids


def test_replaying_a_record_is_idempotent(engine: Engine) -> None:
    record = make_record(seq=0, seed=5)
    write_calls(engine, [record])
    write_calls(engine, [record, make_record(seq=1)])
    write_calls(engine, [record])
    assert count_calls(engine) == 2
    assert _calls(engine, "traj-1")[0]["id"] == record.id


def test_a_stale_replay_does_not_roll_back_a_newer_attempt(engine: Engine) -> None:
    """A record that spilled to the spool can reach the DB after the retry that replaced it."""
    first = make_record(seq=0, created_at=100.0)
    retry = make_record(seq=0, created_at=101.0)
    write_calls(engine, [retry])
    write_calls(engine, [first])
    assert [row["id"] for row in _calls(engine, "traj-1")] == [retry.id]


def test_duplicates_within_a_batch_keep_the_newest_record(engine: Engine) -> None:
    first = make_record(seq=0, created_at=100.0)
    second = make_record(seq=0, created_at=100.0)  # same time: the later in the batch wins
    stale = make_record(seq=0, created_at=99.0)  # a late spool replay of an older attempt
    other_choice = make_record(seq=0, choice_index=1)
    write_calls(engine, [first, other_choice, second, stale])
    rows = _calls(engine, "traj-1")
    assert sorted((row["choice_index"], row["id"]) for row in rows) == [(0, second.id), (1, other_choice.id)]


def test_arrays_handed_over_packed_are_stored_without_packing_them_again(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer hands over each record's arrays as its log line packed them: a trajectory's first call alone in the
    batch and a longer trajectory's calls alike are stored from them, and only a record handed none is packed."""
    batch = [make_record("long", seq, seed=seq) for seq in range(3)] + [make_record("alone", 0, seed=9)]
    packed = [pack_arrays(r.prompt_token_ids, r.completion_token_ids, r.completion_logprobs) for r in batch]
    packing: list[str] = []
    real_pack = records.pack_arrays

    def noting(*arrays: Any) -> Any:
        packing.append("packed")
        return real_pack(*arrays)

    monkeypatch.setattr(records, "pack_arrays", noting)
    write_calls(engine, batch, packed=packed)
    assert packing == []
    [alone] = _calls(engine, "alone")
    assert (alone["prompt_token_ids"], alone["completion_token_ids"], alone["completion_logprobs"]) == packed[3]
    long = _calls(engine, "long")
    assert [row["completion_logprobs"] for row in long] == [arrays.logprobs for arrays in packed[:3]]
    later, other = make_record("long", 3), make_record("other", 0)
    other_packed = real_pack(other.prompt_token_ids, other.completion_token_ids, other.completion_logprobs)
    write_calls(engine, [later, other], packed=[None, other_packed])
    assert packing == ["packed"] and count_calls(engine, "long") == 4 and count_calls(engine, "other") == 1


def test_untrainable_calls_are_counted_per_trajectory(engine: Engine) -> None:
    write_calls(
        engine,
        [
            make_record("t1", 0, trainable=False, untrainable_reason="no logprobs"),
            make_record("t1", 1, trainable=True),
            make_record("t1", 2, trainable=False, untrainable_reason="upstream status 500"),
            make_record("t2", 0, trainable=False, untrainable_reason="no logprobs"),
        ],
    )
    assert _one(engine, Trajectory, "t1")["untrainable_calls"] == 2
    assert _one(engine, Trajectory, "t2")["untrainable_calls"] == 1

    # A successful retry of seq 2 makes it trainable again; t2 is not in this batch and keeps its count.
    write_calls(engine, [make_record("t1", 2, trainable=True, created_at=2e9)])
    assert _one(engine, Trajectory, "t1")["untrainable_calls"] == 1
    assert _one(engine, Trajectory, "t2")["untrainable_calls"] == 1


ODD_IDS = ['a"b', "ab", "c\\d", "NULL", "x,y", "{z}", " sp ", "é✓", ""]


def test_ids_with_quotes_commas_braces_or_null_find_their_own_rows(engine: Engine) -> None:
    """The batch's ids reach Postgres as one array literal (`_TextArray`): each must match itself and nothing else in
    the statements that look rows up by them (the stored calls, the untrainable count, the group reopen)."""
    write_calls(
        engine,
        [make_record(t, 0, group_id=f"g{t}", trainable=False, untrainable_reason="no logprobs") for t in ODD_IDS],
    )
    assert {t: _one(engine, Trajectory, t)["untrainable_calls"] for t in ODD_IDS} == {t: 1 for t in ODD_IDS}
    with engine.begin() as conn:
        conn.execute(Group.__table__.update().where(Group.group_id == 'ga"b').values(state="trained"))

    # A retry of the first call of every other id: it replaces the stored row it finds, and the count follows.
    retried = ODD_IDS[1::2]
    write_calls(engine, [make_record(t, 0, group_id=f"g{t}", created_at=2e9, retry_count=1) for t in retried])
    assert {t: _one(engine, Trajectory, t)["untrainable_calls"] for t in ODD_IDS} == {
        t: 0 if t in retried else 1 for t in ODD_IDS
    }
    assert all(count_calls(engine, t) == 1 for t in ODD_IDS)
    assert _one(engine, Group, 'ga"b')["state"] == "trained"  # no trajectory joined it

    write_calls(engine, [make_record("late", 0, group_id='ga"b')])
    assert _one(engine, Group, 'ga"b')["state"] == "open"
    assert _one(engine, Group, "gab")["state"] == "open"


def test_count_calls_and_ping(engine: Engine) -> None:
    write_calls(engine, [make_record("t1", 0), make_record("t1", 1), make_record("t2", 0)])
    assert (count_calls(engine), count_calls(engine, "t1"), count_calls(engine, "nope")) == (3, 2, 0)
    assert ping(engine)


def test_ping_is_false_when_nothing_listens() -> None:
    engine = db.make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/postgres")
    try:
        assert ping(engine) is False
    finally:
        engine.dispose()


def test_plain_upserts_are_prepared_and_joins_are_not(pg_url: str) -> None:
    """Postgres keeps plans for the inserts (they read no other table) but plans the updates that join calls and
    trajectories afresh each time, so a plan chosen while the tables were small never sticks as they grow."""
    db.upgrade(pg_url)
    engine = db.make_engine(pg_url, pool_size=1, max_overflow=0)  # every write and the check share one session
    try:
        for batch in range(3):
            write_calls(engine, [make_record(f"prep-{batch}", seq=seq) for seq in range(2)])
        with engine.connect() as conn:
            prepared = [row[0] for row in conn.exec_driver_sql("SELECT statement FROM pg_prepared_statements")]
            assert conn.connection.driver_connection.prepare_threshold is None  # back to unprepared afterwards
    finally:
        engine.dispose()
    assert count_calls_url(pg_url) == 6
    assert any(s.startswith("INSERT INTO calls") for s in prepared), prepared
    assert any(s.startswith("INSERT INTO trajectories") for s in prepared), prepared
    assert not any(s.startswith("UPDATE") for s in prepared), prepared


def test_a_batch_s_ids_are_one_constant_in_the_plan_not_parsed_per_row(pg_url: str) -> None:
    """The id list is typed text[] at its placeholder, so Postgres parses it once. Cast from text inside the statement
    it was parsed again for every row a sequential scan filtered: a batch of 128 took 150 ms instead of 25 ms."""
    db.upgrade(pg_url)
    engine = db.make_engine(pg_url)
    try:
        write_calls(engine, [make_record(f"plan-{i}", 0) for i in range(3)])
        statement = records._statements("postgresql").stored
        with engine.connect() as conn:
            conn.exec_driver_sql("SET enable_indexscan = off")  # the small table's sequential scan, whatever it holds
            conn.exec_driver_sql("SET enable_bitmapscan = off")
            compiled = statement.compile(dialect=engine.dialect)
            ids = records._TextArray().bind_processor(engine.dialect)(["plan-0", 'odd "one"', "plan-2"])
            plan = "\n".join(row[0] for row in conn.exec_driver_sql("EXPLAIN VERBOSE " + str(compiled), {"ids": ids}))
    finally:
        engine.dispose()
    assert "Seq Scan on public.calls" in plan
    assert "::text[]" in plan and "cstring" not in plan, plan


@pytest.mark.parametrize(
    "ids",
    [[], ["gen-0", "gen-1"], ODD_IDS, ["gen-0", 'a"b', "gen-2"], ["gen-0", "c\\d"], [""], ["NULL"]],
)
def test_an_id_list_reaches_postgres_as_itself(pg_url: str, ids: list[str]) -> None:
    """Plain ids take the literal's fast path (no element escaped), any with a quote or backslash the escaping one:
    Postgres reads back exactly the list either way."""
    engine = db.make_engine(pg_url)
    try:
        literal = records._TextArray().bind_processor(engine.dialect)(ids)
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT %(ids)s::text[]", {"ids": literal}).scalar_one() == ids
    finally:
        engine.dispose()


def test_the_writer_s_driver_errors_are_sqlalchemy_s(pg_url: str) -> None:
    """The writer's statements go to psycopg's cursor (records._driver_execute), past SQLAlchemy's execution, whose
    exception classes the writer sorts failures by: a value the database refuses must still read as the record's
    fault (set aside), a lost connection as the database's (spooled, retried) and be invalidated, not pooled again."""
    engine = db.make_engine(pg_url)
    try:
        with engine.connect() as conn, pytest.raises(DataError) as refused:
            records._driver_execute(conn, "SELECT %(v)s::int", {"v": "not a number"})
        assert is_record_error(refused.value)
        with engine.connect() as conn:
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
            with engine.connect() as other:
                other.exec_driver_sql(f"SELECT pg_terminate_backend({pid}, 10000)")  # returns once it has exited
            with pytest.raises(OperationalError) as lost:
                records._driver_execute(conn, "SELECT 1", {})
            assert lost.value.connection_invalidated and conn.invalidated
        assert not is_record_error(lost.value)
        with engine.connect() as conn:  # the pool hands out a live connection again
            assert records._driver_execute(conn, "SELECT %(v)s::int", {"v": "7"}) == [(7,)]
    finally:
        engine.dispose()


def count_calls_url(url: str) -> int:
    engine = db.make_engine(url)
    try:
        return count_calls(engine)
    finally:
        engine.dispose()


def test_a_value_longer_than_its_column_is_refused_not_cut(pg_url: str) -> None:
    """Postgres writes a batch through arrays of unbounded text (records._bulk): the column's own length must still
    refuse a longer value, as a row-by-row insert does (the writer then sets the record aside), never cut it."""
    engine = db.make_engine(pg_url)
    try:
        db.upgrade(pg_url)
        with pytest.raises(DataError):
            write_calls(engine, [make_record(idempotency_key="k" * 257)])
        with pytest.raises(DataError):  # text cannot hold a NUL: refused, as a row-by-row insert refuses it
            write_calls(engine, [make_record(error="a \x00 b")])
        write_calls(engine, [make_record(idempotency_key="k" * 256)])
        assert _calls(engine, "traj-1")[0]["idempotency_key"] == "k" * 256
    finally:
        engine.dispose()


def test_unrelated_attempts_settle_as_the_full_matching_settles_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """records._settle skips matching each incoming attempt against every stored call when none can match
    (records._unrelated); over generated stored rows and batches (shared bodies, retries, several choices a seq,
    equal timestamps, rows from before first_seq was kept) it must give what the full matching gives."""
    rng = random.Random(7)
    unrelated = records._unrelated
    taken: list[bool] = []
    for _ in range(3000):
        bodies = [b"a", b"b", b"c", b"d", b"e", b"f", None]
        rows = {}
        for seq in rng.sample(range(12), rng.randint(0, 6)):
            first = rng.choice([None, (seq, 0), (max(seq - 1, 0), 0)])
            for choice in range(rng.choice([1, 1, 2])):
                rows[(seq, choice)] = records._Stored(
                    trajectory_id="t",
                    seq=seq,
                    choice_index=choice,
                    id=f"{seq}-{choice}",
                    created_at=datetime.fromtimestamp(1_700_000_000 + rng.choice([seq, 20]), UTC),
                    parent_seq=None,
                    messages_parent_seq=None,
                    request_hash=rng.choice(bodies),
                    retry_count=rng.randint(0, 2),
                    idempotency_key=rng.choice([None, None, "k"]),
                    first_seq=None if first is None else first[0],
                    first_retry_count=None if first is None else first[1],
                    tree_parent_seq=None,
                    tree_parent_choice=None,
                    tokens_len=None,
                    tokens_key=None,
                )
        batch = [
            make_record("t", seq, choice_index=choice, retry_count=rng.randint(0, 2), created_at=1_700_000_000 + seq)
            for seq in rng.sample(range(16), rng.randint(1, 4))
            for choice in range(rng.choice([1, 1, 2]))
        ]
        hashes = {("t", r.seq): rng.choice(bodies) for r in batch}
        def counted(rows: dict, incoming: dict) -> bool:
            taken.append(unrelated(rows, incoming))
            return taken[-1]

        monkeypatch.setattr(records, "_unrelated", counted)
        quick = records._settle(rows, batch, hashes)
        monkeypatch.setattr(records, "_unrelated", lambda rows, incoming: False)
        full = records._settle(rows, batch, hashes)
        assert (quick.dropped, quick.removed, quick.first) == (full.dropped, full.removed, full.first)
    assert 300 < sum(taken) < len(taken)  # both ways were taken often enough to be compared


@pytest.mark.parametrize("retry_count", [0, 2])
def test_a_first_call_alone_in_its_batch_is_stored_as_with_its_next_call(engine: Engine, retry_count: int) -> None:
    """A trajectory's first call alone in a batch skips settling and placing (there is nothing to settle it with or
    place it among): its row, and then its next call's, are what the whole path writes for the two in one batch."""

    def turns(trajectory_id: str) -> list[Any]:
        first = make_record(trajectory_id, 0, seed=3, retry_count=retry_count, created_at=1_700_000_000.0)
        second = make_record(
            trajectory_id,
            1,
            seed=4,
            created_at=1_700_000_001.0,
            prompt_token_ids=[*first.prompt_token_ids, *first.completion_token_ids, 7, 8],
            request={"model": "run-a", "messages": [*first.request["messages"], {"role": "user", "content": "more"}]},
        )
        return [first, second]

    cache = records.LineageCache()
    alone = turns("alone")
    write_calls(engine, alone[:1], cache)
    assert cache.get("alone", 0, alone[0].id) is not None  # the next turn finds it without reading it back
    write_calls(engine, alone[1:], cache)
    write_calls(engine, turns("together"), records.LineageCache())

    def shown(row: dict) -> dict:
        return {k: v for k, v in row.items() if k not in ("id", "trajectory_id", "request_hash")}

    stored = _calls(engine, "alone")
    assert [shown(row) for row in stored] == [shown(row) for row in _calls(engine, "together")]
    assert (stored[0]["merge_reason"], stored[0]["first_retry_count"], stored[0]["tree_parent_seq"]) == (
        "first_call",
        retry_count,
        None,
    )
    assert (stored[1]["tree_parent_seq"], stored[1]["parent_seq"], stored[1]["messages_prefix_len"]) == (0, 0, 1)
