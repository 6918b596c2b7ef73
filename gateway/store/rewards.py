"""Rewards and group readiness: the statements that decide when a group can be trained.

A group is *ready* when every trajectory in it has a reward and either it has its expected number of trajectories
or it was closed. That is decided inside the transaction that stores the reward (or closes the group), after
locking the group row, so concurrent rewards for one group, from any number of gateway processes, serialise on
that row and exactly one of them flips the group from open to ready. Lock order is always groups (sorted by id),
then trajectories, the same order the record writer takes them in, so the two cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, func, select, update

from gateway.store.db import notify_ready, write_transaction
from gateway.store.models import Group, Trajectory, utcnow

# Once the trainer has taken a group, its rewards are what it trained (or decided not to train) on.
FROZEN_STATES = frozenset({"claimed", "trained", "dropped"})


@dataclass(frozen=True, slots=True)
class RewardItem:
    trajectory_id: str
    reward: float
    metrics: dict[str, float] | None = None
    metadata: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class RewardResult:
    trajectory_id: str
    group_id: str
    reward: float
    group_state: str


@dataclass(frozen=True, slots=True)
class ItemError:
    index: int
    trajectory_id: str
    reason: str  # "not_found" | "conflict"
    message: str


class RewardsRejected(Exception):
    """Some items cannot be stored; nothing was (a batch is all or nothing)."""

    def __init__(self, errors: list[ItemError]) -> None:
        super().__init__("; ".join(error.message for error in errors))
        self.errors = errors


def store_rewards(
    engine: Engine, items: Sequence[RewardItem], runs: frozenset[str] | None = None
) -> list[RewardResult]:
    """Store the rewards in one transaction and settle the readiness of every group they touch.

    The same reward again changes nothing (idempotent retries). A different reward is stored while the group is
    open or ready, and refused (conflict) once the trainer claimed it. Unknown trajectories are refused too, and so,
    with the same message, is a trajectory of a run outside `runs` (the runs the caller's key is bound to; None:
    any), so a tenant cannot tell another's trajectory from none. Raises RewardsRejected listing every refused
    item, having stored nothing.
    """
    ids = sorted({item.trajectory_id for item in items})
    with write_transaction(engine) as conn:
        group_of: dict[str, str] = {
            row.trajectory_id: row.group_id
            for row in conn.execute(
                select(Trajectory.trajectory_id, Trajectory.group_id, Trajectory.run).where(
                    Trajectory.trajectory_id.in_(ids)
                )
            )
            if runs is None or row.run in runs
        }
        groups = lock_groups(conn, sorted(set(group_of.values())))
        # Read after the lock: a reward for the same group committed before we got it is now visible.
        stored = {
            row.trajectory_id: row
            for row in conn.execute(
                select(
                    Trajectory.trajectory_id, Trajectory.reward, Trajectory.metrics, Trajectory.meta.label("meta")
                ).where(Trajectory.trajectory_id.in_(list(group_of)))
            )
        }
        errors: list[ItemError] = []
        changes: list[RewardItem] = []
        for index, item in enumerate(items):
            if item.trajectory_id not in group_of:
                errors.append(ItemError(index, item.trajectory_id, "not_found", _unknown(item.trajectory_id)))
                continue
            current = stored[item.trajectory_id]
            if current.reward == item.reward and item.metrics in (None, current.metrics) and (
                item.metadata in (None, current.meta)
            ):
                continue
            state = groups[group_of[item.trajectory_id]]["state"]
            if state in FROZEN_STATES:
                if current.reward is not None and current.reward != item.reward:
                    message = (
                        f"trajectory {item.trajectory_id!r} already has reward {current.reward!r} and its group "
                        f"{group_of[item.trajectory_id]!r} is {state}: the reward can no longer change"
                    )
                    errors.append(ItemError(index, item.trajectory_id, "conflict", message))
                elif current.reward is None:
                    changes.append(item)  # a first reward for a late trajectory: harmless, it was not trained
                continue
            changes.append(item)
        if errors:
            raise RewardsRejected(errors)
        now = utcnow()
        for item in changes:
            values: dict[str, Any] = {"reward": item.reward, "rewarded_at": now}
            if item.metrics is not None:
                values["metrics"] = item.metrics
            if item.metadata is not None:
                values["meta"] = item.metadata
            conn.execute(update(Trajectory).where(Trajectory.trajectory_id == item.trajectory_id).values(values))
        states = {group_id: settle_group(conn, group) for group_id, group in groups.items()}
    results = []
    for item in items:
        group_id = group_of[item.trajectory_id]
        results.append(RewardResult(item.trajectory_id, group_id, item.reward, states[group_id]))
    return results


def close_group(engine: Engine, group_id: str, runs: frozenset[str] | None = None) -> str | None:
    """Declare the group complete: it is ready once every trajectory it has is rewarded, whatever its expected
    size. Returns the group's state afterwards, or None if no call of the group has been written, or if it is a
    group of a run outside `runs` (as `store_rewards`)."""
    with write_transaction(engine) as conn:
        group = lock_groups(conn, [group_id]).get(group_id)
        if group is None or (runs is not None and group["run"] not in runs):
            return None
        if not group["closed"]:
            conn.execute(update(Group).where(Group.group_id == group_id).values(closed=True))
            group["closed"] = True
        return settle_group(conn, group)


def _unknown(trajectory_id: str) -> str:
    return (
        f"no trajectory {trajectory_id!r}: no call with this trajectory id has been recorded "
        "(check the id, or retry if its calls went through another gateway process)"
    )


def lock_groups(conn: Connection, group_ids: list[str]) -> dict[str, dict[str, Any]]:
    """SELECT ... FOR UPDATE in id order on Postgres (call it in a `write_transaction`); on SQLite the IMMEDIATE
    transaction already excludes other writers."""
    if not group_ids:
        return {}
    rows = conn.execute(
        select(Group.group_id, Group.run, Group.state, Group.closed, Group.expected_size)
        .where(Group.group_id.in_(group_ids))
        .order_by(Group.group_id)
        .with_for_update()
    )
    return {row.group_id: dict(row._mapping) for row in rows}


def settle_group(conn: Connection, group: dict[str, Any]) -> str:
    """Flip a locked open group to ready if it now qualifies; returns its state. `group` needs group_id, run,
    state, closed and expected_size (the columns `lock_groups` reads)."""
    if group["state"] != "open":
        return str(group["state"])
    total, rewarded = conn.execute(
        select(func.count(), func.count(Trajectory.reward)).where(Trajectory.group_id == group["group_id"])
    ).one()
    expected = group["expected_size"]
    complete = group["closed"] or (expected is not None and total >= expected)
    if not (complete and total and rewarded == total):
        return "open"
    conn.execute(
        update(Group)
        .where(Group.group_id == group["group_id"], Group.state == "open")
        # A group given back by a trainer keeps the place in the queue it had (see gateway.store.training).
        .values(state="ready", ready_at=func.coalesce(Group.ready_at, utcnow()))
    )
    notify_ready(conn, group["run"])
    return "ready"
