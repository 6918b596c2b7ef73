"""Claiming ready groups: atomic, leased, never shared between trainers; a step commits whole or not at all."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import pytest

from gateway.store import db
from gateway.store.records import write_calls
from gateway.store.rewards import RewardItem, store_rewards
from gateway.store.runs import steps_after
from gateway.store.training import (
    LeaseLost,
    ReadyListener,
    acquire_run_lease,
    claim_ready_groups,
    commit_step,
    count_ready_groups,
    drop_groups,
    group_states,
    last_step,
    load_groups,
    release_expired_claims,
    release_run_lease,
    renew_leases,
    renew_run_lease,
)
from tests.support.factories import make_record


def make_ready_groups(url: str, groups: int, size: int = 2, run: str = "run-a", mode: str = "train") -> list[str]:
    """Groups of `size` trajectories, one call each, all rewarded (so ready)."""
    db.upgrade(url)
    engine = db.make_engine(url)
    ids = [f"{run}-g{g}" for g in range(groups)]
    try:
        records = [
            make_record(f"{gid}-t{t}", seq=1, seed=g * 100 + t, run=run, group_id=gid, group_size=size, mode=mode)
            for g, gid in enumerate(ids)
            for t in range(size)
        ]
        write_calls(engine, records)
        store_rewards(engine, [RewardItem(r.trajectory_id, float(i % 2)) for i, r in enumerate(records)])
    finally:
        engine.dispose()
    return ids


def test_claim_load_commit(db_url: str) -> None:
    ids = make_ready_groups(db_url, groups=3)
    engine = db.make_engine(db_url)
    try:
        assert count_ready_groups(engine, "run-a") == 3
        claimed = claim_ready_groups(engine, "run-a", "w1", limit=2, lease_s=60)
        assert len(claimed) == 2 and count_ready_groups(engine, "run-a") == 1
        loaded = load_groups(engine, claimed)
        assert [g["group_id"] for g in loaded] == claimed
        assert all(len(g["trajectories"]) == 2 for g in loaded)
        call = loaded[0]["trajectories"][0]["calls"][0]
        assert len(call["completion_token_ids"]) == len(call["completion_logprobs"]) == 4
        acquire_run_lease(engine, "run-a", "w1", 60)
        seen = [t["trajectory_id"] for g in loaded for t in g["trajectories"]]
        commit_step(
            engine, "run-a", 1, "w1", claimed, {"loss": 0.5, "nan": float("nan")}, trajectory_ids=seen, lease_holder="w1"
        )
        states = group_states(engine, "run-a")
        assert sorted(s for g, s in states.items() if g in claimed) == ["trained", "trained"]
        assert last_step(engine, "run-a") == 1
        assert steps_after(engine, "run-a")[0]["metrics"] == {"loss": 0.5, "nan": None}
        assert set(ids) - set(claimed) == {g for g, s in states.items() if s == "ready"}
    finally:
        engine.dispose()


def test_eval_groups_are_never_claimed(db_url: str) -> None:
    make_ready_groups(db_url, groups=2, mode="eval")
    engine = db.make_engine(db_url)
    try:
        assert claim_ready_groups(engine, "run-a", "w1", limit=5, lease_s=60) == []
    finally:
        engine.dispose()


def test_expired_lease_is_reclaimed_and_the_late_commit_refused(db_url: str) -> None:
    make_ready_groups(db_url, groups=1)
    engine = db.make_engine(db_url)
    try:
        (group,) = claim_ready_groups(engine, "run-a", "crashed", limit=4, lease_s=0.2)
        assert claim_ready_groups(engine, "run-a", "w2", limit=4, lease_s=60) == []
        time.sleep(0.3)
        assert renew_leases(engine, [group], "w2", 60) == 0  # w2 never held it
        assert release_expired_claims(engine, "run-a") == 1
        assert claim_ready_groups(engine, "run-a", "w2", limit=4, lease_s=60) == [group]
        with pytest.raises(LeaseLost):
            commit_step(engine, "run-a", 1, "crashed", [group], {}, trajectory_ids=[], lease_holder="crashed")
        assert last_step(engine, "run-a") == 0  # nothing of the refused step was written
        seen = [t["trajectory_id"] for t in load_groups(engine, [group])[0]["trajectories"]]
        drop_groups(engine, [(group, "zero reward variance")], "w2", trajectory_ids=seen)
        assert group_states(engine, "run-a")[group] == "dropped"
    finally:
        engine.dispose()


def test_two_trainers_never_share_a_group(pg_url: str) -> None:
    ids = make_ready_groups(pg_url, groups=40, size=1)
    claimed: dict[str, list[str]] = {"a": [], "b": []}
    start = threading.Barrier(2)

    def trainer(name: str) -> None:
        engine = db.make_engine(pg_url)
        try:
            start.wait()
            while True:
                got = claim_ready_groups(engine, "run-a", name, limit=3, lease_s=60)
                if not got:
                    return
                claimed[name].extend(got)
                time.sleep(0.005)  # a training step happens here; let the other trainer in
        finally:
            engine.dispose()

    threads = [threading.Thread(target=trainer, args=(name,)) for name in claimed]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not set(claimed["a"]) & set(claimed["b"])
    assert sorted(claimed["a"] + claimed["b"]) == sorted(ids)
    assert claimed["a"] and claimed["b"]  # both really competed


def test_trainer_is_woken_by_notify_when_a_group_becomes_ready(pg_url: str) -> None:
    """On Postgres the reward that makes a group ready wakes a waiting trainer before its poll interval ends."""
    db.upgrade(pg_url)
    engine = db.make_engine(pg_url)
    records = [make_record(f"n-t{t}", seq=1, seed=t, group_id="n-g", group_size=2) for t in range(2)]
    write_calls(engine, records)
    listener = ReadyListener(engine, "run-a")
    stop = threading.Event()
    try:
        assert listener.wait(0.05, stop) is False  # nothing yet (and the LISTEN is now in place)
        timer = threading.Timer(0.3, lambda: store_rewards(engine, [RewardItem(r.trajectory_id, 1.0) for r in records]))
        timer.start()
        started = time.monotonic()
        assert listener.wait(10, stop) is True
        assert time.monotonic() - started < 5
        timer.join()
    finally:
        listener.close()
        engine.dispose()


def late_trajectory(engine: object, group: str, trajectory: str, run: str = "run-a") -> None:
    """A new trajectory's first call joins `group` (e.g. an agent's straggler after the group became ready)."""
    write_calls(engine, [make_record(trajectory, seq=1, seed=99, run=run, group_id=group, group_size=2)])


def test_expired_claim_is_ready_again_only_if_still_complete(db_url: str) -> None:
    """The crash loop: a trajectory joined a claimed group, the trainer died; releasing its lease must not put an
    unrewarded trajectory back in the ready pool."""
    ready, joined = make_ready_groups(db_url, groups=2)
    engine = db.make_engine(db_url)
    try:
        assert sorted(claim_ready_groups(engine, "run-a", "dead", limit=2, lease_s=-1)) == [ready, joined]
        late_trajectory(engine, joined, "late")
        assert release_expired_claims(engine, "run-a") == 2
        assert group_states(engine, "run-a") == {ready: "ready", joined: "open"}
        store_rewards(engine, [RewardItem("late", 0.5)])
        assert group_states(engine, "run-a")[joined] == "ready"
    finally:
        engine.dispose()


def test_load_groups_never_returns_unrewarded_trajectories(db_url: str) -> None:
    (group,) = make_ready_groups(db_url, groups=1)
    engine = db.make_engine(db_url)
    try:
        claim_ready_groups(engine, "run-a", "w1", limit=1, lease_s=60)
        late_trajectory(engine, group, "late")
        (loaded,) = load_groups(engine, [group])
        assert "late" not in [t["trajectory_id"] for t in loaded["trajectories"]]
        assert all(t["reward"] is not None for t in loaded["trajectories"])
    finally:
        engine.dispose()


def trained_steps(engine: object, group: str) -> dict[str, int | None]:
    from sqlalchemy import select

    from gateway.store.models import Trajectory

    with engine.connect() as conn:  # type: ignore[attr-defined]
        rows = conn.execute(select(Trajectory.trajectory_id, Trajectory.trained_step).where(Trajectory.group_id == group))
        return dict(rows.all())


def test_late_trajectory_in_a_claimed_group_is_trained_later_never_twice(db_url: str) -> None:
    """The rule (docs/api.md "Groups and readiness"): a step trains what it loaded; a trajectory that joined meanwhile
    is kept, the group goes back to open when the step commits, and its next claim trains only the newcomers."""
    (group,) = make_ready_groups(db_url, groups=1)
    engine = db.make_engine(db_url)
    try:
        acquire_run_lease(engine, "run-a", "w1", 60)
        claim_ready_groups(engine, "run-a", "w1", limit=1, lease_s=60)
        (loaded,) = load_groups(engine, [group])
        first = [t["trajectory_id"] for t in loaded["trajectories"]]
        late_trajectory(engine, group, "late")
        store_rewards(engine, [RewardItem("late", 1.0)])  # rewarded after the step loaded its data
        commit_step(engine, "run-a", 1, "w1", [group], {}, trajectory_ids=first, lease_holder="w1")
        assert group_states(engine, "run-a")[group] == "ready"  # the newcomer is complete and rewarded
        assert trained_steps(engine, group) == {**dict.fromkeys(first, 1), "late": None}

        assert claim_ready_groups(engine, "run-a", "w1", limit=1, lease_s=60) == [group]
        (again,) = load_groups(engine, [group])
        assert [t["trajectory_id"] for t in again["trajectories"]] == ["late"]
        commit_step(engine, "run-a", 2, "w1", [group], {}, trajectory_ids=["late"], lease_holder="w1")
        assert group_states(engine, "run-a")[group] == "trained"
        assert trained_steps(engine, group) == {**dict.fromkeys(first, 1), "late": 2}
    finally:
        engine.dispose()


def test_late_trajectory_in_a_dropped_group_reopens_it(db_url: str) -> None:
    (group,) = make_ready_groups(db_url, groups=1)
    engine = db.make_engine(db_url)
    try:
        claim_ready_groups(engine, "run-a", "w1", limit=1, lease_s=60)
        (loaded,) = load_groups(engine, [group])
        late_trajectory(engine, group, "late")
        seen = [t["trajectory_id"] for t in loaded["trajectories"]]
        drop_groups(engine, [(group, "zero reward variance")], "w1", trajectory_ids=seen)
        assert group_states(engine, "run-a")[group] == "open"  # waits for the newcomer's reward, then retries
        store_rewards(engine, [RewardItem("late", 0.25)])
        assert group_states(engine, "run-a")[group] == "ready"
    finally:
        engine.dispose()


def test_trajectory_joining_a_trained_group_reopens_it(db_url: str) -> None:
    (group,) = make_ready_groups(db_url, groups=1)
    engine = db.make_engine(db_url)
    try:
        acquire_run_lease(engine, "run-a", "w1", 60)
        claim_ready_groups(engine, "run-a", "w1", limit=1, lease_s=60)
        (loaded,) = load_groups(engine, [group])
        commit_step(
            engine, "run-a", 1, "w1", [group], {}, trajectory_ids=[t["trajectory_id"] for t in loaded["trajectories"]],
            lease_holder="w1",
        )
        late_trajectory(engine, group, "late")
        assert group_states(engine, "run-a")[group] == "open"
        store_rewards(engine, [RewardItem("late", 1.0)])
        claim_ready_groups(engine, "run-a", "w1", limit=1, lease_s=60)
        assert [t["trajectory_id"] for t in load_groups(engine, [group])[0]["trajectories"]] == ["late"]
    finally:
        engine.dispose()


def test_run_lease_one_trainer_at_a_time(db_url: str) -> None:
    make_ready_groups(db_url, groups=1)
    engine = db.make_engine(db_url)
    try:
        assert acquire_run_lease(engine, "run-a", "first", 60).holder == "first"
        taken = acquire_run_lease(engine, "run-a", "second", 60)
        assert taken.holder == "first" and taken.lease_until > datetime.now(UTC)
        assert renew_run_lease(engine, "run-a", "second", 60) is False
        assert renew_run_lease(engine, "run-a", "first", 60) is True
        (group,) = claim_ready_groups(engine, "run-a", "second", limit=1, lease_s=60)
        with pytest.raises(LeaseLost, match="first"):  # the groups are its own, the run is not
            commit_step(engine, "run-a", 1, "second", [group], {}, trajectory_ids=[], lease_holder="second")
        assert last_step(engine, "run-a") == 0
        release_run_lease(engine, "run-a", "first")
        assert acquire_run_lease(engine, "run-a", "second", 60).holder == "second"
        commit_step(engine, "run-a", 1, "second", [group], {}, trajectory_ids=[], lease_holder="second")
        assert last_step(engine, "run-a") == 1
    finally:
        engine.dispose()


def test_expired_run_lease_is_taken_over_and_the_old_holder_cannot_commit(db_url: str) -> None:
    make_ready_groups(db_url, groups=1)
    engine = db.make_engine(db_url)
    try:
        assert acquire_run_lease(engine, "run-a", "dead", -1).holder == "dead"  # stopped renewing: expired
        (group,) = claim_ready_groups(engine, "run-a", "dead", limit=1, lease_s=60)
        assert acquire_run_lease(engine, "run-a", "next", 60).holder == "next"
        assert renew_run_lease(engine, "run-a", "dead", 60) is False
        with pytest.raises(LeaseLost, match="next"):
            commit_step(engine, "run-a", 1, "dead", [group], {}, trajectory_ids=[], lease_holder="dead")
        assert last_step(engine, "run-a") == 0
    finally:
        engine.dispose()
