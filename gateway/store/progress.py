"""How a run is doing, as both the web UI and the trainer's experiment trackers show it: the eval curve and a few
sample trajectories. Its own module so the trainer reads these without importing the UI's read model
(gateway.store.ui_reads), which is shaped by and for the pages.
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Engine, func, select

from gateway.store.models import Call, Trajectory
from gateway.store.reads import completion_of

# z for a two-sided 95% normal interval: the eval curve's error bars.
Z95 = 1.959964


def eval_curve(engine: Engine, run: str) -> list[dict[str, Any]]:
    """Mean reward of the run's evaluation trajectories per policy version (the version of their first call), with
    a 95% normal-approximation interval: the curve that says whether training helps."""
    # The first call's version, one index probe per trajectory (calls by (trajectory_id, seq)); a min() over the
    # correlated calls let Postgres plan one aggregate over every call of the table instead (0.4 s at 100k calls).
    first_version = (
        select(Call.policy_version)
        .where(Call.trajectory_id == Trajectory.trajectory_id)
        .order_by(Call.seq, Call.choice_index)
        .limit(1)
        .scalar_subquery()
    )
    rewards = (
        select(Trajectory.reward.label("reward"), first_version.label("version"))
        .where(Trajectory.run == run, Trajectory.mode == "eval", Trajectory.reward.is_not(None))
        .subquery()
    )
    with engine.connect() as conn:
        rows = conn.execute(
            select(
                rewards.c.version,
                func.count(),
                func.avg(rewards.c.reward),
                func.avg(rewards.c.reward * rewards.c.reward),
            )
            .where(rewards.c.version.is_not(None))
            .group_by(rewards.c.version)
            .order_by(rewards.c.version)
        ).all()
    curve = []
    for version, count, mean, mean_sq in rows:
        std = math.sqrt(max(0.0, float(mean_sq) - float(mean) ** 2)) if count else 0.0
        half = Z95 * std / math.sqrt(count) if count > 1 else 0.0
        curve.append(
            {
                "policy_version": version,
                "trajectories": count,
                "mean_reward": float(mean),
                "std": std,
                "ci_low": float(mean) - half,
                "ci_high": float(mean) + half,
            }
        )
    return curve


def sample_trajectories(engine: Engine, trajectory_ids: list[str]) -> list[dict[str, Any]]:
    """A few trajectories for a tracker's table: id, group, reward, number of calls and the last answer."""
    if not trajectory_ids:
        return []
    with engine.connect() as conn:
        trajectories = conn.execute(
            select(Trajectory.trajectory_id, Trajectory.group_id, Trajectory.reward).where(
                Trajectory.trajectory_id.in_(trajectory_ids)
            )
        ).all()
        calls = conn.execute(
            select(Call.trajectory_id, Call.seq, Call.choice_index, Call.endpoint, Call.response)
            .where(Call.trajectory_id.in_(trajectory_ids), Call.choice_index == 0)
            .order_by(Call.trajectory_id, Call.seq)
        ).all()
    last: dict[str, tuple[int, str]] = {}
    counts: dict[str, int] = {}
    for call in calls:
        text, tool_calls = completion_of(call.response, call.choice_index, call.endpoint)
        shown = text or ""
        if tool_calls:
            shown += " " + " ".join(
                f"{(t.get('function') or {}).get('name')}({(t.get('function') or {}).get('arguments')})" for t in tool_calls
            )
        counts[call.trajectory_id] = counts.get(call.trajectory_id, 0) + 1
        last[call.trajectory_id] = (call.seq, shown.strip())
    order = {tid: i for i, tid in enumerate(trajectory_ids)}
    return [
        {
            "trajectory_id": t.trajectory_id,
            "group_id": t.group_id,
            "reward": t.reward,
            "calls": counts.get(t.trajectory_id, 0),
            "last_answer": last.get(t.trajectory_id, (0, ""))[1],
        }
        for t in sorted(trajectories, key=lambda t: order[t.trajectory_id])
    ]
