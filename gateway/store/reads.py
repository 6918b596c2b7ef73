"""Reading back what was recorded: a trajectory with its calls, and a group with its trajectories.

Views are plain JSON-ready dicts. Token arrays are left in the database unless asked for (a trajectory's arrays
can be megabytes); their lengths are counted there instead.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, func, select

from gateway.store.arrays import decode_ids, decode_logprobs
from gateway.store.lineage import Rebuilder
from gateway.store.models import COMPLETIONS, Call, Group, Trajectory
from gateway.store.tree import parent_of, with_branches


def iso(value: datetime | None) -> str | None:
    """ISO 8601 in UTC; SQLite hands timestamps back without their zone, and they were written in UTC."""
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.isoformat()


def request_input(request: dict[str, Any] | None, endpoint: str) -> Any:
    """What the model was given: the chat messages, or the completions prompt. APIs translated to chat at the edge
    (messages) store the chat request the model saw, so they read as chat."""
    if not request:
        return None
    return request.get("prompt") if endpoint == COMPLETIONS else request.get("messages")


def completion_of(
    response: dict[str, Any] | None, choice_index: int, endpoint: str
) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(text, tool_calls) the model answered in this choice, from the stored (or stream-assembled) response."""
    choices = (response or {}).get("choices") or []
    choice = next((c for c in choices if c.get("index") == choice_index), None)
    if choice is None:
        return None, None
    if endpoint == COMPLETIONS:
        return choice.get("text"), None
    message = choice.get("message") or {}
    return message.get("content"), message.get("tool_calls") or None


def turn_numbers() -> Callable[[int], int]:
    """Maps a trajectory's seqs, fed in order, to 0, 1, 2...: seq is a nanosecond-clock order key (too large for
    JavaScript numbers), the turn is what a reader wants. Choices of one call (n > 1) share their turn."""
    seen: dict[int, int] = {}

    def turn(seq: int) -> int:
        return seen.setdefault(seq, len(seen))

    return turn


def trajectory_view(engine: Engine, trajectory_id: str, include_tokens: bool = False) -> dict[str, Any] | None:
    """The trajectory, its reward and its calls in order; None if no call of it has been written."""
    columns = [
        Call.id,
        Call.seq,
        Call.choice_index,
        Call.policy_version,
        Call.endpoint,
        Call.stream,
        Call.request,
        Call.response,
        func.length(Call.prompt_token_ids).label("prompt_bytes"),
        func.length(Call.completion_token_ids).label("completion_bytes"),
        Call.finish_reason,
        Call.trainable,
        Call.untrainable_reason,
        Call.status_code,
        Call.error,
        Call.latency_ms,
        Call.ttft_ms,
        Call.retry_count,
        Call.created_at,
        Call.merge_reason,
        Call.segment_reason,
        Call.divergence,
        Call.parent_seq,
        Call.prefix_len,
        Call.messages_parent_seq,
        Call.messages_prefix_len,
        Call.tree_parent_seq,
        Call.tree_parent_choice,
    ]
    if include_tokens:
        columns += [Call.prompt_token_ids, Call.completion_token_ids, Call.completion_logprobs]
    with engine.connect() as conn:
        trajectory = conn.execute(
            select(*Trajectory.__table__.columns).where(Trajectory.trajectory_id == trajectory_id)
        ).first()
        if trajectory is None:
            return None
        rows = conn.execute(
            select(*columns).where(Call.trajectory_id == trajectory_id).order_by(Call.seq, Call.choice_index)
        ).all()
    calls = []
    turns = turn_numbers()
    rebuilder = Rebuilder()
    for row in rows:
        completion, tool_calls = completion_of(row.response, row.choice_index, row.endpoint)
        call = {
            "id": row.id,
            "turn": turns(row.seq),
            "seq": row.seq,
            "choice_index": row.choice_index,
            "policy_version": row.policy_version,
            "endpoint": row.endpoint,
            "stream": row.stream,
            "messages": request_input(
                rebuilder.request(
                    row.seq, row.choice_index, row.request, row.messages_parent_seq, row.messages_prefix_len
                ),
                row.endpoint,
            ),
            "completion": completion,
            "tool_calls": tool_calls,
            # packed int32, past the prefix shared with the predecessor
            "prompt_tokens": (row.prefix_len or 0) + (row.prompt_bytes or 0) // 4,
            "completion_tokens": (row.completion_bytes or 0) // 4,
            "finish_reason": row.finish_reason,
            "trainable": row.trainable,
            "untrainable_reason": row.untrainable_reason,
            "status_code": row.status_code,
            "error": row.error,
            "latency_ms": row.latency_ms,
            "ttft_ms": row.ttft_ms,
            "retry_count": row.retry_count,
            "created_at": iso(row.created_at),
            "merge_reason": row.merge_reason,
            "segment_reason": row.segment_reason,
            "divergence": row.divergence,
            "parent": parent_of(row.tree_parent_seq, row.tree_parent_choice),
        }
        if include_tokens:
            completion_ids = decode_ids(row.completion_token_ids)
            call["prompt_token_ids"] = rebuilder.prompt(
                row.seq, row.choice_index, decode_ids(row.prompt_token_ids), completion_ids, row.parent_seq, row.prefix_len
            )
            call["completion_token_ids"] = completion_ids
            call["completion_logprobs"] = decode_logprobs(row.completion_logprobs)
        calls.append(call)
    return {
        "trajectory_id": trajectory.trajectory_id,
        "run": trajectory.run,
        "group_id": trajectory.group_id,
        "mode": trajectory.mode,
        "reward": trajectory.reward,
        "metrics": trajectory.metrics,
        "metadata": trajectory.metadata,
        "untrainable_calls": trajectory.untrainable_calls,
        "created_at": iso(trajectory.created_at),
        "rewarded_at": iso(trajectory.rewarded_at),
        "calls": with_branches(calls),
    }


def group_view(engine: Engine, group_id: str) -> dict[str, Any] | None:
    """The group's lifecycle and its trajectories with their rewards; None if unknown."""
    call_count = (
        select(func.count()).where(Call.trajectory_id == Trajectory.trajectory_id).scalar_subquery().label("calls")
    )
    with engine.connect() as conn:
        group = conn.execute(select(*Group.__table__.columns).where(Group.group_id == group_id)).first()
        if group is None:
            return None
        rows = conn.execute(
            select(
                Trajectory.trajectory_id,
                Trajectory.reward,
                Trajectory.metrics,
                Trajectory.untrainable_calls,
                Trajectory.created_at,
                Trajectory.rewarded_at,
                call_count,
            )
            .where(Trajectory.group_id == group_id)
            .order_by(Trajectory.created_at, Trajectory.trajectory_id)
        ).all()
    trajectories = [
        {
            "trajectory_id": row.trajectory_id,
            "reward": row.reward,
            "metrics": row.metrics,
            "calls": row.calls,
            "untrainable_calls": row.untrainable_calls,
            "created_at": iso(row.created_at),
            "rewarded_at": iso(row.rewarded_at),
        }
        for row in rows
    ]
    return {
        "group_id": group.group_id,
        "run": group.run,
        "mode": group.mode,
        "state": group.state,
        "expected_size": group.expected_size,
        "closed": group.closed,
        "size": len(trajectories),
        "rewarded": sum(1 for t in trajectories if t["reward"] is not None),
        # Counted toward the group's size like any other, but the trainer cannot use their untrainable calls.
        "untrainable_trajectories": sum(1 for t in trajectories if t["untrainable_calls"]),
        "claimed_by": group.claimed_by,
        "lease_until": iso(group.lease_until),
        "trained_step": group.trained_step,
        "drop_reason": group.drop_reason,
        "created_at": iso(group.created_at),
        "ready_at": iso(group.ready_at),
        "trajectories": trajectories,
    }
