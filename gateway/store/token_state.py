"""The token state a token_in call continues from: recorded turns of a trajectory found by their history key.

Read on the response path (gateway/proxy/token_in.py), which is the one exception to "the response path never awaits the
database": the prompt of a token_in call *is* its predecessor's exact ids, so without them there is nothing to
send to vLLM. It is asked only when this gateway's own memory of the trajectory misses (another gateway answered
the previous turn, or this one restarted), and it is bounded: one indexed lookup on (trajectory_id, history_key)
for at most a few dozen keys, then the matched rows' full prompts rebuilt from the trajectory's linear storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sqlalchemy import Engine, select

from gateway.store.arrays import decode_ids
from gateway.store.models import Call
from gateway.store.records import rebuild_calls


class RecordedTurn(NamedTuple):
    """One recorded choice of a token_in call: what the next turn's prompt starts with."""

    seq: int
    choice_index: int
    prompt_ids: list[int]
    completion_ids: list[int]


def recorded_turns(engine: Engine, trajectory_id: str, keys: Sequence[str]) -> tuple[dict[str, RecordedTurn], bool]:
    """The stored turns of the trajectory whose history key is one of `keys` (the newest attempt per key), and
    whether the trajectory has any token_in turn at all (if none, the caller has nothing to wait for)."""
    with engine.connect() as conn:
        has_any = (
            conn.execute(
                select(Call.seq)
                .where(Call.trajectory_id == trajectory_id, Call.history_key.is_not(None))
                .limit(1)
            ).first()
            is not None
        )
        if not keys or not has_any:
            return {}, has_any
        rows = conn.execute(
            select(Call.seq, Call.choice_index, Call.history_key, Call.completion_token_ids)
            .where(
                Call.trajectory_id == trajectory_id,
                Call.history_key.in_(list(keys)),
                Call.completion_token_ids.is_not(None),
            )
            .order_by(Call.seq, Call.choice_index)
        ).all()
        if not rows:
            return {}, True
        stored = rebuild_calls(conn, trajectory_id, requests=False)
    found: dict[str, RecordedTurn] = {}
    for row in rows:
        prompt = stored.prompt((row.seq, row.choice_index))
        completion = decode_ids(row.completion_token_ids)
        if prompt and completion:
            found[row.history_key] = RecordedTurn(row.seq, row.choice_index, prompt, completion)
    return found, True
