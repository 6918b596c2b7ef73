"""What the web UI (gateway.ui.pages) reads: runs at a glance, one run's curves, a group side by
side, a trajectory with its completion tokens, and a filtered, keyset-paginated list of trajectories.

Every query here is driven by an index (runs by name, groups by (run, state), trajectories by (run, created_at) or
group_id, calls by (trajectory_id, seq), train_steps by (run, step)), so a page costs the same on a run with 100k
calls as on one with ten. Nothing here scans the calls of a whole run: merge figures come from the step metrics.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, and_, func, or_, select

from gateway.runs.config import merged_config
from gateway.store.arrays import decode_ids, decode_logprobs
from gateway.store.models import Call, Group, Run, TrainStep, Trajectory
from gateway.store.progress import eval_curve
from gateway.store.reads import completion_of, iso, trajectory_view
from gateway.store.runs import list_runs, trajectory_counts

# Trainer's advantage epsilon (trainer.samples.STD_EPS); a test keeps the two in step.
STD_EPS = 1e-6
MAX_STEPS_SHOWN = 5000


def runs_overview(engine: Engine) -> list[dict[str, Any]]:
    """Every run: its policy version, groups by state, last step, reward trend, trainer (all from the runs list) and
    the eval reward per version."""
    runs = list_runs(engine)
    for run in runs:
        run["eval"] = eval_curve(engine, run["name"])
    return runs


def run_page(engine: Engine, run: str) -> dict[str, Any] | None:
    """One run: its summary, groups by state, trajectory counts, why groups were dropped, every step's metrics
    (newest MAX_STEPS_SHOWN) and the eval curve. None if there is no such run."""
    summary = next(iter(list_runs(engine, run)), None)
    if summary is None:
        return None
    with engine.connect() as conn:
        trajectories = trajectory_counts(conn, run)
        dropped = conn.execute(
            select(Group.drop_reason, func.count())
            .where(Group.run == run, Group.state == "dropped")
            .group_by(Group.drop_reason)
            .order_by(func.count().desc())
        ).all()
        steps = conn.execute(
            select(TrainStep.step, TrainStep.metrics, TrainStep.created_at)
            .where(TrainStep.run == run)
            .order_by(TrainStep.step.desc())
            .limit(MAX_STEPS_SHOWN)
        ).all()
    return {
        **summary,
        "trajectories": trajectories,
        "drop_reasons": [{"reason": reason or "(none given)", "groups": count} for reason, count in dropped],
        "steps": [
            {"step": row.step, "metrics": row.metrics or {}, "created_at": iso(row.created_at)} for row in reversed(steps)
        ],
        "eval": eval_curve(engine, run),
    }


def advantages(rewards: list[float], mode: str) -> list[float]:
    """The advantages the trainer gives a group's trajectories (trainer.samples.group_advantages, which the gateway
    cannot import: it pulls torch): population-std z-scores for `group`, mean-centred rewards for `drgrpo`."""
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    if mode == "drgrpo":
        return [r - mean for r in rewards]
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + STD_EPS) for r in rewards]


def sft_selected(rewards: list[float], min_reward: float | None, best_k: int | None) -> list[bool]:
    """Which of a group's trajectories loss ``sft`` trains (trainer.samples.select_trajectories, which the gateway
    cannot import): reward at least ``min_reward``, or the ``best_k`` best, ties to the earlier trajectory."""
    if min_reward is not None:
        return [r >= min_reward for r in rewards]
    best = set(sorted(range(len(rewards)), key=lambda i: -rewards[i])[: best_k or 0])
    return [i in best for i in range(len(rewards))]


def group_page(engine: Engine, group_id: str) -> dict[str, Any] | None:
    """A group's lifecycle and its trajectories side by side: reward, advantage under the run's `advantage` setting
    (once every reward is in), judge explanation, and each call's answer. None if unknown."""
    with engine.connect() as conn:
        group = conn.execute(select(*Group.__table__.columns).where(Group.group_id == group_id)).first()
        if group is None:
            return None
        config = merged_config(conn.execute(select(Run.config).where(Run.name == group.run)).scalar(), {})
        advantage_mode = config.advantage
        trajectories = conn.execute(
            select(
                Trajectory.trajectory_id,
                Trajectory.mode,
                Trajectory.reward,
                Trajectory.metrics,
                Trajectory.meta.label("meta"),
                Trajectory.untrainable_calls,
                Trajectory.trained_step,
                Trajectory.created_at,
            )
            .where(Trajectory.group_id == group_id)
            .order_by(Trajectory.created_at, Trajectory.trajectory_id)
        ).all()
        ids = [t.trajectory_id for t in trajectories]
        calls = conn.execute(
            select(
                Call.trajectory_id,
                Call.seq,
                Call.choice_index,
                Call.endpoint,
                Call.response,
                Call.policy_version,
                Call.finish_reason,
                Call.trainable,
            )
            .where(Call.trajectory_id.in_(ids))
            .order_by(Call.trajectory_id, Call.seq, Call.choice_index)
        ).all() if ids else []
    answers: dict[str, list[dict[str, Any]]] = {}
    for call in calls:
        text, tool_calls = completion_of(call.response, call.choice_index, call.endpoint)
        answers.setdefault(call.trajectory_id, []).append(
            {
                "completion": text,
                "tool_calls": tool_calls,
                "policy_version": call.policy_version,
                "finish_reason": call.finish_reason,
                "trainable": call.trainable,
            }
        )
    rewards = [t.reward for t in trajectories]
    complete = bool(rewards) and all(r is not None and math.isfinite(r) for r in rewards)
    advs = advantages([float(r) for r in rewards], advantage_mode) if complete else [None] * len(rewards)
    selected: list[bool | None] = [None] * len(rewards)
    if config.loss == "sft" and complete:
        selected = list(sft_selected([float(r) for r in rewards], config.sft_min_reward, config.sft_best_k))
    return {
        "group_id": group.group_id,
        "run": group.run,
        "mode": group.mode,
        "state": group.state,
        "expected_size": group.expected_size,
        "closed": group.closed,
        "trained_step": group.trained_step,
        "drop_reason": group.drop_reason,
        "created_at": iso(group.created_at),
        "ready_at": iso(group.ready_at),
        "advantage_mode": advantage_mode,
        # What the run's objective trains a trajectory on: the group advantage only for the policy objectives (and,
        # weighted, distillation's reward term); SFT's selection; distillation's teacher.
        "objective": {
            "loss": config.loss,
            "sft_min_reward": config.sft_min_reward,
            "sft_best_k": config.sft_best_k,
            "teacher": config.teacher,
            "distill_reward_weight": config.distill_reward_weight or 0.0,
        },
        "trajectories": [
            {
                "trajectory_id": t.trajectory_id,
                "reward": t.reward,
                "advantage": adv,
                "sft_selected": chosen,
                "metrics": t.metrics,
                "judge": ((t.meta or {}).get("judge") or {}) if isinstance(t.meta, dict) else {},
                "untrainable_calls": t.untrainable_calls,
                "trained_step": t.trained_step,
                "created_at": iso(t.created_at),
                "calls": answers.get(t.trajectory_id, []),
            }
            for t, adv, chosen in zip(trajectories, advs, selected, strict=True)
        ],
    }


def trajectory_page(engine: Engine, trajectory_id: str) -> dict[str, Any] | None:
    """The read API's trajectory view plus, per call, its completion ids and logprobs, the turn and choice of its
    tree parent (gateway.store.tree) and whether it forks there (its parent's branch goes on in another call), and
    the step that trained the trajectory. None if unknown."""
    view = trajectory_view(engine, trajectory_id)
    if view is None:
        return None
    with engine.connect() as conn:
        rows = conn.execute(
            select(Call.id, Call.completion_token_ids, Call.completion_logprobs, Call.segment_reason)
            .where(Call.trajectory_id == trajectory_id)
        ).all()
        trained_step = conn.execute(
            select(Trajectory.trained_step).where(Trajectory.trajectory_id == trajectory_id)
        ).scalar()
    by_id = {row.id: row for row in rows}
    turn_of_seq = {call["seq"]: call["turn"] for call in view["calls"]}
    branch_of = {(call["seq"], call["choice_index"]): call["branch"] for call in view["calls"]}
    for call in view["calls"]:
        row = by_id[call["id"]]
        parent = call["parent"]
        parent_key = (parent["seq"], parent["choice_index"]) if parent else None
        call["completion_token_ids"] = decode_ids(row.completion_token_ids) or []
        call["completion_logprobs"] = decode_logprobs(row.completion_logprobs) or []
        call["parent_turn"] = turn_of_seq.get(parent_key[0]) if parent_key else None
        call["parent_choice"] = parent_key[1] if parent_key else None
        call["fork"] = parent_key is not None and branch_of.get(parent_key) != call["branch"]
        call["segment_reason"] = row.segment_reason
    view["trained_step"] = trained_step
    return view


@dataclass(frozen=True)
class TrajectoryFilter:
    """What the trajectory search narrows by; run or group is required (each is an index)."""

    run: str | None = None
    group_id: str | None = None
    mode: str | None = None  # "train" | "eval"
    reward_min: float | None = None
    reward_max: float | None = None
    untrainable: bool | None = None  # True: with untrainable calls; False: without


class BadCursor(ValueError):
    """A page cursor this store did not hand out."""


def encode_cursor(created_at: datetime, trajectory_id: str) -> str:
    if created_at.tzinfo is None:
        created_at = created_at.replace(tzinfo=UTC)
    raw = f"{created_at.isoformat()}|{trajectory_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        if "\x00" in raw:  # no cursor of ours holds one, and Postgres would refuse it in the query
            raise ValueError("a NUL character")
        stamp, trajectory_id = raw.split("|", 1)
        created_at = datetime.fromisoformat(stamp)
    except ValueError as exc:  # binascii.Error and UnicodeDecodeError are ValueErrors
        raise BadCursor(f"not a page cursor: {cursor[:40]!r}") from exc
    return created_at, trajectory_id


def search_trajectories(
    engine: Engine, where: TrajectoryFilter, after: str | None = None, limit: int = 50
) -> tuple[list[dict[str, Any]], str | None]:
    """Trajectories matching `where`, newest first, `limit` a page, continuing after the cursor `after`; returns the
    page and the cursor of the next one (None at the end). Keyset pagination on (created_at, trajectory_id): page
    1000 costs what page 1 does."""
    if where.run is None and where.group_id is None:
        raise ValueError("give a run or a group to search in")
    call_count = (
        select(func.count()).where(Call.trajectory_id == Trajectory.trajectory_id).scalar_subquery().label("calls")
    )
    query = select(
        Trajectory.trajectory_id,
        Trajectory.run,
        Trajectory.group_id,
        Trajectory.mode,
        Trajectory.reward,
        Trajectory.untrainable_calls,
        Trajectory.trained_step,
        Trajectory.created_at,
        call_count,
    )
    if where.run is not None:
        query = query.where(Trajectory.run == where.run)
    if where.group_id is not None:
        query = query.where(Trajectory.group_id == where.group_id)
    if where.mode is not None:
        query = query.where(Trajectory.mode == where.mode)
    if where.reward_min is not None:
        query = query.where(Trajectory.reward >= where.reward_min)
    if where.reward_max is not None:
        query = query.where(Trajectory.reward <= where.reward_max)
    if where.untrainable is True:
        query = query.where(Trajectory.untrainable_calls > 0)
    elif where.untrainable is False:
        query = query.where(Trajectory.untrainable_calls == 0)
    if after is not None:
        created_at, trajectory_id = decode_cursor(after)
        if engine.dialect.name == "sqlite":  # stored naive in UTC; compare like with like
            created_at = created_at.astimezone(UTC).replace(tzinfo=None)
        query = query.where(
            or_(
                Trajectory.created_at < created_at,
                and_(Trajectory.created_at == created_at, Trajectory.trajectory_id < trajectory_id),
            )
        )
    query = query.order_by(Trajectory.created_at.desc(), Trajectory.trajectory_id.desc()).limit(limit + 1)
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    page = rows[:limit]
    items = [
        {
            "trajectory_id": row.trajectory_id,
            "run": row.run,
            "group_id": row.group_id,
            "mode": row.mode,
            "reward": row.reward,
            "untrainable_calls": row.untrainable_calls,
            "trained_step": row.trained_step,
            "calls": row.calls,
            "created_at": iso(row.created_at),
        }
        for row in page
    ]
    more = len(rows) > limit
    return items, encode_cursor(page[-1].created_at, page[-1].trajectory_id) if more and page else None
