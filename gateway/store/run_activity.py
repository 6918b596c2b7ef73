"""Where each run's training stands: its last step and when, the reward over its last few steps, its groups by state,
and which trainer holds it. The runs list (API and UI) and the per-run gauges of /metrics read it for every run at
once, so it costs a fixed number of queries on one connection however many runs there are (never one per run).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import Engine, and_, func, select

from gateway.store.adapter_slots import adapters_held
from gateway.store.models import Group, Run, TrainerLease, TrainStep
from gateway.store.reads import iso

# How many of a run's newest steps its reward trend covers: enough to see a direction, few enough to read at a glance.
TREND_STEPS = 8
# The states a group waits in before a step trains or drops it: what /metrics counts (trained and dropped only grow).
LIVE_STATES = ("open", "ready", "claimed")


def _aware(value: datetime) -> datetime:
    """SQLite hands back naive datetimes; they were written as UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _number(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


@dataclass(frozen=True)
class TrainerHold:
    """The run's trainer lease as stored: who took it, and until when it holds unless renewed."""

    holder: str
    lease_until: datetime
    acquired_at: datetime

    def expired(self, now: datetime) -> bool:
        """Its holder stopped renewing it: the next trainer to ask takes the run over."""
        return self.lease_until < now


@dataclass
class RunActivity:
    step: int | None = None  # the newest committed training step; None before the first
    step_at: datetime | None = None
    # The step metric `reward_mean` (over every trajectory the step claimed) of the newest TREND_STEPS steps, oldest
    # first; None for a step that recorded none.
    rewards: list[tuple[int, float | None]] = field(default_factory=list)
    groups: dict[str, dict[str, int]] = field(default_factory=dict)  # {mode: {state: count}}
    trainer: TrainerHold | None = None

    def as_json(self, now: datetime) -> dict[str, Any]:
        """The fields the runs API adds to each run (docs/api.md)."""
        trainer = self.trainer
        return {
            "step": self.step,
            "last_step_at": iso(self.step_at),
            "reward_trend": [{"step": step, "reward_mean": reward} for step, reward in self.rewards],
            "trainer": None
            if trainer is None
            else {
                "holder": trainer.holder,
                "lease_until": iso(trainer.lease_until),
                "acquired_at": iso(trainer.acquired_at),
                "expired": trainer.expired(now),
            },
        }


def _trend_query(run: str | None) -> Any:
    """The newest TREND_STEPS steps of every run (or of `run`): ranked on the (run, step) key alone, then only those
    rows' metrics read, so the JSON of older steps is never touched."""
    ranked = select(
        TrainStep.run,
        TrainStep.step,
        func.row_number().over(partition_by=TrainStep.run, order_by=TrainStep.step.desc()).label("rank"),
    )
    if run is not None:
        ranked = ranked.where(TrainStep.run == run)
    newest = ranked.subquery()
    return (
        # The JSON value itself, not cast in SQL: a metric some caller logged as a string must not fail the page.
        select(TrainStep.run, TrainStep.step, TrainStep.created_at, TrainStep.metrics["reward_mean"])
        .join(newest, and_(newest.c.run == TrainStep.run, newest.c.step == TrainStep.step))
        .where(newest.c.rank <= TREND_STEPS)
        .order_by(TrainStep.run, TrainStep.step)
    )


def run_activity(
    engine: Engine, run: str | None = None, states: Sequence[str] | None = None
) -> dict[str, RunActivity]:
    """{run: its activity} for every run, or only `run`; groups counted in `states` only when given (every state
    otherwise). Four queries on one connection, whatever the number of runs."""
    runs = select(Run.name)
    groups = select(Group.run, Group.mode, Group.state, func.count()).group_by(Group.run, Group.mode, Group.state)
    leases = select(TrainerLease.run, TrainerLease.holder, TrainerLease.lease_until, TrainerLease.acquired_at)
    if run is not None:
        runs = runs.where(Run.name == run)
        groups = groups.where(Group.run == run)
        leases = leases.where(TrainerLease.run == run)
    if states is not None:
        groups = groups.where(Group.state.in_(list(states)))
    with engine.connect() as conn:
        out = {name: RunActivity() for name in conn.execute(runs).scalars()}
        for name, mode, state, count in conn.execute(groups):
            if name in out:
                out[name].groups.setdefault(mode, {})[state] = count
        for lease in conn.execute(leases):
            if lease.run in out:
                out[lease.run].trainer = TrainerHold(
                    lease.holder, _aware(lease.lease_until), _aware(lease.acquired_at)
                )
        for name, step, created_at, reward in conn.execute(_trend_query(run)):
            activity = out.get(name)
            if activity is None:
                continue
            activity.rewards.append((step, _number(reward)))
            activity.step, activity.step_at = step, _aware(created_at)  # ordered by step: the newest comes last
    return out


class RunGauges(NamedTuple):
    """One run's figures for /metrics (gateway.http.metrics)."""

    run: str
    groups: dict[str, int]  # training groups per LIVE_STATES state, zeros included
    step: int  # 0 before the first step
    seconds_since_step: float | None  # None before the first step
    trainer_held: bool  # a trainer holds an unexpired lease on the run
    adapters: int  # the run's adapters in vLLM's slots (gateway/store/adapter_slots.py)


def run_gauges(engine: Engine) -> list[RunGauges]:
    """Every run's gauges, as /metrics exposes them: one label value per existing run, none for a deleted one."""
    now = datetime.now(UTC)
    held = adapters_held(engine)
    gauges = []
    for name, activity in sorted(run_activity(engine, states=LIVE_STATES).items()):
        train = activity.groups.get("train", {})
        gauges.append(
            RunGauges(
                name,
                {state: train.get(state, 0) for state in LIVE_STATES},
                activity.step or 0,
                None if activity.step_at is None else max(0.0, (now - activity.step_at).total_seconds()),
                activity.trainer is not None and not activity.trainer.expired(now),
                len(held.get(name, [])),
            )
        )
    return gauges
