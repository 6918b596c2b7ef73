"""Linear storage of request messages: a call stores only the messages past those it shares with its predecessor's
request, and every reader (read API view, export, JSON Lines, the judge's group load, the stored row rebuilt) gets
back exactly what storing the whole request reads back, on both backends. The conversation is the one recorded from
real vLLM + SmolLM2 (4, 6, 8 and 10 messages; its tool-call turn breaks the token lineage, not the messages')."""

from __future__ import annotations

import copy
import io
from typing import Any

import orjson
import pytest
from sqlalchemy import Engine, Text, cast, func, select, text

from gateway.store import db
from gateway.store import records as store_records
from gateway.store.call_record import CallRecord
from gateway.store.export import iter_trajectories
from gateway.store.export_formats import write_jsonl
from gateway.store.judging import load_group
from gateway.store.lineage import classify
from gateway.store.models import Call
from gateway.store.reads import trajectory_view
from gateway.store.records import LineageCache, write_calls
from tests.support.factories import make_record
from tests.support.lineage_writes import BATCHINGS, conversation, write_batched
from tests.support.stored import insert_old_calls, stored_calls

REFERENCE_GROUP = "reference"


def _url(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


def _rows(engine: Engine, trajectory_id: str = "traj-1") -> list[Any]:
    with engine.connect() as conn:
        return conn.execute(
            select(Call.seq, Call.choice_index, Call.request, Call.messages_parent_seq, Call.messages_prefix_len)
            .where(Call.trajectory_id == trajectory_id)
            .order_by(Call.seq, Call.choice_index)
        ).all()


def _layout(engine: Engine, trajectory_id: str = "traj-1") -> list[tuple[int | None, int, int]]:
    """(messages_parent_seq, messages_prefix_len, messages the row holds) per stored call."""
    rows = _rows(engine, trajectory_id)
    return [(r.messages_parent_seq, r.messages_prefix_len, len(r.request["messages"])) for r in rows]


def _dumps(value: Any) -> bytes:
    return orjson.dumps(value)


def _every_reader(engine: Engine, trajectory_id: str, group_id: str = "group-1") -> dict[str, list[bytes]]:
    """Each call's messages (and full request, from the row rebuilt) as every reader returns them, serialised in the
    order read, so a difference in keys, key order or types shows."""
    view = trajectory_view(engine, trajectory_id)
    assert view is not None
    [exported] = [t for t in iter_trajectories(engine, "run-a") if t["trajectory_id"] == trajectory_id]
    out = io.BytesIO()
    write_jsonl([exported], out)
    jsonl = orjson.loads(out.getvalue())
    group = load_group(engine, group_id)
    assert group is not None
    [judged] = [t for t in group.trajectories if t["trajectory_id"] == trajectory_id]
    return {
        "read_api": [_dumps(c["messages"]) for c in view["calls"]],
        "export": [_dumps(c["messages"]) for c in exported["calls"]],
        "jsonl": [_dumps(c["messages"]) for c in jsonl["calls"]],
        "judge": [_dumps(c["messages"]) for c in judged["calls"]],
        "request": [_dumps(c["request"]) for c in stored_calls(_url(engine), trajectory_id)],
    }


def _whole(engine: Engine, records: list[CallRecord]) -> dict[str, list[bytes]]:
    """What storing each request whole reads back: every record written as the first call of a trajectory of its
    own (nothing to share), read through the same readers."""
    expected: dict[str, list[bytes]] = {}
    for n, record in enumerate(records):
        reference = copy.copy(record)
        reference.id, reference.trajectory_id, reference.group_id = f"ref-{n}", f"ref-{n}", REFERENCE_GROUP
        write_calls(engine, [reference])
        assert _layout(engine, f"ref-{n}")[0][:2] == (None, 0)
        for reader, values in _every_reader(engine, f"ref-{n}", REFERENCE_GROUP).items():
            expected.setdefault(reader, []).extend(values)
    return expected


def _assert_exact(engine: Engine, records: list[CallRecord], trajectory_id: str = "traj-1") -> None:
    """Every reader returns, byte for byte, what whole requests read back; on SQLite, also what the client sent."""
    got = _every_reader(engine, trajectory_id)
    assert got == _whole(engine, records)
    if engine.dialect.name == "sqlite":
        sent = [_dumps((r.request or {}).get("messages")) for r in records]
        assert got["read_api"] == sent
        assert got["request"] == [_dumps(r.request) for r in records]


def _with_messages(record: CallRecord, messages: list[Any], **overrides: Any) -> CallRecord:
    changed = copy.copy(record)
    changed.id = make_record().id
    changed.request = {**(record.request or {}), "messages": messages}
    for name, value in overrides.items():
        setattr(changed, name, value)
    return changed


# --- growing conversations ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batching", BATCHINGS)
def test_a_growing_conversation_stores_only_the_new_messages(engine: Engine, batching: str) -> None:
    calls = conversation()
    write_batched(engine, calls, batching)
    # The tool-result turn breaks the token lineage (the template dropped the call) but its messages still extend.
    assert _layout(engine) == [(None, 0, 4), (1, 4, 2), (2, 6, 2), (3, 8, 2)]
    _assert_exact(engine, calls)


def test_messages_with_keys_in_an_order_postgres_does_not_keep_still_share_after_a_restart(engine: Engine) -> None:
    """JSONB hands keys back in its own order: a predecessor rebuilt from the database must still match the same
    messages as the client sends them, or nothing would be shared once the cache is cold (another gateway process)."""
    messages = [{"role": "system", "name": "x", "content": "be brief", "weight": 2}, {"role": "user", "content": "hi"}]
    first = make_record("traj-1", seq=1, request={"tools": [], "messages": messages, "model": "run-a"})
    second = _with_messages(first, [*messages, {"role": "assistant", "content": "hello"}], seq=2)
    write_calls(engine, [first])
    write_calls(engine, [second])  # no predecessor cache: `first` is rebuilt from the database
    assert _layout(engine) == [(None, 0, 2), (1, 2, 1)]
    _assert_exact(engine, [first, second])


# --- histories that do not simply grow -----------------------------------------------------------------------------


@pytest.mark.parametrize("edited_at", [0, 3, 7])
def test_an_edited_history_stores_the_messages_from_the_first_change(engine: Engine, edited_at: int) -> None:
    calls = conversation()
    messages = copy.deepcopy(calls[3].request["messages"])  # type: ignore[index]
    messages[edited_at]["content"] = "something else entirely"
    calls[3] = _with_messages(calls[3], messages)
    for call in calls:
        write_calls(engine, [call])
    parent, shared = (None, 0) if edited_at == 0 else (3, edited_at)
    assert _layout(engine)[3] == (parent, shared, 10 - shared)
    _assert_exact(engine, calls)


def test_a_message_equal_only_to_python_is_not_shared(engine: Engine) -> None:
    """`True == 1 == 1.0` in Python, not in JSON: sharing such a message would change what reads back."""
    base = [{"role": "user", "content": "a", "weight": 1}]
    first = make_record("traj-1", seq=1, request={"model": "run-a", "messages": base})
    second = _with_messages(
        first, [{"role": "user", "content": "a", "weight": True}, {"role": "user", "content": "b"}], seq=2
    )
    third = _with_messages(second, [{"role": "user", "content": "a", "weight": 1.0}], seq=3)
    write_calls(engine, [first, second, third])
    assert _layout(engine) == [(None, 0, 1), (None, 0, 2), (None, 0, 1)]
    _assert_exact(engine, [first, second, third])


def test_reordered_keys_are_shared_only_where_the_database_forgets_key_order(engine: Engine) -> None:
    first = make_record("traj-1", seq=1, request={"model": "run-a", "messages": [{"role": "user", "content": "a"}]})
    second = _with_messages(first, [{"content": "a", "role": "user"}, {"role": "user", "content": "b"}], seq=2)
    write_calls(engine, [first, second])
    shared = 1 if engine.dialect.name == "postgresql" else 0
    assert _layout(engine)[1][1] == shared
    _assert_exact(engine, [first, second])


def test_a_truncated_history_shares_what_it_kept_at_the_front(engine: Engine) -> None:
    calls = conversation()
    kept = calls[3].request["messages"]  # type: ignore[index]
    calls[3] = _with_messages(calls[3], [kept[0], *kept[-3:]])  # the agent dropped old turns, kept the system prompt
    write_calls(engine, calls)
    assert _layout(engine)[3] == (3, 1, 3)
    calls.append(_with_messages(calls[3], kept[:2], seq=calls[3].seq + 1))  # cut to fewer messages than its parent
    write_calls(engine, [calls[4]])
    assert _layout(engine)[4] == (4, 1, 1)
    _assert_exact(engine, calls)


def test_a_retry_sent_as_a_new_call_stores_no_messages(engine: Engine) -> None:
    turn1 = conversation()[0]
    again = _with_messages(turn1, turn1.request["messages"], seq=turn1.seq + 1)  # type: ignore[index]
    write_calls(engine, [turn1, again])
    assert _layout(engine) == [(None, 0, 4), (1, 4, 0)]
    _assert_exact(engine, [turn1, again])


def test_choices_of_an_n2_call_share_choice_0_of_the_call_before(engine: Engine) -> None:
    turn1, turn2, turn3 = conversation()[:3]
    second_choice = _with_messages(turn2, turn2.request["messages"], choice_index=1)  # type: ignore[index]
    write_calls(engine, [turn1, turn2, second_choice])
    write_calls(engine, [turn3])  # no predecessor cache: choice 0 of turn 2 is rebuilt from the database
    assert _layout(engine) == [(None, 0, 4), (1, 4, 2), (1, 4, 2), (2, 6, 2)]
    _assert_exact(engine, [turn1, turn2, second_choice, turn3])


def test_a_call_without_messages_is_stored_whole(engine: Engine) -> None:
    turn1 = conversation()[0]
    completions = make_record("traj-1", seq=turn1.seq + 1, endpoint="completions", request={"prompt": "abc"})
    bad = make_record("traj-1", seq=turn1.seq + 2, request={"model": "run-a", "messages": "not a list"})
    after = _with_messages(turn1, turn1.request["messages"], seq=turn1.seq + 3)  # type: ignore[index]
    write_calls(engine, [turn1, completions, bad, after])
    assert [(r.messages_parent_seq, r.messages_prefix_len) for r in _rows(engine)] == [(None, 0)] * 4
    view = trajectory_view(engine, "traj-1")
    assert view is not None
    whole = turn1.request["messages"]  # type: ignore[index]
    assert [c["messages"] for c in view["calls"]] == [whole, "abc", "not a list", whole]


# --- retries and replays --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cold", [False, True])
def test_a_retry_that_replaces_a_parent_gives_its_children_their_whole_request(engine: Engine, cold: bool) -> None:
    turn1, turn2, turn3 = conversation()[:3]
    cache = LineageCache()
    write_calls(engine, [turn1], cache)
    write_calls(engine, [turn2], cache)
    write_calls(engine, [turn3], cache)
    # A late, newer attempt of turn 2 with other messages: turn 3 was stored against the old one.
    edited = turn2.request["messages"][:4] + [{"role": "user", "content": "?"}]  # type: ignore[index]
    retried = _with_messages(turn2, edited)
    retried.created_at = turn3.created_at + 1
    write_calls(engine, [retried], None if cold else cache)
    assert _layout(engine) == [(None, 0, 4), (1, 4, 1), (None, 0, 8)]
    _assert_exact(engine, [turn1, retried, turn3])


def test_a_replayed_record_and_a_stale_attempt_change_nothing(engine: Engine) -> None:
    turn1, turn2 = conversation()[:2]
    write_calls(engine, [turn1, turn2])
    stale = _with_messages(turn1, [{"role": "user", "content": "old"}], created_at=turn1.created_at - 5)
    write_calls(engine, [stale, turn2, turn1])  # a spool replay of rows already written, and an older attempt
    assert _layout(engine) == [(None, 0, 4), (1, 4, 2)]
    _assert_exact(engine, [turn1, turn2])


@pytest.mark.parametrize("cold", [False, True])
def test_children_written_before_their_parents_still_read_back(engine: Engine, cold: bool) -> None:
    """Spool replay and several writers let a later call reach the database first: it is stored against whatever
    precedes it then (or whole), and every read still rebuilds it."""
    calls = conversation()
    cache = None if cold else LineageCache()
    for index in (2, 0, 3, 1):
        write_calls(engine, [calls[index]], cache)
    # seq 3 came first (whole), seq 1 next (first), seq 4 against seq 3, seq 2 against seq 1.
    assert _layout(engine) == [(None, 0, 4), (1, 4, 2), (None, 0, 8), (3, 8, 2)]
    _assert_exact(engine, calls)


# --- data written before revision 0006 ------------------------------------------------------------------------------


def test_old_rows_read_as_before_and_new_calls_compact_against_them(db_url: str) -> None:
    db.upgrade(db_url, "0004")
    engine = db.make_engine(db_url)
    try:
        calls = conversation()
        # Whole requests, as revision 0004 stored every call (its id lineage does not matter here).
        insert_old_calls(engine, [store_records._call_row(c, classify(c.prompt_token_ids, None)) for c in calls[:2]])
        db.upgrade(db_url)
        write_calls(engine, calls[2:])
        assert _layout(engine) == [(None, 0, 4), (None, 0, 6), (2, 6, 2), (3, 8, 2)]
        _assert_exact(engine, calls)

        db.downgrade(db_url, "0004")
        with engine.connect() as conn:
            stored = conn.execute(
                text("SELECT request FROM calls WHERE trajectory_id = 'traj-1' ORDER BY seq")
            ).scalars().all()
        counts = [len((orjson.loads(r) if isinstance(r, str) else r)["messages"]) for r in stored]
        assert counts == [4, 6, 8, 10]
    finally:
        engine.dispose()


def test_the_cache_counts_message_digests_in_its_budget() -> None:
    cache = LineageCache(max_bytes=2 * 16 * 100)
    for n, trajectory_id in enumerate(("a", "b", "c")):
        cache.remember(trajectory_id, store_records.Predecessor(n, [], [], False, bytes(16 * 100)), f"call-{n}")
    assert cache.get("a", 0, "call-0") is None
    cached = cache.get("c", 2, "call-2")
    assert cached is not None and cached.messages == bytes(16 * 100)


def test_stored_request_bytes_grow_linearly_with_turns(engine: Engine) -> None:
    """The point of it all, measured on the real store: the request column of a trajectory of 2k turns holds about
    twice what one of k turns holds (whole requests: four times)."""

    def request_bytes(turns: int) -> int:
        trajectory_id = f"t-{turns}"
        messages: list[dict[str, str]] = []
        for turn in range(turns):
            messages = [*messages, {"role": "user", "content": f"question {turn} " * 20}]
            write_calls(engine, [make_record(trajectory_id, seq=turn + 1, request={"model": "m", "messages": messages})])
            messages = [*messages, {"role": "assistant", "content": f"answer {turn} " * 20}]
        with engine.connect() as conn:
            return int(
                conn.execute(
                    select(func.sum(func.length(cast(Call.request, Text)))).where(Call.trajectory_id == trajectory_id)
                ).scalar_one()
            )

    assert request_bytes(32) / request_bytes(16) < 2.2


def test_each_choice_of_an_n_call_stores_only_its_own_answer(engine: Engine) -> None:
    """Each choice has its own row: a row holding all n answers would make a call's response grow with n squared."""
    answers = [{"index": i, "message": {"role": "assistant", "content": f"answer {i} " * 50}} for i in range(3)]
    response = {"id": "chatcmpl-1", "choices": answers, "usage": {"completion_tokens": 30}}
    calls = [make_record("traj-1", seq=1, choice_index=i, response=response) for i in range(3)]
    write_calls(engine, calls)
    rows = stored_calls(_url(engine), "traj-1")
    assert [r["response"] for r in rows] == [{**response, "choices": [answer]} for answer in answers]
    view = trajectory_view(engine, "traj-1")
    assert view is not None
    assert [c["completion"] for c in view["calls"]] == [a["message"]["content"] for a in answers]
    [exported] = iter_trajectories(engine, "run-a")
    assert [c["completion"] for c in exported["calls"]] == [a["message"]["content"] for a in answers]
