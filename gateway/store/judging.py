"""What the LLM judge reads: a run's judge settings, the groups waiting for a judge, a group with its transcripts.

Rewards the judge produces are written by `gateway.store.rewards.store_rewards`, like anyone else's.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, and_, func, or_, select

from gateway.store.models import Call, Group, Run, Trajectory
from gateway.store.reads import trajectory_view


@dataclass(slots=True)
class GroupToJudge:
    group_id: str
    run: str
    mode: str
    state: str
    closed: bool
    expected_size: int | None
    trajectories: list[dict[str, Any]] = field(default_factory=list)  # trajectory_view dicts, in group order


def run_judge_block(engine: Engine, run: str) -> tuple[bool, dict[str, Any] | None]:
    """(the run exists, its stored `judge` config block or None)."""
    with engine.connect() as conn:
        row = conn.execute(select(Run.config).where(Run.name == run)).first()
    if row is None:
        return False, None
    block = (row.config or {}).get("judge")
    return True, block if isinstance(block, dict) else None


def load_group(engine: Engine, group_id: str) -> GroupToJudge | None:
    """The group and every trajectory in it with its calls (messages, completions), reward, metrics and metadata;
    None if no call of the group has been written."""
    with engine.connect() as conn:
        group = conn.execute(
            select(Group.group_id, Group.run, Group.mode, Group.state, Group.closed, Group.expected_size).where(
                Group.group_id == group_id
            )
        ).first()
        if group is None:
            return None
        ids = conn.execute(
            select(Trajectory.trajectory_id)
            .where(Trajectory.group_id == group_id)
            .order_by(Trajectory.created_at, Trajectory.trajectory_id)
        ).scalars().all()
    loaded = GroupToJudge(group.group_id, group.run, group.mode, group.state, group.closed, group.expected_size)
    for trajectory_id in ids:
        view = trajectory_view(engine, trajectory_id)
        if view is not None:
            loaded.trajectories.append(view)
    return loaded


def _aware(value: datetime | str | None) -> datetime | None:
    """SQLite hands timestamps back without their zone; they were written in UTC."""
    if value is None:
        return None
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def judgeable_groups(
    engine: Engine,
    run: str,
    *,
    min_size: int = 2,
    settle_s: float = 0.0,
    limit: int = 100,
    exclude: Collection[str] = (),
    now: datetime | None = None,
) -> list[str]:
    """Groups of `run` that are complete but not (fully) rewarded, oldest first: state `open`, at least `min_size`
    trajectories, some without a reward, and either closed, or at their expected size with no new call for
    `settle_s` seconds (reaching the size says every trajectory has started, not that it has finished; closing a
    group says it is done). Evaluation groups count too: their rewards make the eval curve."""
    counts = (
        select(
            Trajectory.group_id,
            func.count().label("total"),
            func.count(Trajectory.reward).label("rewarded"),
        )
        .where(Trajectory.run == run)
        .group_by(Trajectory.group_id)
        .subquery()
    )
    last_call = (
        select(Trajectory.group_id, func.max(Call.created_at).label("last_call"))
        .join(Call, Call.trajectory_id == Trajectory.trajectory_id)
        .where(Trajectory.run == run)
        .group_by(Trajectory.group_id)
        .subquery()
    )
    query = (
        select(Group.group_id, Group.closed, last_call.c.last_call)
        .join(counts, counts.c.group_id == Group.group_id)
        .outerjoin(last_call, last_call.c.group_id == Group.group_id)
        .where(
            Group.run == run,
            Group.state == "open",
            counts.c.rewarded < counts.c.total,
            counts.c.total >= min_size,
            or_(Group.closed, and_(Group.expected_size.is_not(None), counts.c.total >= Group.expected_size)),
        )
        .order_by(Group.created_at, Group.group_id)
    )
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    cutoff = (now or datetime.now(UTC)) - timedelta(seconds=settle_s)
    out = []
    for row in rows:
        if row.group_id in exclude:
            continue
        last = _aware(row.last_call)
        if not row.closed and last is not None and last > cutoff:
            continue  # complete by size only, and still active: let the agents finish
        out.append(row.group_id)
        if len(out) >= limit:
            break
    return out
