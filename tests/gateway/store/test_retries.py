"""Client retries are matched to the attempt they repeat by content, in the store, whichever gateway saw which attempt
and whatever order the records reach the database in (issue 11, item 4).

A call flagged as a retry (`x-stainless-retry-count` > 0) replaces the earlier attempt of the same request in the same
trajectory; a repeated `Idempotency-Key` is the same call; anything else is a new turn, even with an identical body.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import Engine, select, update

from gateway.store import db
from gateway.store.call_record import CallRecord
from gateway.store.models import Call
from gateway.store.records import write_calls
from tests.support.factories import make_record
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import running_gateway
from tests.support.openai_calls import client_body
from tests.support.stored import stored_calls


def _ask(text: str) -> dict[str, Any]:
    return {"model": "run-a", "messages": [{"role": "user", "content": text}]}


def _attempt(seq: int, text: str, retry_count: int = 0, key: str | None = None, **overrides: Any) -> CallRecord:
    """One attempt of a call as the gateway records it: seq and created_at both come from the clock at receipt."""
    fields: dict[str, Any] = {"created_at": 1000.0 + seq, "seed": seq}
    fields.update(overrides)
    return make_record(seq=seq, request=_ask(text), retry_count=retry_count, idempotency_key=key, **fields)


def _rows(engine: Engine, trajectory_id: str = "traj-1") -> list[tuple[int, int, str]]:
    """(seq, choice_index, id) of every stored row, in order: the whole final state of the matching."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(Call.seq, Call.choice_index, Call.id)
            .where(Call.trajectory_id == trajectory_id)
            .order_by(Call.seq, Call.choice_index)
        )
        return [tuple(row) for row in rows]  # type: ignore[misc]


def test_a_retry_whose_first_attempt_was_never_seen_is_a_new_turn(engine: Engine) -> None:
    turn1 = _attempt(1, "first question")
    retry_of_unseen = _attempt(2, "second question", retry_count=1)
    write_calls(engine, [turn1])
    write_calls(engine, [retry_of_unseen])
    assert _rows(engine) == [(1, 0, turn1.id), (2, 0, retry_of_unseen.id)]


def test_a_retry_after_a_later_turn_replaces_its_own_attempt(engine: Engine) -> None:
    first = _attempt(1, "question a")
    later = _attempt(2, "question b")
    retry = _attempt(3, "question a", retry_count=1)
    for record in (first, later, retry):
        write_calls(engine, [record])
    # The row of a call sits at the seq of the attempt it holds: the one the client saw answered.
    assert _rows(engine) == [(2, 0, later.id), (3, 0, retry.id)]


def test_identical_bodies_without_a_retry_flag_are_separate_turns(engine: Engine) -> None:
    records = [_attempt(seq, "same question") for seq in (1, 2, 3)]
    write_calls(engine, records[:1])
    write_calls(engine, records[1:])
    assert [row[2] for row in _rows(engine)] == [r.id for r in records]


def test_parallel_identical_calls_each_retried_stay_two_turns(engine: Engine) -> None:
    p1, p2 = _attempt(1, "sample"), _attempt(2, "sample")
    r1 = _attempt(3, "sample", retry_count=1)  # the earliest attempt not yet superseded: p1
    r2 = _attempt(4, "sample", retry_count=1)  # p1 is superseded (its row holds attempt 1 now): p2
    for record in (p1, p2, r1, r2):
        write_calls(engine, [record])
    assert _rows(engine) == [(3, 0, r1.id), (4, 0, r2.id)]


def test_a_chain_of_retries_is_one_turn(engine: Engine) -> None:
    attempts = [_attempt(1 + n, "flaky", retry_count=n) for n in range(4)]
    for record in attempts:
        write_calls(engine, [record])
    assert _rows(engine) == [(4, 0, attempts[-1].id)]


def test_a_repeated_idempotency_key_is_one_call(engine: Engine) -> None:
    first = _attempt(1, "keyed", key="k-1")
    again = _attempt(2, "keyed", key="k-1")
    other_key = _attempt(3, "keyed", key="k-2")
    for record in (first, again, other_key):
        write_calls(engine, [record])
    assert _rows(engine) == [(2, 0, again.id), (3, 0, other_key.id)]


def test_the_answered_retry_wins_when_both_attempts_were_answered(engine: Engine) -> None:
    first = _attempt(1, "q", finish_reason="length")
    retry = _attempt(2, "q", retry_count=1, finish_reason="stop")
    write_calls(engine, [retry])
    write_calls(engine, [first])  # the first attempt's record spilled to the spool and arrives last
    with engine.connect() as conn:
        assert conn.execute(select(Call.id, Call.finish_reason, Call.retry_count)).all() == [(retry.id, "stop", 1)]


# Records of one trajectory that must settle into the same rows whatever order (and batching) they arrive in.
SCENARIOS = {
    "retry-of-one-call": lambda: [_attempt(1, "a"), _attempt(2, "a", retry_count=1)],
    "retry-after-a-later-turn": lambda: [_attempt(1, "a"), _attempt(2, "b"), _attempt(3, "a", retry_count=1)],
    "chain": lambda: [_attempt(1, "a"), _attempt(2, "a", retry_count=1), _attempt(3, "a", retry_count=2)],
    "lost-first-attempt": lambda: [_attempt(1, "b"), _attempt(2, "a", retry_count=1), _attempt(3, "a", retry_count=2)],
    "parallel-identical": lambda: [
        _attempt(1, "a"),
        _attempt(2, "a"),
        _attempt(3, "a", retry_count=1),
        _attempt(4, "a", retry_count=1),
    ],
    "keyed": lambda: [_attempt(1, "a", key="k"), _attempt(2, "a", key="k"), _attempt(3, "a")],
    "n2-then-error-retry": lambda: [
        _attempt(1, "a"),
        _attempt(1, "a", choice_index=1),
        _attempt(2, "a", retry_count=1, status_code=500, error="boom"),
    ],
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_records_in_any_order_settle_into_the_same_rows(db_url: str, engine: Engine, scenario: str) -> None:
    records = SCENARIOS[scenario]()
    write_calls(engine, records)
    expected = _rows(engine)
    for number, order in enumerate(itertools.permutations(records)):
        trajectory = f"order-{number}"
        renamed = [_renamed(record, trajectory) for record in order]
        for record in renamed:
            write_calls(engine, [record])
        assert _rows(engine, trajectory) == [(seq, choice, f"{trajectory}/{id_}") for seq, choice, id_ in expected]


def test_a_retry_that_supersedes_a_parent_keeps_its_children_readable(engine: Engine, db_url: str) -> None:
    first = _attempt(1, "a", prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5])
    child = _attempt(2, "b", prompt_token_ids=[1, 2, 3, 4, 5, 6], completion_token_ids=[7])
    retry = _attempt(3, "a", retry_count=1, prompt_token_ids=[1, 2, 3], completion_token_ids=[9])
    write_calls(engine, [first])
    write_calls(engine, [child])  # stored compactly: only [6] past the 5 ids it shares with the first attempt
    write_calls(engine, [retry])
    calls = stored_calls(db_url, "traj-1")
    assert [(c["id"], c["prompt_token_ids"]) for c in calls] == [(child.id, [1, 2, 3, 4, 5, 6]), (retry.id, [1, 2, 3])]


def test_two_writers_racing_on_one_trajectory_leave_one_row_per_call(db_url: str, engine: Engine) -> None:
    """Two gateway processes' writers, one holding each call's first attempt and the other its retry, committing at
    the same time: the store's per-trajectory lock makes each see the other's rows, so no call is left twice."""
    firsts = [_attempt(10 * n, f"q{n}") for n in range(20)]
    retries = [_attempt(10 * n + 5, f"q{n}", retry_count=1) for n in range(20)]
    other = db.make_engine(db_url)
    together = threading.Barrier(2, timeout=30)

    def write_each(writer: Engine, records: list[CallRecord]) -> None:
        for record in records:
            together.wait()  # both attempts of a call go in at the same moment
            write_calls(writer, [record])

    try:
        threads = [threading.Thread(target=write_each, args=pair) for pair in ((engine, firsts), (other, retries))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        other.dispose()
    assert _rows(engine) == [(r.seq, 0, r.id) for r in retries]


def _renamed(record: CallRecord, trajectory_id: str) -> CallRecord:
    fields = {name: getattr(record, name) for name in record.__slots__}  # type: ignore[attr-defined]
    return CallRecord(**{**fields, "trajectory_id": trajectory_id, "id": f"{trajectory_id}/{record.id}"})


# --- through the gateway: several gateway processes on one database -------------------------------------------------


class _RoundRobin(httpx.HTTPTransport):
    """Sends each request to the next gateway in turn, as a load balancer in front of several would."""

    def __init__(self, ports: list[int]) -> None:
        super().__init__()
        self._ports = itertools.cycle(ports)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(port=next(self._ports))
        return super().handle_request(request)


@pytest.fixture
def two_gateways(gateway_settings: dict[str, object], tmp_path: Any) -> Any:
    with (
        running_gateway(**gateway_settings) as a,
        running_gateway(**{**gateway_settings, "spool_dir": tmp_path / "spool-b"}) as b,
    ):
        yield a, b


def test_sdk_retry_on_another_gateway_replaces_the_first_attempt(
    two_gateways: Any, upstream: FakeUpstream, db_url: str
) -> None:
    a, b = two_gateways
    before = len(upstream.received)
    upstream.mode = "fail_once"  # the first attempt (on gateway A) gets a 500, the SDK retries it on gateway B
    client = openai.OpenAI(
        base_url=a.base_url,
        api_key="k",
        max_retries=2,
        http_client=httpx.Client(transport=_RoundRobin([a.port, b.port])),
    )
    answer = client.chat.completions.create(
        **client_body(upstream.fixture("chat")), extra_headers={"X-Trajectory-Id": "t-lb"}
    )
    assert answer.choices[0].message.content and len(upstream.received) == before + 2
    a.flush()
    b.flush()
    (call,) = stored_calls(db_url, "t-lb")
    assert (call["status_code"], call["retry_count"], call["error"]) == (200, 1, None)


def test_retries_of_different_calls_on_two_gateways_stay_two_turns(
    two_gateways: Any, upstream: FakeUpstream, db_url: str
) -> None:
    a, b = two_gateways
    headers = {"X-Trajectory-Id": "t-two", "x-stainless-retry-count": "1"}
    first = client_body(upstream.fixture("chat"))
    second = client_body(upstream.fixture("conversation_turn1"))
    assert httpx.post(a.base_url + "/chat/completions", json=first, headers=headers).status_code == 200
    assert httpx.post(b.base_url + "/chat/completions", json=second, headers=headers).status_code == 200
    a.flush()
    b.flush()
    assert [c["request"]["messages"] for c in stored_calls(db_url, "t-two")] == [first["messages"], second["messages"]]


def test_a_retry_whose_first_attempt_never_arrived_does_not_replace_the_previous_turn(
    two_gateways: Any, upstream: FakeUpstream, db_url: str
) -> None:
    a, _ = two_gateways
    url = a.base_url + "/chat/completions"
    previous = client_body(upstream.fixture("chat"))
    lost = client_body(upstream.fixture("conversation_turn1"))
    httpx.post(url, json=previous, headers={"X-Trajectory-Id": "t-lost"})
    httpx.post(url, json=lost, headers={"X-Trajectory-Id": "t-lost", "x-stainless-retry-count": "1"})
    a.flush()
    stored = [c["request"]["messages"] for c in stored_calls(db_url, "t-lost")]
    assert stored == [previous["messages"], lost["messages"]]


def test_an_idempotency_key_repeated_across_gateways_is_one_call(
    two_gateways: Any, upstream: FakeUpstream, db_url: str
) -> None:
    a, b = two_gateways
    body = client_body(upstream.fixture("chat"))
    headers = {"X-Trajectory-Id": "t-key", "Idempotency-Key": "call-7"}
    for gateway in (a, b, a):
        assert httpx.post(gateway.base_url + "/chat/completions", json=body, headers=headers).status_code == 200
    # The same body without a key or a retry flag is the agent asking again: a turn of its own.
    unkeyed = httpx.post(b.base_url + "/chat/completions", json=body, headers={"X-Trajectory-Id": "t-key"})
    assert unkeyed.status_code == 200
    a.flush()
    b.flush()
    assert [c["idempotency_key"] for c in stored_calls(db_url, "t-key")] == ["call-7", None]


def test_calls_written_before_0007_are_never_matched(engine: Engine) -> None:
    legacy = _attempt(1, "a")
    write_calls(engine, [legacy])
    with engine.begin() as conn:  # what a row written before revision 0007 holds
        conn.execute(update(Call).values(request_hash=None, first_seq=None, first_retry_count=None))
    retry = _attempt(2, "a", retry_count=1)
    old_style_retry = _attempt(1, "a", retry_count=1)  # an older gateway's retry reused its attempt's seq
    write_calls(engine, [retry])
    write_calls(engine, [old_style_retry])
    assert _rows(engine) == [(1, 0, old_style_retry.id), (2, 0, retry.id)]
