"""Admission's SQL: admit new training groups against a run's bound, atomically across gateways, and report it.

The bound (docs/training.md): a group admitted while version V serves the run can still be trained if the trainer
consumes it by the step it builds while V + max_staleness is current. Steps advance the version one at a time and
each takes groups_per_step groups (oldest admitted first), so with L = steps committed but not yet served (last step
- V) and B = 1 while a step is being trained (its claimed groups are chosen: a group it drops frees no room in it),
the groups that fit are

    slots = (max_staleness + 1 - L - B) x groups_per_step        (0 while L > 0 under drain_on_swap)

and a new group is admitted while in_flight < slots, where in_flight counts the run's admitted groups that are not
claimed, trained or dropped, were admitted on a version that can still train (>= V - max_staleness), and not longer
ago than admission_expire_s. The decision runs in one transaction that holds the run's row (Postgres FOR NO KEY
UPDATE; SQLite's write lock), so two gateways never both take the last slot.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, func, select, update
from sqlalchemy.dialects import postgresql, sqlite

from gateway.runs.config import merged_config
from gateway.store.db import write_transaction
from gateway.store.models import Admission, AdmissionRefusal, Group, PolicyVersion, Run, TrainStep

CONSUMED = ("trained", "dropped")
STALE_REASON = "stale policy"  # trainer/samples.py's drop reason


@dataclass(frozen=True)
class Decision:
    """What one admission transaction decided for the groups it was asked about."""

    admitted: set[str]  # admitted now or before (by any gateway)
    newly_admitted: set[str]
    in_flight: int  # after this decision
    slots: int
    retry_after_s: int  # a hint for refused calls: about one training step
    # The version each admitted group was admitted on (its calls are served within its bound of it); a group
    # missing here (no run row yet, no database) is served by the newest version.
    versions: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Bound:
    version: int
    last_step: int
    slots: int
    in_flight: int


def _insert(conn: Connection) -> Any:
    return postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert


def _now() -> datetime:
    return datetime.now(UTC)


def _serving(run: str) -> Any:
    return (
        select(func.coalesce(func.max(PolicyVersion.step), 0))
        .where(PolicyVersion.run == run, PolicyVersion.status == "loaded")
        .scalar_subquery()
    )


def _bound(conn: Connection, run: str, config: dict[str, Any], now: datetime) -> Bound:
    """The serving version, the last step, whether a step is being trained, and the groups in flight, read by one
    statement: on Postgres each statement sees what was committed when it began, and a step committed between two
    reads would show its groups consumed but not the step, leaving room that is not there."""
    settings = merged_config(config, {})
    version = _serving(run)
    in_flight = (
        select(func.count())
        .select_from(Admission)
        .outerjoin(Group, Group.group_id == Admission.group_id)
        .where(
            Admission.run == run,
            Admission.policy_version >= version - settings.max_staleness,
            Admission.admitted_at >= now - timedelta(seconds=settings.admission_expire_s),
            Group.state.is_(None) | Group.state.not_in((*CONSUMED, "claimed")),
        )
        .scalar_subquery()
    )
    last = select(func.coalesce(func.max(TrainStep.step), 0)).where(TrainStep.run == run).scalar_subquery()
    training = select(Group.group_id).where(Group.run == run, Group.state == "claimed").exists()
    row = conn.execute(select(version, last, in_flight, training)).one()
    serving, last_step, groups, busy = row[0], row[1], row[2], bool(row[3])
    lag = max(0, last_step - serving)
    steps = 0 if settings.drain_on_swap and lag else max(0, settings.max_staleness + 1 - lag - int(busy))
    return Bound(serving, last_step, steps * settings.groups_per_step, groups)


def _retry_after(conn: Connection, run: str) -> int:
    """Seconds until room is likely: the last step's length (it frees groups_per_step slots), 1 to 60."""
    metrics = conn.execute(
        select(TrainStep.metrics).where(TrainStep.run == run).order_by(TrainStep.step.desc()).limit(1)
    ).scalar_one_or_none()
    seconds = (metrics or {}).get("step_seconds")
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        return 1
    return int(min(60, max(1, math.ceil(seconds))))


def admit_groups(engine: Engine, run: str, asks: Sequence[tuple[str, float]]) -> Decision:
    """Decide for `asks` ((group id, seconds its first caller has waited), oldest first): groups already admitted
    stay admitted; new ones are admitted in order while the run's bound has room. A run not created yet (its first
    call is still in the writer's queue) has no bound to keep: everything is admitted, nothing recorded."""
    ids = list(dict.fromkeys(group for group, _ in asks))
    waited: dict[str, float] = {}
    for group, seconds in asks:
        waited.setdefault(group, seconds)
    now = _now()
    with write_transaction(engine) as conn:
        config = conn.execute(
            select(Run.config).where(Run.name == run).with_for_update(key_share=True)
        ).first()
        if config is None:
            return Decision(set(ids), set(), 0, 0, 1)
        versions: dict[str, int] = dict(
            conn.execute(
                select(Admission.group_id, Admission.policy_version).where(Admission.group_id.in_(ids))
            ).all()
        )
        known = set(versions)
        bound = _bound(conn, run, config[0] or {}, now)
        fresh = [group for group in ids if group not in known][: max(0, bound.slots - bound.in_flight)]
        if fresh:
            conn.execute(
                _insert(conn)(Admission)
                .values(
                    [
                        {"group_id": g, "run": run, "policy_version": bound.version, "admitted_at": now,
                         "wait_s": waited[g]}  # fmt: skip
                        for g in fresh
                    ]
                )
                .on_conflict_do_nothing(index_elements=["group_id"])
            )
            versions.update((group, bound.version) for group in fresh)
        refused = len(ids) > len(known) + len(fresh)
        retry_after = _retry_after(conn, run) if refused else 1
    return Decision(
        admitted=known | set(fresh),
        newly_admitted=set(fresh),
        versions=versions,
        in_flight=bound.in_flight + len(fresh),
        slots=bound.slots,
        retry_after_s=retry_after,
    )


@dataclass(frozen=True)
class Due:
    """Admitted groups that the trainer's next step is the last to train fresh (admitted on version <=
    current - max_staleness, not trained or dropped, not expired): how many are ready, how many still play."""

    ready: int
    playing: int


def due_groups(engine: Engine, run: str) -> Due:
    """The trainer waits for these before it steps: claimed oldest first, they are all trained fresh only if the
    step waits for the ones still playing. Without it a group that finishes late is overtaken by groups admitted
    after it and goes stale (measured: 2 of 16 groups in a 64-episode fleet)."""
    now = _now()
    with engine.connect() as conn:
        config = conn.execute(select(Run.config).where(Run.name == run)).scalar_one_or_none()
        settings = merged_config(config or {}, {})
        if settings.admission == "off":
            return Due(0, 0)
        rows = conn.execute(
            select(Group.state, func.count())
            .select_from(Admission)
            .outerjoin(Group, Group.group_id == Admission.group_id)
            .where(
                Admission.run == run,
                Admission.policy_version <= _serving(run) - settings.max_staleness,
                Admission.admitted_at >= now - timedelta(seconds=settings.admission_expire_s),
                Group.state.is_(None) | Group.state.not_in(CONSUMED),
            )
            .group_by(Group.state)
        ).all()
    counts = {state: count for state, count in rows}
    ready = counts.pop("ready", 0)
    counts.pop("claimed", None)  # a step holds them already
    return Due(ready, sum(counts.values()))


def count_refusal(engine: Engine, run: str, kind: str) -> None:
    """Count a call turned away (`kind`: rejected or timed_out) for the run's read API."""
    column = {"rejected": AdmissionRefusal.rejected, "timed_out": AdmissionRefusal.timed_out}[kind]
    with write_transaction(engine) as conn:
        if conn.execute(select(Run.name).where(Run.name == run)).first() is None:
            return
        conn.execute(
            _insert(conn)(AdmissionRefusal)
            .values(run=run, rejected=0, timed_out=0)
            .on_conflict_do_nothing(index_elements=["run"])
        )
        conn.execute(update(AdmissionRefusal).where(AdmissionRefusal.run == run).values({column.key: column + 1}))


def admission_view(engine: Engine, run: str, config: dict[str, Any]) -> dict[str, Any]:
    """The run's admission as the read API shows it: the bound now, what was admitted and refused, how long calls
    waited, and the two sides of the trade: the share of time agents spent waiting for admission (of the time from a
    group's first call to its readiness) vs the trainer waiting for ready groups (of its loop time), plus the
    groups dropped as stale and the staleness of what was trained."""
    now = _now()
    settings = merged_config(config, {})
    with engine.connect() as conn:
        bound = _bound(conn, run, config, now)
        admitted, wait_sum, wait_max = conn.execute(
            select(func.count(), func.coalesce(func.sum(Admission.wait_s), 0.0), func.max(Admission.wait_s)).where(
                Admission.run == run
            )
        ).one()
        ready = conn.execute(
            select(Admission.admitted_at, Admission.wait_s, Group.ready_at)
            .join(Group, Group.group_id == Admission.group_id)
            .where(Admission.run == run, Group.ready_at.is_not(None))
        ).all()
        refusals = conn.execute(
            select(AdmissionRefusal.rejected, AdmissionRefusal.timed_out).where(AdmissionRefusal.run == run)
        ).first()
        stale = conn.execute(
            select(func.count()).where(Group.run == run, Group.state == "dropped", Group.drop_reason == STALE_REASON)
        ).scalar_one()
        steps = [row[0] or {} for row in conn.execute(
            select(TrainStep.metrics).where(TrainStep.run == run).order_by(TrainStep.step)
        ).all()]
    waited = sum(row.wait_s for row in ready)
    playing = sum(max(0.0, (_aware(row.ready_at) - _aware(row.admitted_at)).total_seconds()) for row in ready)
    return {
        "mode": settings.admission,
        "drain_on_swap": settings.drain_on_swap,
        "policy_version": bound.version,
        "last_step": bound.last_step,
        "slots": bound.slots,
        "in_flight": bound.in_flight,
        "admitted_groups": admitted,
        "wait_s_mean": wait_sum / admitted if admitted else None,
        "wait_s_max": wait_max,
        "rejected": refusals.rejected if refusals else 0,
        "timed_out": refusals.timed_out if refusals else 0,
        # Of the time from admitting a group to its readiness (all rewards in), the share its first call waited.
        "agent_wait_share": waited / (waited + playing) if waited + playing > 0 else None,
        **trainer_figures(steps),
        "groups_dropped_stale": stale,
    }


def trainer_figures(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """From the steps' metrics: the share of the trainer's loop spent waiting for ready groups, stale drops per
    step, and the staleness (current version - oldest version sampling it) of the groups trained."""
    waited = sum(m.get("wait_seconds") or 0.0 for m in steps)
    busy = sum((m.get("step_seconds") or 0.0) + (m.get("swap_seconds") or 0.0) for m in steps)
    # (groups used, their mean staleness, their max staleness) of the steps that trained groups
    used: list[tuple[int, float, int | None]] = []
    for m in steps:
        n, mean, top = m.get("groups_used") or 0, m.get("staleness_mean"), m.get("staleness_max")
        if n and mean is not None:
            used.append((n, mean, top))
    total = sum(n for n, _, _ in used)
    return {
        "trainer_idle_share": waited / (waited + busy) if waited + busy > 0 else None,
        "stale_dropped_per_step": [(m.get("drop_reasons") or {}).get(STALE_REASON, 0) for m in steps],
        "staleness_mean": sum(n * mean for n, mean, _ in used) / total if total else None,
        "staleness_max": max((top for _, _, top in used if top is not None), default=None),
    }


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
