"""Streaming a run's trajectories out with their calls, token ids, logprobs and rewards, in constant memory.

Trajectories are read a page at a time in creation order (keyset pagination, so no page is re-scanned and no
transaction stays open between pages); each page's calls come from one query whose rows are streamed (a
server-side cursor on Postgres), and a trajectory is yielded as soon as its last call is read. Memory holds one
page of trajectory rows and the calls of one trajectory, whatever the size of the run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from sqlalchemy import Connection, Engine, select, tuple_

from gateway.store.arrays import decode_ids, decode_logprobs
from gateway.store.lineage import Rebuilder
from gateway.store.models import Call, Trajectory
from gateway.store.reads import completion_of, request_input, turn_numbers
from gateway.store.tree import parent_of, with_branches

PAGE_TRAJECTORIES = 64
_CALL_ROWS_PER_FETCH = 32


def iter_trajectories(
    engine: Engine, run: str, include_eval: bool = False, page_size: int = PAGE_TRAJECTORIES
) -> Iterator[dict[str, Any]]:
    """Yield one dict per trajectory of `run` (training trajectories only unless `include_eval`), oldest first,
    in the export schema documented in docs/api.md ("Exporting")."""
    page_query = (
        select(
            Trajectory.trajectory_id,
            Trajectory.run,
            Trajectory.group_id,
            Trajectory.mode,
            Trajectory.reward,
            Trajectory.metrics,
            Trajectory.meta.label("meta"),
            Trajectory.created_at,
        )
        .where(Trajectory.run == run)
        .order_by(Trajectory.created_at, Trajectory.trajectory_id)
        .limit(page_size)
    )
    if not include_eval:
        page_query = page_query.where(Trajectory.mode == "train")
    after: tuple[Any, str] | None = None
    while True:
        query = page_query
        if after is not None:
            query = query.where(tuple_(Trajectory.created_at, Trajectory.trajectory_id) > tuple_(*after))
        with engine.connect() as conn:
            page = conn.execute(query).all()
            if not page:
                return
            yield from _with_calls(conn, page)
        last = page[-1]
        after = (last.created_at, last.trajectory_id)


def _with_calls(conn: Connection, page: Sequence[Any]) -> Iterator[dict[str, Any]]:
    calls_query = (
        select(
            Call.trajectory_id,
            Call.seq,
            Call.choice_index,
            Call.policy_version,
            Call.endpoint,
            Call.request,
            Call.response,
            Call.prompt_token_ids,
            Call.completion_token_ids,
            Call.completion_logprobs,
            Call.finish_reason,
            Call.trainable,
            Call.merge_reason,
            Call.segment_reason,
            Call.divergence,
            Call.parent_seq,
            Call.prefix_len,
            Call.messages_parent_seq,
            Call.messages_prefix_len,
            Call.tree_parent_seq,
            Call.tree_parent_choice,
        )
        .join(Trajectory, Trajectory.trajectory_id == Call.trajectory_id)
        .where(Call.trajectory_id.in_([row.trajectory_id for row in page]))
        # The page's order, so each trajectory's calls arrive together and in turn order.
        .order_by(Trajectory.created_at, Trajectory.trajectory_id, Call.seq, Call.choice_index)
    )
    rows = conn.execution_options(yield_per=_CALL_ROWS_PER_FETCH).execute(calls_query)
    pending = iter(page)
    current = _trajectory(next(pending))
    turns, rebuilder = turn_numbers(), Rebuilder()
    for row in rows:
        while row.trajectory_id != current["trajectory_id"]:
            with_branches(current["calls"])
            yield current
            current, turns, rebuilder = _trajectory(next(pending)), turn_numbers(), Rebuilder()
        current["calls"].append(_call(row, turns(row.seq), rebuilder))
    with_branches(current["calls"])
    yield current
    for rest in pending:  # trajectories whose calls were all deleted
        yield _trajectory(rest)


def _trajectory(row: Any) -> dict[str, Any]:
    return {
        "trajectory_id": row.trajectory_id,
        "run": row.run,
        "group_id": row.group_id,
        "mode": row.mode,
        "reward": row.reward,
        "metrics": row.metrics,
        "metadata": row.meta,
        "calls": [],
    }


def _call(row: Any, turn: int, rebuilder: Rebuilder) -> dict[str, Any]:
    completion, tool_calls = completion_of(row.response, row.choice_index, row.endpoint)
    completion_ids = decode_ids(row.completion_token_ids)
    return {
        "turn": turn,
        "seq": row.seq,
        "choice_index": row.choice_index,
        "policy_version": row.policy_version,
        "endpoint": row.endpoint,
        "messages": request_input(
            rebuilder.request(row.seq, row.choice_index, row.request, row.messages_parent_seq, row.messages_prefix_len),
            row.endpoint,
        ),
        "completion": completion,
        "tool_calls": tool_calls,
        "prompt_token_ids": rebuilder.prompt(
            row.seq, row.choice_index, decode_ids(row.prompt_token_ids), completion_ids, row.parent_seq, row.prefix_len
        ),
        "completion_token_ids": completion_ids,
        "completion_logprobs": decode_logprobs(row.completion_logprobs),
        "finish_reason": row.finish_reason,
        "trainable": row.trainable,
        "merge_reason": row.merge_reason,
        "segment_reason": row.segment_reason,
        "divergence": row.divergence,
        "parent": parent_of(row.tree_parent_seq, row.tree_parent_choice),
    }
