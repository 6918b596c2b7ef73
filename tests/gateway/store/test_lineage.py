"""Merge diagnostics and linear storage: every call says whether it extends its predecessor (and why not), stores only
the prompt ids past what it shares with it, and every read path (read API view, export, the trainer's load) gets the
full prompt back exactly, on both backends. The tool conversation is the one recorded from real vLLM + SmolLM2."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, text

from gateway.store import db
from gateway.store import records as store_records
from gateway.store.arrays import decode_ids, encode_ids
from gateway.store.call_record import CallRecord
from gateway.store.export import iter_trajectories
from gateway.store.lineage import Predecessor, Rebuilder, StoredCall, StoredCalls, classify, common_prefix
from gateway.store.models import Call
from gateway.store.reads import trajectory_view
from gateway.store.records import LineageCache, write_calls
from gateway.store.runs import run_view
from gateway.store.training import load_groups
from tests.support.factories import make_record
from tests.support.lineage_writes import BATCHINGS, conversation, set_reward, write_batched
from tests.support.stored import insert_old_calls


def _naive_prefix(a: list[int], b: list[int]) -> int:
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    return shared


@pytest.mark.parametrize("length", [0, 1, 255, 256, 257, 700, 2_500])
def test_common_prefix_is_the_first_differing_id_wherever_it_falls(length: int) -> None:
    """Against the id-by-id definition: a difference at every position of short lists and around every block
    boundary of long ones, one list a prefix of the other, and equal lists. Ids past 256, so equal ids are distinct
    objects (as parsed from JSON) and equality, not identity, is what matches."""
    base = [100_000 + (i * 7919) % 50_000 for i in range(length)]
    positions = set(range(min(length, 40))) | {p for k in range(0, length + 1, 256) for p in (k - 1, k, k + 1)}
    for at in sorted(p for p in positions if 0 <= p < length):
        other = [int(str(i)) for i in base]  # equal values, new objects
        other[at] += 1
        assert common_prefix(base, other) == at == _naive_prefix(base, other)
        assert common_prefix(other, base + [1, 2]) == at
    assert common_prefix(base, [int(str(i)) for i in base]) == length
    assert common_prefix(base, base + [5, 6, 7]) == length
    assert common_prefix(base + [5, 6, 7], base) == length
    assert common_prefix(base[: length // 2], base) == length // 2
    assert common_prefix([], base) == 0


def _predecessor(record: CallRecord, tool_call: bool = False) -> Predecessor:
    return Predecessor(record.seq, record.prompt_token_ids, record.completion_token_ids, tool_call)


# --- the classification, on the recorded conversation --------------------------------------------------------------


def test_a_plain_chat_turn_extends_its_predecessor() -> None:
    turn1, turn2 = conversation()[:2]
    lineage = classify(turn2.prompt_token_ids, _predecessor(turn1))
    before = len(turn1.prompt_token_ids or []) + len(turn1.completion_token_ids or [])
    assert (lineage.reason, lineage.divergence, lineage.parent_seq, lineage.prefix_len) == ("extends", None, 1, before)


def test_the_turn_after_a_tool_call_diverges_where_the_template_dropped_it() -> None:
    _, tool_call, tool_result, _ = conversation()
    lineage = classify(tool_result.prompt_token_ids, _predecessor(tool_call, tool_call=True))
    # SmolLM2's template renders the assistant's tool-call message without the call: the ids part at the first
    # completion token, which is where the model's `<tool_call>` began.
    assert lineage.reason == "template_dropped_tool_call"
    assert lineage.divergence == len(tool_call.prompt_token_ids or []) == 122
    assert lineage.prefix_len == 122 and lineage.parent_seq == tool_call.seq
    without_tool_call = classify(tool_result.prompt_token_ids, _predecessor(tool_call, tool_call=False))
    assert without_tool_call.reason == "completion_rerendered"


def test_an_edited_history_reports_the_first_changed_token() -> None:
    turn1, turn2 = conversation()[:2]
    edited = list(turn2.prompt_token_ids or [])
    edited[40] += 1
    lineage = classify(edited, _predecessor(turn1))
    assert (lineage.reason, lineage.divergence, lineage.prefix_len) == ("history_edited", 40, 40)


def test_a_truncated_history_is_told_from_an_edit() -> None:
    turn1, turn2 = conversation()[:2]
    prompt = turn1.prompt_token_ids or []
    cut = prompt[:10] + prompt[50:]  # the agent dropped old messages
    lineage = classify(cut, _predecessor(turn1))
    assert (lineage.reason, lineage.divergence) == ("truncated", 10)


def test_first_call_retry_and_missing_ids() -> None:
    turn1, turn2 = conversation()[:2]
    assert classify(turn1.prompt_token_ids, None).reason == "first_call"
    assert classify(turn1.prompt_token_ids, _predecessor(turn1)).reason == "retry"
    assert classify(None, _predecessor(turn1)).reason == "no_ids"
    no_ids = Predecessor(1, None, None, False)
    assert classify(turn2.prompt_token_ids, no_ids).reason == "no_ids"


# --- the store ------------------------------------------------------------------------------------------------------


def _stored(engine: Engine, trajectory_id: str) -> list[Any]:
    with engine.connect() as conn:
        return conn.execute(
            select(
                Call.seq,
                Call.merge_reason,
                Call.divergence,
                Call.parent_seq,
                Call.prefix_len,
                Call.tree_parent_seq,
                Call.tree_parent_choice,
                func.length(Call.prompt_token_ids).label("prompt_bytes"),
            )
            .where(Call.trajectory_id == trajectory_id)
            .order_by(Call.seq, Call.choice_index)
        ).all()


def _every_read(engine: Engine, trajectory_id: str) -> dict[str, list[list[int] | None]]:
    view = trajectory_view(engine, trajectory_id, include_tokens=True)
    assert view is not None
    [exported] = [t for t in iter_trajectories(engine, "run-a") if t["trajectory_id"] == trajectory_id]
    [group] = load_groups(engine, ["group-1"])
    [loaded] = [t for t in group["trajectories"] if t["trajectory_id"] == trajectory_id]
    return {
        "read_api": [c["prompt_token_ids"] for c in view["calls"]],
        "export": [c["prompt_token_ids"] for c in exported["calls"]],
        "trainer": [c["prompt_token_ids"] for c in loaded["calls"]],
    }


@pytest.mark.parametrize("batching", BATCHINGS)
def test_linear_storage_round_trips_exactly(engine: Engine, batching: str) -> None:
    calls = conversation()
    write_batched(engine, calls, batching)

    rows = _stored(engine, "traj-1")
    # The tool result's prompt does not extend the tool call (SmolLM2's template drops the call from the history), but
    # it does extend turn 1: a second child of turn 1 in the call tree. Storage still takes the longer shared prefix.
    assert [r.merge_reason for r in rows] == ["first_call", "extends", "extends", "extends"]
    assert [r.divergence for r in rows] == [None, None, None, None]
    assert [(r.tree_parent_seq, r.tree_parent_choice) for r in rows] == [(None, None), (1, 0), (1, 0), (3, 0)]
    assert [r.parent_seq for r in rows] == [None, 1, 2, 3]
    # Each call stores only what it adds: turn 2 extends turn 1's 105 ids, the tool result shares turn 2's prompt.
    assert [r.prefix_len for r in rows] == [0, 105, 122, 175]
    assert [r.prompt_bytes // 4 for r in rows] == [90, 122 - 105, 160 - 122, 192 - 175]

    set_reward(engine, "traj-1")
    full = [c.prompt_token_ids for c in calls]
    assert _every_read(engine, "traj-1") == {"read_api": full, "export": full, "trainer": full}
    view = trajectory_view(engine, "traj-1")
    assert view is not None
    assert [c["prompt_tokens"] for c in view["calls"]] == [len(p or []) for p in full]
    assert [c["merge_reason"] for c in view["calls"]] == [r.merge_reason for r in rows]


def test_the_writer_keeps_nothing_of_a_generated_trajectory_and_a_client_that_reuses_its_id_still_extends_it(
    engine: Engine,
) -> None:
    """A call that carried no trajectory id got one made up: no later call is expected, so the lineage cache keeps
    nothing of it (an attributed first call is kept). A client that reuses the id from the response header still gets
    the lineage it would have had, its predecessor read back from the stored row."""
    generated = [replace(call, trajectory_id="tg-1", group_id="tg-1") for call in conversation()]
    generated[0] = replace(generated[0], generated_trajectory=True)
    cache = LineageCache()
    write_calls(engine, generated[:1], cache)
    assert "tg-1" not in cache
    for call in generated[1:]:
        write_calls(engine, [call], cache)
    attributed = conversation()
    write_calls(engine, attributed[:1], cache)
    assert "traj-1" in cache and cache.get("traj-1", attributed[0].seq, attributed[0].id) is not None
    for call in attributed[1:]:
        write_calls(engine, [call], cache)
    assert _stored(engine, "tg-1") == _stored(engine, "traj-1")
    assert [r.merge_reason for r in _stored(engine, "tg-1")] == ["first_call", "extends", "extends", "extends"]
    with engine.connect() as conn:
        shared = {
            t: list(conn.execute(select(Call.messages_prefix_len).where(Call.trajectory_id == t).order_by(Call.seq)))
            for t in ("tg-1", "traj-1")
        }
    assert shared["tg-1"] == shared["traj-1"] and [n for (n,) in shared["tg-1"]][1:] != [0, 0, 0]


def test_the_run_view_counts_reasons_over_the_runs_calls(engine: Engine) -> None:
    write_calls(engine, conversation("traj-1") + conversation("traj-2")[:2])
    view = run_view(engine, "run-a")
    assert view is not None
    assert view["merge"] == {
        "calls": 6,
        "by_reason": {"extends": 4, "first_call": 2},
        "merge_ratio": 4 / 4,
    }


def test_choices_of_an_n2_call_share_the_predecessor_of_choice_0(engine: Engine) -> None:
    turn1, turn2 = conversation()[:2]
    second_choice = make_record(
        "traj-1", seq=turn2.seq, choice_index=1, prompt_token_ids=turn2.prompt_token_ids, completion_token_ids=[7, 8]
    )
    write_calls(engine, [turn1, turn2, second_choice])
    rows = _stored(engine, "traj-1")
    assert [(r.merge_reason, r.parent_seq) for r in rows] == [("first_call", None), ("extends", 1), ("extends", 1)]
    set_reward(engine, "traj-1")
    full = [turn1.prompt_token_ids, turn2.prompt_token_ids, turn2.prompt_token_ids]
    assert _every_read(engine, "traj-1") == {"read_api": full, "export": full, "trainer": full}


def test_a_retry_that_replaces_a_parent_gives_its_children_their_full_prompt(engine: Engine) -> None:
    turn1, turn2 = conversation()[:2]
    write_calls(engine, [turn1])
    write_calls(engine, [turn2])
    # A late, newer attempt of turn 1 with another completion: turn 2 was derived from the old one.
    retried = make_record(
        "traj-1",
        seq=turn1.seq,
        prompt_token_ids=turn1.prompt_token_ids,
        completion_token_ids=[1, 2, 3],
        created_at=turn2.created_at + 1,
    )
    write_calls(engine, [retried])
    rows = _stored(engine, "traj-1")
    assert (rows[1].parent_seq, rows[1].prefix_len, rows[1].prompt_bytes // 4) == (None, 0, 122)
    set_reward(engine, "traj-1")
    full = [turn1.prompt_token_ids, turn2.prompt_token_ids]
    assert _every_read(engine, "traj-1") == {"read_api": full, "export": full, "trainer": full}


def test_a_stale_attempt_is_not_taken_as_a_predecessor(engine: Engine) -> None:
    turn1, turn2 = conversation()[:2]
    write_calls(engine, [turn1])
    stale = make_record("traj-1", seq=turn1.seq, completion_token_ids=[1, 2], created_at=turn1.created_at - 5)
    write_calls(engine, [stale, turn2])
    assert [r.merge_reason for r in _stored(engine, "traj-1")] == ["first_call", "extends"]
    set_reward(engine, "traj-1")
    assert _every_read(engine, "traj-1")["trainer"] == [turn1.prompt_token_ids, turn2.prompt_token_ids]


# --- migrating data written before 0004 ----------------------------------------------------------------------------


def test_migration_keeps_old_calls_readable_and_new_calls_compact_against_them(db_url: str) -> None:
    db.upgrade(db_url, "0003")
    engine = db.make_engine(db_url)
    try:
        turn1, turn2 = conversation()[:2]
        insert_old_calls(engine, [store_records._call_row(turn1, classify(turn1.prompt_token_ids, None))])
        db.upgrade(db_url)
        write_calls(engine, [turn2])
        rows = _stored(engine, "traj-1")
        assert [(r.merge_reason, r.parent_seq, r.prefix_len) for r in rows] == [(None, None, 0), ("extends", 1, 105)]
        set_reward(engine, "traj-1")
        full = [turn1.prompt_token_ids, turn2.prompt_token_ids]
        assert _every_read(engine, "traj-1") == {"read_api": full, "export": full, "trainer": full}

        db.downgrade(db_url, "0003")
        with engine.connect() as conn:
            stored = conn.execute(text("SELECT prompt_token_ids FROM calls ORDER BY seq")).scalars().all()
        assert [len(blob) // 4 for blob in stored] == [90, 122]
    finally:
        engine.dispose()


def test_the_predecessor_cache_is_bounded_by_the_bytes_it_holds() -> None:
    cache = LineageCache(max_bytes=2 * 4 * 100)
    for n, trajectory_id in enumerate(("a", "b", "c")):
        cache.remember(trajectory_id, Predecessor(n, list(range(60)), list(range(40)), False), f"call-{n}")
    assert cache.get("a", 0, "call-0") is None  # evicted: the oldest
    assert cache.get("c", 2, "call-2") == Predecessor(2, list(range(60)), list(range(40)), False)
    assert cache.get("c", 2, "another-call") is None and cache.get("c", 1, "call-2") is None


# --- token_in calls name their predecessor ---------------------------------------------------------------------------


def _token_in_turn(seq: int, prompt: list[int], completion: list[int], after: tuple[int, int] | None) -> CallRecord:
    """A token_in call: its prompt is `after`'s prompt + completion + a bridge, and the record says so."""
    return make_record(
        "traj-1",
        seq,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=[-0.5] * len(completion),
        predecessor_seq=after[0] if after else None,
        predecessor_choice=after[1] if after else None,
    )


@pytest.mark.parametrize("batching", BATCHINGS)
def test_a_repeated_token_in_turn_and_a_later_branch_extend_their_named_predecessors(
    engine: Engine, batching: str
) -> None:
    turn1 = _token_in_turn(1, [1, 2, 3], [4, 5], None)
    turn2 = _token_in_turn(2, [1, 2, 3, 4, 5, 9], [6, 7], (1, 0))
    # The agent sends turn 2 again as a new call (no retry header): built on turn 1, like the first attempt.
    again = _token_in_turn(3, [1, 2, 3, 4, 5, 9], [8], (1, 0))
    # Then it goes on from the first attempt's answer, not from the repeat's (the previous seq).
    turn3 = _token_in_turn(4, [1, 2, 3, 4, 5, 9, 6, 7, 9], [10], (2, 0))
    calls = [turn1, turn2, again, turn3]
    write_batched(engine, calls, batching)

    rows = _stored(engine, "traj-1")
    assert [r.merge_reason for r in rows] == ["first_call", "extends", "extends", "extends"]
    assert [(r.parent_seq, r.prefix_len, r.prompt_bytes // 4) for r in rows] == [
        (None, 0, 3),
        (1, 5, 1),
        (1, 5, 1),
        (2, 8, 1),
    ]
    assert all(r.divergence is None for r in rows)
    set_reward(engine, "traj-1")
    full = [c.prompt_token_ids for c in calls]
    assert _every_read(engine, "traj-1") == {"read_api": full, "export": full, "trainer": full}


def test_a_token_in_turn_that_continues_choice_1_extends_it_and_is_stored_against_choice_0(engine: Engine) -> None:
    turn1 = _token_in_turn(1, [1, 2, 3], [4, 5], None)
    other = make_record("traj-1", 1, choice_index=1, prompt_token_ids=[1, 2, 3], completion_token_ids=[6, 7])
    turn2 = _token_in_turn(2, [1, 2, 3, 6, 7, 9], [8], (1, 1))
    write_calls(engine, [turn1, other])
    write_calls(engine, [turn2])
    rows = _stored(engine, "traj-1")
    assert [r.merge_reason for r in rows] == ["first_call", "first_call", "extends"]
    assert (rows[2].parent_seq, rows[2].prefix_len, rows[2].prompt_bytes // 4) == (1, 3, 3)
    set_reward(engine, "traj-1")
    full = [turn1.prompt_token_ids, other.prompt_token_ids, turn2.prompt_token_ids]
    assert _every_read(engine, "traj-1") == {"read_api": full, "export": full, "trainer": full}


def test_a_named_predecessor_that_is_not_stored_falls_back_to_the_previous_seq(engine: Engine) -> None:
    turn1 = _token_in_turn(1, [1, 2, 3], [4, 5], None)
    turn2 = _token_in_turn(2, [1, 2, 3, 4, 5, 9], [6], (1, 3))  # its record never arrived
    write_calls(engine, [turn1, turn2])
    assert [(r.merge_reason, r.parent_seq) for r in _stored(engine, "traj-1")] == [("first_call", None), ("extends", 1)]
    retry = _token_in_turn(3, [1, 2, 3, 4, 5, 9], [7], (0, 0))
    write_calls(engine, [retry])
    # Its named predecessor is no call of the trajectory, but its prompt still extends turn 1: a sibling of turn 2.
    stored = _stored(engine, "traj-1")[2]
    assert (stored.merge_reason, stored.tree_parent_seq, stored.tree_parent_choice) == ("extends", 1, 0)


def _stored_trajectory(rng: random.Random) -> dict[tuple[int, int], StoredCall]:
    """Generated linear storage: each call's ids and messages past a prefix of an earlier choice 0's (or whole, as
    rows before revision 0004/0006), sometimes cut inside it, several choices a seq, and now and then a broken link:
    a parent that is missing, later, too short, or has no completion."""
    calls: dict[tuple[int, int], StoredCall] = {}
    tokens: dict[int, list[int]] = {}  # choice 0's full prompt + completion per seq
    messages: dict[int, list[Any]] = {}
    for seq in sorted(rng.sample(range(1, 30), rng.randint(1, 12))):
        for choice in range(rng.choice([1, 1, 1, 2, 3])):
            earlier = [s for s in tokens if s < seq]
            parent_seq, prefix_len, prompt = None, 0, [rng.randrange(100) for _ in range(rng.randint(0, 6))]
            if earlier and rng.random() < 0.8:
                parent_seq = rng.choice(earlier)
                prefix_len = rng.randint(1, len(tokens[parent_seq])) if tokens[parent_seq] else 0
            if rng.random() < 0.03:  # broken: missing, not earlier, or longer than the parent holds
                parent_seq, prefix_len = rng.choice([(99, 1), (seq, 1), (parent_seq, 10_000)])
            full_prompt = (tokens[parent_seq][:prefix_len] if parent_seq in tokens and prefix_len else []) + prompt
            completion = None if rng.random() < 0.05 else [rng.randrange(100) for _ in range(rng.randint(0, 4))]
            own = [{"role": "user", "content": f"{seq}.{choice}.{i}"} for i in range(rng.randint(0, 3))]
            messages_parent, messages_prefix = None, 0
            if [s for s in messages if s < seq] and rng.random() < 0.8:
                messages_parent = rng.choice([s for s in messages if s < seq])
                messages_prefix = rng.randint(0, len(messages[messages_parent]))
            if rng.random() < 0.03:
                messages_parent, messages_prefix = rng.choice([(99, 1), (seq, 1), (messages_parent, 10_000)])
            request: dict[str, Any] | None = {"model": "m", "messages": own, "n": choice + 1}
            if rng.random() < 0.03:
                request = rng.choice([None, {"model": "m"}])
            calls[(seq, choice)] = StoredCall(
                encode_ids(prompt), None if completion is None else encode_ids(completion), parent_seq, prefix_len,
                request, messages_parent, messages_prefix,
            )
            if choice == 0:
                tokens[seq] = full_prompt + (completion or [])
                parent_messages = messages.get(messages_parent or -1, [])
                messages[seq] = parent_messages[:messages_prefix] + own
    return calls


def _rebuilt_in_order(calls: dict[tuple[int, int], StoredCall]) -> dict[tuple[int, int], Any]:
    """What Rebuilder gives each call fed in (seq, choice) order from the first broken one on: the LookupError type."""
    rebuilder, out, broken = Rebuilder(), {}, False
    for key in sorted(calls):
        call = calls[key]
        if broken:
            out[key] = None  # Rebuilder stops at the first broken call; not compared
            continue
        try:
            prompt = rebuilder.prompt(
                *key, decode_ids(call.prompt), decode_ids(call.completion), call.parent_seq, call.prefix_len
            )
            request = rebuilder.request(*key, call.request, call.messages_parent_seq, call.messages_prefix_len)
            out[key] = (prompt, request)
        except LookupError:
            out[key], broken = LookupError, True
    return out


def test_one_stored_call_rebuilds_as_the_whole_trajectory_in_order_does() -> None:
    """StoredCalls rebuilds a call along its storage chain only; over generated trajectories (cut prefixes, several
    choices, rows stored whole, broken links) each call comes back as Rebuilder gives it, a broken chain raises
    LookupError, and asking in any order (memoized, a list extended in place) changes nothing."""
    rng = random.Random(11)
    compared = broken = 0
    for _ in range(400):
        calls = _stored_trajectory(rng)
        expected = _rebuilt_in_order(calls)
        stored = StoredCalls(calls)
        for key in rng.sample(sorted(calls), len(calls)) * 2:
            want = expected[key]
            if want is None:
                continue
            try:
                got: Any = (stored.prompt(key), stored.request(key))
            except LookupError:
                got = LookupError
            if want is LookupError:
                # Rebuilder fails on the first broken call of the trajectory; StoredCalls only on a call whose own
                # chain is broken, so where Rebuilder first fails, so does it.
                assert got is LookupError, key
                broken += 1
            else:
                assert got == want, key
                assert stored.completion(key) == decode_ids(calls[key].completion)
                compared += 1
        if LookupError not in expected.values():  # rebuilding them all in order gives the same
            assert stored.every_call() == expected
    assert compared > 2000 and broken > 20
    assert StoredCalls({}).prompt((1, 0)) is None and StoredCalls({}).request((1, 0)) is None
    assert StoredCalls({}).completion((1, 0)) is None
