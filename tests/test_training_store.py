"""Claiming ready groups: atomic, leased, never shared between trainers; a step commits whole or not at all."""

from __future__ import annotations

import threading
import time

import pytest

from gateway.store import db
from gateway.store.records import write_calls
from gateway.store.rewards import RewardItem, store_rewards
from gateway.store.runs import steps_after
from gateway.store.training import (
    LeaseLost,
    ReadyListener,
    claim_ready_groups,
    commit_step,
    count_ready_groups,
    drop_groups,
    group_states,
    last_step,
    load_groups,
    release_expired_claims,
    renew_leases,
)
from tests.factories import make_record


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
        commit_step(engine, "run-a", 1, "w1", claimed, {"loss": 0.5, "nan": float("nan")})
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
            commit_step(engine, "run-a", 1, "crashed", [group], {})
        assert last_step(engine, "run-a") == 0  # nothing of the refused step was written
        drop_groups(engine, [(group, "zero reward variance")], "w2")
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
