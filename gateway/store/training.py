"""What the trainer asks of the database: claim ready groups under a lease, read them, commit a step.

A step is all-or-nothing: groups go `ready -> claimed` with a lease; the trainer commits `claimed -> trained`
together with the step's metrics in one transaction, and only if it still holds every lease. A trainer that dies
leaves claims whose leases expire, and those groups become ready again for the next trainer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Engine, func, select, update

from gateway.store.arrays import decode_ids, decode_logprobs
from gateway.store.db import READY_CHANNEL, write_transaction
from gateway.store.models import Call, Group, PolicyVersion, Run, TrainStep, Trajectory
from gateway.store.runs import record_train_step


log = logging.getLogger("trajgate.store")


class LeaseLost(RuntimeError):
    """The trainer no longer holds a group it trained on (its lease expired and another trainer took it)."""


@dataclass(frozen=True)
class RunSpec:
    name: str
    base_model: str
    base_weights: str | None
    config: dict[str, Any]


class ReadyListener:
    """Lets a waiting trainer wake as soon as a group of its run becomes ready (Postgres LISTEN/NOTIFY).

    Polling stays the fallback: on SQLite, or while the listening connection is down, `wait` just sleeps.
    """

    def __init__(self, engine: Engine, run: str) -> None:
        self.run = run
        self._url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._postgres = engine.dialect.name == "postgresql"
        self._conn: Any = None

    def _connect(self) -> Any:
        import psycopg

        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self._url, autocommit=True, connect_timeout=5)
            self._conn.execute(f"LISTEN {READY_CHANNEL}")
        return self._conn

    def wait(self, timeout_s: float, stop: threading.Event) -> bool:
        """Sleep up to `timeout_s` (less if `stop` is set meanwhile); True if this run announced a ready group."""
        if not self._postgres:
            stop.wait(timeout_s)
            return False
        try:
            conn = self._connect()
            for note in conn.notifies(timeout=timeout_s, stop_after=1):
                return note.payload == self.run
            return False
        except Exception as exc:  # the database went away: poll until it is back
            log.warning("LISTEN %s unavailable (%s); polling", READY_CHANNEL, type(exc).__name__)
            self.close()
            stop.wait(timeout_s)
            return False

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _aware(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; they were written as UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value


def get_run(engine: Engine, run: str) -> RunSpec | None:
    with engine.connect() as conn:
        row = conn.execute(select(Run.name, Run.base_model, Run.base_weights, Run.config).where(Run.name == run)).first()
    return None if row is None else RunSpec(row.name, row.base_model, row.base_weights, dict(row.config or {}))


def last_step(engine: Engine, run: str) -> int:
    """The newest committed step of the run (0 before any)."""
    with engine.connect() as conn:
        return conn.execute(select(func.coalesce(func.max(TrainStep.step), 0)).where(TrainStep.run == run)).scalar_one()


def current_policy_version(engine: Engine, run: str) -> int:
    """The newest version vLLM serves for the run (0 = the base model)."""
    with engine.connect() as conn:
        return conn.execute(
            select(func.coalesce(func.max(PolicyVersion.step), 0)).where(
                PolicyVersion.run == run, PolicyVersion.status == "loaded"
            )
        ).scalar_one()


def release_expired_claims(engine: Engine, run: str) -> int:
    """Return groups whose trainer stopped renewing its lease to the ready pool; how many."""
    with engine.begin() as conn:
        result = conn.execute(
            update(Group)
            .where(Group.run == run, Group.state == "claimed", Group.lease_until < _now())
            .values(state="ready", claimed_by=None, lease_until=None)
        )
    return result.rowcount


def count_ready_groups(engine: Engine, run: str) -> int:
    with engine.connect() as conn:
        return conn.execute(
            select(func.count()).select_from(Group).where(Group.run == run, Group.state == "ready", Group.mode == "train")
        ).scalar_one()


def claim_ready_groups(engine: Engine, run: str, worker: str, limit: int, lease_s: float) -> list[str]:
    """Atomically take up to `limit` ready training groups, oldest first.

    On Postgres, SKIP LOCKED lets two trainers claim at once without waiting on or sharing a group; on SQLite the
    write transaction holds the database's single write lock, which gives the same guarantee.
    """
    with write_transaction(engine) as conn:
        ids = list(
            conn.execute(
                select(Group.group_id)
                .where(Group.run == run, Group.state == "ready", Group.mode == "train")
                .order_by(Group.ready_at, Group.group_id)
                .limit(limit)
                .with_for_update(skip_locked=True)
            ).scalars()
        )
        if ids:
            conn.execute(
                update(Group)
                .where(Group.group_id.in_(ids))
                .values(state="claimed", claimed_by=worker, lease_until=_now() + timedelta(seconds=lease_s))
            )
    return ids


def renew_leases(engine: Engine, group_ids: Sequence[str], worker: str, lease_s: float) -> int:
    """Extend the leases this worker still holds; how many it still holds."""
    with engine.begin() as conn:
        result = conn.execute(
            update(Group)
            .where(Group.group_id.in_(list(group_ids)), Group.state == "claimed", Group.claimed_by == worker)
            .values(lease_until=_now() + timedelta(seconds=lease_s))
        )
    return result.rowcount


def load_groups(engine: Engine, group_ids: Sequence[str]) -> list[dict[str, Any]]:
    """The claimed groups with their rewarded trajectories and every call, in order, arrays decoded.

    Plain dicts whose call fields match the trainer's CallData, so the store stays free of trainer imports.
    """
    ids = list(group_ids)
    with engine.connect() as conn:
        trajectories = conn.execute(
            select(Trajectory.trajectory_id, Trajectory.group_id, Trajectory.reward)
            .where(Trajectory.group_id.in_(ids))
            .order_by(Trajectory.group_id, Trajectory.created_at, Trajectory.trajectory_id)
        ).all()
        calls = conn.execute(
            select(
                Call.trajectory_id,
                Call.seq,
                Call.choice_index,
                Call.policy_version,
                Call.prompt_token_ids,
                Call.completion_token_ids,
                Call.completion_logprobs,
                Call.trainable,
                Call.untrainable_reason,
            )
            .join(Trajectory, Trajectory.trajectory_id == Call.trajectory_id)
            .where(Trajectory.group_id.in_(ids))
            .order_by(Call.trajectory_id, Call.seq, Call.choice_index)
        ).all()
    by_trajectory: dict[str, list[dict[str, Any]]] = {}
    for row in calls:
        by_trajectory.setdefault(row.trajectory_id, []).append(
            {
                "seq": row.seq,
                "choice_index": row.choice_index,
                "policy_version": row.policy_version,
                "prompt_token_ids": decode_ids(row.prompt_token_ids),
                "completion_token_ids": decode_ids(row.completion_token_ids),
                "completion_logprobs": decode_logprobs(row.completion_logprobs),
                "trainable": row.trainable,
                "untrainable_reason": row.untrainable_reason,
            }
        )
    groups: dict[str, dict[str, Any]] = {gid: {"group_id": gid, "trajectories": []} for gid in ids}
    for row in trajectories:
        groups[row.group_id]["trajectories"].append(
            {"trajectory_id": row.trajectory_id, "reward": row.reward, "calls": by_trajectory.get(row.trajectory_id, [])}
        )
    return [groups[gid] for gid in ids]


def _held(conn: Any, group_ids: list[str], worker: str) -> None:
    rows = conn.execute(
        select(Group.group_id, Group.state, Group.claimed_by)
        .where(Group.group_id.in_(group_ids))
        .order_by(Group.group_id)
        .with_for_update()
    ).all()
    lost = sorted(set(group_ids) - {r.group_id for r in rows if r.state == "claimed" and r.claimed_by == worker})
    if lost:
        raise LeaseLost(f"{len(lost)} claimed group(s) are no longer held by {worker}: {', '.join(lost[:5])}")


def drop_groups(engine: Engine, drops: Sequence[tuple[str, str]], worker: str) -> None:
    """Mark claimed groups as dropped (stale, zero variance, nothing trainable) with the reason, for good."""
    if not drops:
        return
    with write_transaction(engine) as conn:
        _held(conn, [gid for gid, _ in drops], worker)
        for group_id, reason in drops:
            conn.execute(
                update(Group)
                .where(Group.group_id == group_id)
                .values(state="dropped", drop_reason=reason, lease_until=None)
            )


def commit_step(
    engine: Engine, run: str, step: int, worker: str, group_ids: Sequence[str], metrics: dict[str, Any]
) -> None:
    """Record step `step` as done: its groups trained and its metrics, in one transaction or not at all.

    Raises LeaseLost (and changes nothing) if another trainer took any of the groups meanwhile.
    """
    ids = list(group_ids)
    with write_transaction(engine) as conn:
        _held(conn, ids, worker)
        conn.execute(
            update(Group)
            .where(Group.group_id.in_(ids))
            .values(state="trained", trained_step=step, lease_until=None)
        )
        record_train_step(conn, run, step, metrics)


def group_states(engine: Engine, run: str) -> dict[str, str]:
    """group id -> state for a run (tests and diagnostics)."""
    with engine.connect() as conn:
        return dict(conn.execute(select(Group.group_id, Group.state).where(Group.run == run)).all())


def lease_expiry(engine: Engine, group_id: str) -> datetime | None:
    with engine.connect() as conn:
        return _aware(conn.execute(select(Group.lease_until).where(Group.group_id == group_id)).scalar_one_or_none())


@dataclass(frozen=True)
class LoadedVersion:
    step: int
    served_name: str
    adapter_path: str | None


def loaded_versions(engine: Engine, run: str) -> list[LoadedVersion]:
    """The run's published adapters vLLM should be serving, oldest first."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(PolicyVersion.step, PolicyVersion.served_name, PolicyVersion.adapter_path)
            .where(PolicyVersion.run == run, PolicyVersion.status == "loaded")
            .order_by(PolicyVersion.step)
        ).all()
    return [LoadedVersion(row.step, row.served_name, row.adapter_path) for row in rows]


def publish_version(engine: Engine, run: str, step: int, served_name: str, adapter_path: str) -> None:
    """Make `served_name` the run's current policy: gateways route the run's calls to it within a second."""
    with engine.begin() as conn:
        conn.execute(
            PolicyVersion.__table__.insert().values(
                run=run, step=step, served_name=served_name, adapter_path=adapter_path, status="loaded", created_at=_now()
            )
        )


def mark_unloaded(engine: Engine, run: str, step: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            update(PolicyVersion).where(PolicyVersion.run == run, PolicyVersion.step == step).values(status="unloaded")
        )


def annotate_step(engine: Engine, run: str, step: int, extra: dict[str, Any]) -> None:
    """Add to a committed step's metrics (e.g. why publishing it failed, how long the swap took) for the read API."""
    with write_transaction(engine) as conn:
        metrics = conn.execute(
            select(TrainStep.metrics).where(TrainStep.run == run, TrainStep.step == step).with_for_update()
        ).scalar_one()
        conn.execute(
            update(TrainStep)
            .where(TrainStep.run == run, TrainStep.step == step)
            .values(metrics={**(metrics or {}), **extra})
        )
