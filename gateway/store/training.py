"""What the trainer asks of the database: hold its run, claim ready groups under a lease, read them, commit a step.

One trainer per run: it holds the run's lease (trainer_leases), renews it while it lives, and a second trainer
waits until it is released or expires. A step is all-or-nothing: groups go `ready -> claimed` with a lease; the
trainer commits `claimed -> trained` together with the step's metrics in one transaction, and only if it still
holds the run and every group. A trainer that dies leaves claims whose leases expire, and those groups go back to
ready (or to open, if a trajectory joined them meanwhile and has no reward yet) for the next trainer.

The step trains exactly the trajectories it loaded, and marks them with its step number. A trajectory that joins a
group after the claim is kept and not trained by that step: when the step commits (or drops the group), the group
goes back to open, ready again once the newcomers are rewarded, and its next claim loads only trajectories no step
has trained. So nothing trains twice and nothing is lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import Connection, Engine, Table, case, delete, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite

from gateway.store import peers
from gateway.store.arrays import decode_ids, decode_logprobs
from gateway.store.db import READY_CHANNEL, write_transaction
from gateway.store.lineage import Rebuilder
from gateway.store.models import Admission, Call, Group, PolicyVersion, Run, TrainerLease, TrainStep, Trajectory
from gateway.store.rewards import lock_groups, settle_group
from gateway.store.runs import record_train_step

if TYPE_CHECKING:  # imported where it is used: only a Postgres trainer listens
    import psycopg
    from psycopg.rows import TupleRow

log = logging.getLogger("trajgate.store")


class LeaseLost(RuntimeError):
    """The trainer no longer holds its run or a group it trained on (its lease expired and another trainer took
    it)."""


@dataclass(frozen=True)
class RunLease:
    """Who trains a run, and until when unless they renew."""

    holder: str
    lease_until: datetime


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
        self._conn: psycopg.Connection[TupleRow] | None = None

    def _connect(self) -> psycopg.Connection[TupleRow]:
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
    return datetime.now(UTC)


def _aware(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; they were written as UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
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


def acquire_run_lease(engine: Engine, run: str, holder: str, lease_s: float) -> RunLease:
    """Take the run's trainer lease if nobody holds it, its holder stopped renewing it, or `holder` already has it;
    returns the lease as it stands afterwards (ours if its holder is `holder`)."""
    now = _now()
    insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
    with write_transaction(engine) as conn:
        # The insert waits on (Postgres) or is excluded by (SQLite) a concurrent one, so one trainer wins.
        conn.execute(
            insert(TrainerLease)
            .values(run=run, holder=holder, lease_until=now + timedelta(seconds=lease_s), acquired_at=now)
            .on_conflict_do_nothing(index_elements=["run"])
        )
        conn.execute(
            update(TrainerLease)
            .where(TrainerLease.run == run, or_(TrainerLease.holder == holder, TrainerLease.lease_until < now))
            .values(
                holder=holder,
                lease_until=now + timedelta(seconds=lease_s),
                acquired_at=case((TrainerLease.holder == holder, TrainerLease.acquired_at), else_=now),
            )
        )
        row = conn.execute(select(TrainerLease.holder, TrainerLease.lease_until).where(TrainerLease.run == run)).one()
    until = _aware(row.lease_until)
    assert until is not None
    return RunLease(row.holder, until)


def renew_run_lease(engine: Engine, run: str, holder: str, lease_s: float) -> bool:
    """Extend `holder`'s lease on the run; False if another trainer has taken it over."""
    with engine.begin() as conn:
        result = conn.execute(
            update(TrainerLease)
            .where(TrainerLease.run == run, TrainerLease.holder == holder)
            .values(lease_until=_now() + timedelta(seconds=lease_s))
        )
    return result.rowcount == 1


def release_run_lease(engine: Engine, run: str, holder: str) -> None:
    """Give the run up (a clean exit), so the next trainer needn't wait for the lease to expire."""
    with engine.begin() as conn:
        conn.execute(delete(TrainerLease).where(TrainerLease.run == run, TrainerLease.holder == holder))


def _hold_run(conn: Connection, run: str, holder: str) -> None:
    current = conn.execute(
        select(TrainerLease.holder).where(TrainerLease.run == run).with_for_update()
    ).scalar_one_or_none()
    if current != holder:
        raise LeaseLost(f"run {run!r} is no longer trained by {holder} but by {current or 'nobody'}")


def release_expired_claims(engine: Engine, run: str) -> int:
    """Give back the groups whose trainer stopped renewing their lease; how many.

    Readiness is decided again, as a reward would: a group a trajectory joined while it was claimed goes to open
    until that trajectory is rewarded, never straight back to the ready pool.
    """
    with write_transaction(engine) as conn:
        expired = list(
            conn.execute(
                select(Group.group_id)
                .where(Group.run == run, Group.state == "claimed", Group.lease_until < _now())
                .order_by(Group.group_id)
                .with_for_update()
            ).scalars()
        )
        if expired:
            _reopen(conn, expired)
    return len(expired)


def _reopen(conn: Connection, group_ids: list[str]) -> None:
    """Put locked groups back to open, then to ready if they are complete and every trajectory is rewarded; one
    that is ready again keeps its place in the queue (its ready_at)."""
    groups = lock_groups(conn, group_ids)
    conn.execute(
        update(Group).where(Group.group_id.in_(list(groups))).values(state="open", claimed_by=None, lease_until=None)
    )
    still_open = [gid for gid, group in groups.items() if settle_group(conn, {**group, "state": "open"}) == "open"]
    if still_open:
        conn.execute(update(Group).where(Group.group_id.in_(still_open)).values(ready_at=None))


def count_ready_groups(engine: Engine, run: str) -> int:
    with engine.connect() as conn:
        return conn.execute(
            select(func.count()).select_from(Group).where(Group.run == run, Group.state == "ready", Group.mode == "train")
        ).scalar_one()


def claim_ready_groups(engine: Engine, run: str, worker: str, limit: int, lease_s: float) -> list[str]:
    """Atomically take up to `limit` ready training groups: those admitted on the oldest policy version first
    (gateway admission: they go stale soonest), then in the order they became ready.

    On Postgres, SKIP LOCKED lets two trainers claim at once without waiting on or sharing a group; on SQLite the
    write transaction holds the database's single write lock, which gives the same guarantee.
    """
    admitted_on = select(Admission.policy_version).where(Admission.group_id == Group.group_id).scalar_subquery()
    with write_transaction(engine) as conn:
        ids = list(
            conn.execute(
                select(Group.group_id)
                .where(Group.run == run, Group.state == "ready", Group.mode == "train")
                .order_by(admitted_on.nulls_first(), Group.ready_at, Group.group_id)
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


def _trainable_trajectories(ids: list[str]) -> Any:
    """The trajectories a claim of these groups trains: rewarded, and not trained by an earlier step."""
    return (
        select(Trajectory.trajectory_id)
        .where(Trajectory.group_id.in_(ids), Trajectory.reward.is_not(None), Trajectory.trained_step.is_(None))
        .scalar_subquery()
    )


def load_groups(engine: Engine, group_ids: Sequence[str]) -> list[dict[str, Any]]:
    """The claimed groups with their rewarded, not yet trained trajectories and every call, in order, arrays
    decoded. A trajectory that joined a claimed group and has no reward yet is never returned (it waits for the
    group's next claim); the step must pass the ids it trained to `commit_step`/`drop_groups`.

    Plain dicts whose call fields match the trainer's CallData, so the store stays free of trainer imports.
    """
    ids = list(group_ids)
    with engine.connect() as conn:
        trajectories = conn.execute(
            select(Trajectory.trajectory_id, Trajectory.group_id, Trajectory.reward)
            .where(Trajectory.trajectory_id.in_(_trainable_trajectories(ids)))
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
                Call.merge_reason,
                Call.parent_seq,
                Call.prefix_len,
            )
            .where(Call.trajectory_id.in_(_trainable_trajectories(ids)))
            .order_by(Call.trajectory_id, Call.seq, Call.choice_index)
        ).all()
    by_trajectory: dict[str, list[dict[str, Any]]] = {}
    rebuilders: dict[str, Rebuilder] = {}
    for row in calls:
        completion_ids = decode_ids(row.completion_token_ids)
        prompt_ids = rebuilders.setdefault(row.trajectory_id, Rebuilder()).prompt(
            row.seq, row.choice_index, decode_ids(row.prompt_token_ids), completion_ids, row.parent_seq, row.prefix_len
        )
        by_trajectory.setdefault(row.trajectory_id, []).append(
            {
                "seq": row.seq,
                "choice_index": row.choice_index,
                "policy_version": row.policy_version,
                "prompt_token_ids": prompt_ids,
                "completion_token_ids": completion_ids,
                "completion_logprobs": decode_logprobs(row.completion_logprobs),
                "trainable": row.trainable,
                "untrainable_reason": row.untrainable_reason,
                "merge_reason": row.merge_reason,
            }
        )
    groups: dict[str, dict[str, Any]] = {gid: {"group_id": gid, "trajectories": []} for gid in ids}
    for trajectory in trajectories:
        groups[trajectory.group_id]["trajectories"].append(
            {
                "trajectory_id": trajectory.trajectory_id,
                "reward": trajectory.reward,
                "calls": by_trajectory.get(trajectory.trajectory_id, []),
            }
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


def _reopen_joined(conn: Connection, group_ids: list[str], seen: Sequence[str]) -> None:
    """Groups that a trajectory joined after the step loaded them go back to open (ready once it is rewarded)."""
    joined = list(
        conn.execute(
            select(Trajectory.group_id)
            .where(
                Trajectory.group_id.in_(group_ids),
                Trajectory.trained_step.is_(None),
                Trajectory.trajectory_id.not_in(list(seen)),
            )
            .distinct()
        ).scalars()
    )
    if joined:
        _reopen(conn, sorted(joined))


def drop_groups(
    engine: Engine, drops: Sequence[tuple[str, str]], worker: str, *, trajectory_ids: Sequence[str]
) -> None:
    """Mark claimed groups as dropped (stale, zero variance, nothing trainable) with the reason.

    `trajectory_ids` are those the step loaded: a group a trajectory joined since goes back to open instead, and is
    judged again, newcomers included, once they are rewarded.
    """
    if not drops:
        return
    ids = [gid for gid, _ in drops]
    with write_transaction(engine) as conn:
        _held(conn, ids, worker)
        for group_id, reason in drops:
            conn.execute(
                update(Group)
                .where(Group.group_id == group_id)
                .values(state="dropped", drop_reason=reason, lease_until=None)
            )
        _reopen_joined(conn, ids, trajectory_ids)


def commit_step(
    engine: Engine,
    run: str,
    step: int,
    worker: str,
    group_ids: Sequence[str],
    metrics: dict[str, Any],
    *,
    trajectory_ids: Sequence[str],
    lease_holder: str,
) -> None:
    """Record step `step` as done: its groups and the trajectories it trained (`trajectory_ids`, as loaded) marked
    trained, and its metrics, in one transaction or not at all. A group a trajectory joined since the load goes
    back to open for it.

    Raises LeaseLost (and changes nothing) if `lease_holder` no longer holds the run or another trainer took any
    of the groups meanwhile.
    """
    ids = list(group_ids)
    trained = list(trajectory_ids)
    with write_transaction(engine) as conn:
        _hold_run(conn, run, lease_holder)
        _held(conn, ids, worker)
        conn.execute(
            update(Group)
            .where(Group.group_id.in_(ids))
            .values(state="trained", trained_step=step, lease_until=None)
        )
        if trained:
            conn.execute(
                update(Trajectory).where(Trajectory.trajectory_id.in_(trained)).values(trained_step=step)
            )
        _reopen_joined(conn, ids, trained)
        record_train_step(conn, run, step, metrics)


def run_lease(engine: Engine, run: str) -> RunLease | None:
    """Who holds the run's trainer lease (diagnostics and tests)."""
    with engine.connect() as conn:
        row = conn.execute(select(TrainerLease.holder, TrainerLease.lease_until).where(TrainerLease.run == run)).first()
    if row is None:
        return None
    until = _aware(row.lease_until)
    assert until is not None
    return RunLease(row.holder, until)


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
    """Make `served_name` the run's current policy (its claim becomes `loaded`): gateways route the run's calls to it
    within a second."""
    values: dict[str, Any] = {"served_name": served_name, "adapter_path": adapter_path, "status": "loaded"}
    with engine.begin() as conn:
        changed = conn.execute(
            update(PolicyVersion)
            .where(PolicyVersion.run == run, PolicyVersion.step == step, PolicyVersion.status.in_(("loading", "loaded")))
            .values(**values)
        ).rowcount
        if not changed:
            conn.execute(
                cast(Table, PolicyVersion.__table__).insert().values(run=run, step=step, created_at=_now(), **values)
            )


def mark_unloaded(engine: Engine, run: str, step: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            update(PolicyVersion).where(PolicyVersion.run == run, PolicyVersion.step == step).values(status="unloaded")
        )


@dataclass(frozen=True)
class RetiredVersion:
    run: str
    step: int
    served_name: str
    retired_at: float  # the database's clock once the retirement committed


def retire_version(engine: Engine, run: str, step: int) -> None:
    """Stop routing to a loaded version (gateways drop it at their next route reload) without unloading it yet.
    `retired_at` is read after the status change committed, so a gateway that read its routes later than that (its
    heartbeat's `routes_read_at`) certainly read them without the version."""
    with engine.begin() as conn:
        changed = conn.execute(
            update(PolicyVersion)
            .where(PolicyVersion.run == run, PolicyVersion.step == step, PolicyVersion.status == "loaded")
            .values(status="retiring")
        ).rowcount
    if changed:
        with engine.begin() as conn:
            conn.execute(
                update(PolicyVersion)
                .where(PolicyVersion.run == run, PolicyVersion.step == step)
                .values(retired_at=peers.clock(conn))
            )


def unloadable_versions(engine: Engine, run: str | None, alive_s: float) -> list[RetiredVersion]:
    """The run's (None: every run's) retiring versions that no gateway can route to any more: every gateway seen in
    the last `alive_s` seconds has read its route table since the version was retired (gateway/store/peers.py
    `routes_behind`)."""
    query = select(PolicyVersion.run, PolicyVersion.step, PolicyVersion.served_name, PolicyVersion.retired_at).where(
        PolicyVersion.status == "retiring"
    )
    if run is not None:
        query = query.where(PolicyVersion.run == run)
    with engine.connect() as conn:
        rows = conn.execute(query.order_by(PolicyVersion.run, PolicyVersion.step)).all()
        retired = [RetiredVersion(row.run, row.step, row.served_name, row.retired_at or 0.0) for row in rows]
        return [version for version in retired if not peers.routes_behind(conn, version.retired_at, alive_s)]


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
