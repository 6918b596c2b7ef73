"""The trainer worker end to end on a tiny random model: claim -> samples -> step -> checkpoint -> commit."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gateway.runs.settings import load_settings
from gateway.store import db
from gateway.store.records import write_calls
from gateway.store.rewards import RewardItem, store_rewards
from gateway.store.runs import steps_after, upsert_run
from gateway.store.training import (
    ReadyListener,
    acquire_run_lease,
    claim_ready_groups,
    group_states,
    loaded_versions,
)
from tests.support.factories import make_record
from tests.support.tiny_models import build_tiny_llama
from tests.support.trainer_runs import adapter, made, make_trainer, seed_groups
from trainer.worker import loop
from trainer.worker.loop import Trainer, TrainerOptions
from trainer.worker.publish import Publisher, PublishError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny")))


def prepare(url: str, tiny: str) -> str:
    """A migrated database with four ready groups and a run that trains two groups per step."""
    db.upgrade(url)
    seed_groups(url, tiny, groups=4)
    engine = db.make_engine(url)
    try:
        upsert_run(engine, "loop", {"groups_per_step": 2, "learning_rate": 1e-2, "loss": "grpo"})
    finally:
        engine.dispose()
    return url


@pytest.fixture
def seeded(db_url: str, tiny: str) -> Iterator[str]:
    yield prepare(db_url, tiny)
    while made:  # every trainer the test made gives its run up, as `trajgate train` does on exit
        made.pop().close()


def test_two_steps_commit_groups_and_metrics(seeded: str, tmp_path: Path, tiny: str) -> None:
    trainer = make_trainer(seeded, tmp_path, tiny, max_steps=2)
    assert trainer.run() == 2
    engine = db.make_engine(seeded)
    try:
        steps = steps_after(engine, "loop")
        states = group_states(engine, "loop")
    finally:
        engine.dispose()
    assert [s["step"] for s in steps] == [1, 2]
    first = steps[0]["metrics"]
    assert abs(first["ratio_mean"] - 1) < 1e-4 and first["clip_frac"] == 0  # fresh data is on-policy
    assert first["groups_used"] == 2 and first["trainable_tokens"] == 2 * 4 * 5
    assert sorted(states.values()) == ["trained"] * 4
    assert sorted(p.name for p in (tmp_path / "ckpt" / "loop").iterdir()) == ["00001", "00002"]


def test_crash_between_checkpoint_and_commit_leaves_nothing(
    seeded: str, tmp_path: Path, tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    crashing = make_trainer(seeded, tmp_path, tiny, lease_s=0.5, run_lease_s=0.5)

    def die(*_: object, **__: object) -> None:
        raise SystemExit("killed after the checkpoint, before the commit")

    monkeypatch.setattr(loop, "commit_step", die)
    with pytest.raises(SystemExit):
        crashing.train_one_step()
    crashing.lease.stop(release=False)  # a dead process renews nothing: its run lease runs out like its claims
    assert (tmp_path / "ckpt" / "loop" / "00001").exists()  # the orphan a crash leaves
    monkeypatch.undo()
    time.sleep(0.6)  # the dead trainer's lease runs out, so its groups are first in line again

    restarted = make_trainer(seeded, tmp_path, tiny, max_steps=2)
    assert restarted.step == 0 and not (tmp_path / "ckpt" / "loop" / "00001").exists()
    assert restarted.run() == 2  # the crashed step's groups came back once their lease expired
    restarted.close()
    engine = db.make_engine(seeded)
    try:
        assert [s["step"] for s in steps_after(engine, "loop")] == [1, 2]
        assert sorted(group_states(engine, "loop").values()) == ["trained"] * 4
    finally:
        engine.dispose()

    assert make_trainer(seeded, tmp_path, tiny).step == 2  # a restart now resumes at the committed step

    # The same data without a crash gives the same adapter: the crashed step left no trace.
    reference = prepare(f"sqlite:///{tmp_path / 'reference.db'}", tiny)
    assert make_trainer(reference, tmp_path / "ref", tiny, max_steps=2).run() == 2
    crashed, clean = adapter(tmp_path / "ckpt" / "loop" / "00002"), adapter(tmp_path / "ref" / "ckpt" / "loop" / "00002")
    assert crashed.keys() == clean.keys() and all(torch.equal(crashed[k], clean[k]) for k in clean)


def test_missing_run_and_weights_are_clear_errors(db_url: str, tmp_path: Path, tiny: str) -> None:
    db.upgrade(db_url)
    with pytest.raises(loop.TrainerError, match="does not exist yet"):
        make_trainer(db_url, tmp_path, tiny)
    engine = db.make_engine(db_url)
    try:
        upsert_run(engine, "loop", {}, base_model="base")
    finally:
        engine.dispose()
    settings = load_settings(_env_file=None, database_url=db_url, checkpoint_dir=tmp_path / "ckpt")
    with pytest.raises(loop.TrainerError, match="no weights to train"):
        Trainer(settings, TrainerOptions(run="loop", backend="hf", publish=False), echo=lambda line: None)


class FlakyVllm:
    """Stands in for VllmAdmin (the HTTP side is exercised against real vLLM in tests/e2e): loads fail while
    `failures` lasts, as when vLLM is restarting."""

    base_url = "http://vllm:8000/v1"

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.served: set[str] = set()

    def load(self, name: str, path: Path | str) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise PublishError("vLLM unreachable at http://vllm:8000/v1: connection refused")
        self.served.add(name)

    def unload(self, name: str) -> None:
        self.served.discard(name)

    def models(self) -> set[str]:
        return set(self.served)

    def check_answers(self, name: str) -> float:
        return 0.01

    def replicas(self) -> list[FlakyVllm]:
        return [self]


def flaky_trainer(url: str, tmp_path: Path, tiny: str, failures: int) -> tuple[Trainer, FlakyVllm]:
    trainer = make_trainer(url, tmp_path, tiny, max_steps=1)
    vllm = FlakyVllm(failures)
    trainer.publisher = Publisher(
        trainer.engine, vllm, "loop", lambda step: tmp_path / "ckpt" / "loop" / f"{step:05d}", echo=lambda line: None
    )  # type: ignore[arg-type]
    return trainer, vllm


def step_metrics(url: str) -> list[dict]:
    engine = db.make_engine(url)
    try:
        return [s["metrics"] for s in steps_after(engine, "loop")]
    finally:
        engine.dispose()


def test_failed_publication_of_the_last_step_is_retried_before_exit(seeded: str, tmp_path: Path, tiny: str) -> None:
    trainer, vllm = flaky_trainer(seeded, tmp_path, tiny, failures=2)
    assert trainer.run() == 1
    assert "vLLM unreachable" in step_metrics(seeded)[0]["publish_error"]  # the failure is visible on the step
    assert trainer.publisher is not None and trainer.publisher.pending() == 1
    assert trainer.finish_publishing(threading.Event(), timeout_s=30)  # retried with backoff: 1 s, then 2 s
    assert vllm.served == {"loop@1"} and trainer.publisher.pending() is None
    assert [v.step for v in loaded_versions(trainer.engine, "loop")] == [1]
    assert step_metrics(seeded)[0]["publish_error"] is None


def test_unpublishable_last_step_is_reported_not_waited_on_forever(seeded: str, tmp_path: Path, tiny: str) -> None:
    trainer, vllm = flaky_trainer(seeded, tmp_path, tiny, failures=10**6)
    assert trainer.run() == 1
    assert not trainer.finish_publishing(threading.Event(), timeout_s=1.5)
    assert vllm.served == set() and loaded_versions(trainer.engine, "loop") == []  # never routed to
    stop = threading.Event()
    stop.set()
    assert not trainer.finish_publishing(stop, timeout_s=3600)  # Ctrl-C does not wait for vLLM either


def test_waiting_trainer_stops_promptly(sqlite_url: str) -> None:
    db.upgrade(sqlite_url)
    engine = db.make_engine(sqlite_url)
    listener = ReadyListener(engine, "loop")
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    try:
        assert listener.wait(60, stop) is False
    finally:
        listener.close()
        engine.dispose()
    assert time.monotonic() - started < 30  # woken by the stop event, not by the 60 s poll timeout


def test_restarted_vllm_gets_the_published_adapter_back(seeded: str, tmp_path: Path, tiny: str) -> None:
    trainer, vllm = flaky_trainer(seeded, tmp_path, tiny, failures=0)
    assert trainer.run() == 1 and vllm.served == {"loop@1"}
    vllm.served.clear()  # vLLM restarted: runtime adapters are gone, the gateway still routes to loop@1
    assert trainer.publisher is not None
    trainer.publisher.reconcile()  # what a waiting trainer does every poll
    assert vllm.served == {"loop@1"}


def trajectory_steps(url: str) -> dict[str, int | None]:
    from sqlalchemy import select

    from gateway.store.models import Trajectory

    engine = db.make_engine(url)
    try:
        with engine.connect() as conn:
            return dict(conn.execute(select(Trajectory.trajectory_id, Trajectory.trained_step)).all())
    finally:
        engine.dispose()


def join_late(url: str, group: str, trajectory: str, reward: float | None = None) -> None:
    engine = db.make_engine(url)
    try:
        write_calls(engine, [make_record(trajectory, seq=1, seed=5, run="loop", group_id=group, group_size=4)])
        if reward is not None:
            store_rewards(engine, [RewardItem(trajectory, reward)])
    finally:
        engine.dispose()


def test_group_joined_while_claimed_by_a_dead_trainer_does_not_crash_the_next(
    seeded: str, tmp_path: Path, tiny: str
) -> None:
    """The crash loop: a trainer died holding g0 and g1, a new trajectory joined g0 meanwhile. The next trainer
    must train what is complete, not die on the unrewarded newcomer and re-claim it forever."""
    engine = db.make_engine(seeded)
    try:
        assert sorted(claim_ready_groups(engine, "loop", "dead", limit=2, lease_s=-1)) == ["g0", "g1"]
    finally:
        engine.dispose()
    join_late(seeded, "g0", "late")
    assert make_trainer(seeded, tmp_path, tiny, max_steps=1).run() == 1
    engine = db.make_engine(seeded)
    try:
        states = group_states(engine, "loop")
    finally:
        engine.dispose()
    assert states == {"g0": "open", "g1": "trained", "g2": "trained", "g3": "ready"}
    steps = trajectory_steps(seeded)
    assert {steps[f"g0-t{t}"] for t in range(4)} == {None} and steps["late"] is None


def test_trajectory_joining_during_the_step_is_kept_for_the_next_claim(
    seeded: str, tmp_path: Path, tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded_then_joined = loop.load_groups

    def load_groups(engine: object, group_ids: list[str]) -> list[dict]:
        loaded = loaded_then_joined(engine, group_ids)  # type: ignore[arg-type]
        join_late(seeded, group_ids[0], "late", reward=1.0)  # arrives and is rewarded while the step trains
        return loaded

    monkeypatch.setattr(loop, "load_groups", load_groups)
    assert make_trainer(seeded, tmp_path, tiny, max_steps=1).run() == 1
    engine = db.make_engine(seeded)
    try:
        states = group_states(engine, "loop")
    finally:
        engine.dispose()
    assert states == {"g0": "ready", "g1": "trained", "g2": "ready", "g3": "ready"}  # g0 again, for "late" only
    steps = trajectory_steps(seeded)
    assert steps.pop("late") is None and all(step == 1 for tid, step in steps.items() if tid[:2] in ("g0", "g1"))


def test_a_group_that_cannot_be_built_is_dropped_with_its_reason(
    seeded: str, tmp_path: Path, tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    build = loop.build_samples

    def fails_on_g0(groups: list, **kwargs: object) -> object:
        if any(group.group_id == "g0" for group in groups):
            raise ValueError("ids and logprobs disagree")
        return build(groups, **kwargs)

    monkeypatch.setattr(loop, "build_samples", fails_on_g0)
    assert make_trainer(seeded, tmp_path, tiny, max_steps=1).run() == 1
    engine = db.make_engine(seeded)
    try:
        states = group_states(engine, "loop")
        (step,) = steps_after(engine, "loop")
        with engine.connect() as conn:
            from sqlalchemy import select

            from gateway.store.models import Group

            reason = conn.execute(select(Group.drop_reason).where(Group.group_id == "g0")).scalar_one()
    finally:
        engine.dispose()
    assert states["g0"] == "dropped" and states["g1"] == "trained"
    assert reason == "cannot build samples: ValueError: ids and logprobs disagree"
    assert step["metrics"]["groups_used"] == 1 and step["metrics"]["groups_dropped"] == 1


def test_second_trainer_on_a_run_exits_or_waits_then_takes_over(seeded: str, tmp_path: Path, tiny: str) -> None:
    first = make_trainer(seeded, tmp_path, tiny, max_steps=1)
    with pytest.raises(loop.TrainerError, match=r"run 'loop' is being trained by .*:\d+ \(\w+\) until .*--exit-if-busy"):
        make_trainer(seeded, tmp_path, tiny, wait_for_lease=False)

    lines: queue.Queue[str] = queue.Queue()
    second: list[Trainer] = []
    waiting = threading.Thread(target=lambda: second.append(make_trainer(seeded, tmp_path, tiny, echo=lines.put)))
    waiting.start()
    line = lines.get(timeout=60)
    assert line.startswith("run 'loop' is being trained by ") and line.endswith("; waiting")
    assert first.run() == 1
    first.close()  # a clean exit gives the run up: the waiting trainer starts at once
    waiting.join(60)
    assert second and second[0].step == 1  # it resumed from what the first committed


def test_trainer_that_lost_its_run_cannot_commit_and_the_new_one_trains_on(
    seeded: str, tmp_path: Path, tiny: str
) -> None:
    stalled = make_trainer(seeded, tmp_path, tiny, run_lease_s=0.3)
    stalled.lease.stop(release=False)  # frozen (or cut off from the database): it renews nothing
    successor = make_trainer(seeded, tmp_path, tiny, max_steps=1)  # waits for the lease to run out
    with pytest.raises(loop.TrainerError, match="taken over"):
        stalled.train_one_step()
    assert successor.run() == 1
    assert [s["step"] for s in steps_after(successor.engine, "loop")] == [1]
    assert sorted(p.name for p in (tmp_path / "ckpt" / "loop").iterdir()) == ["00001"]


def test_cli_errors_are_one_line(seeded: str, tmp_path: Path, tiny: str) -> None:
    engine = db.make_engine(seeded)
    try:
        upsert_run(engine, "..", {}, base_model="base")  # made before the gateway refused such names
        acquire_run_lease(engine, "loop", "other-host:42", 60)
    finally:
        engine.dispose()
    env = {**os.environ, "TRAJGATE_DATABASE_URL": seeded, "TRAJGATE_CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    for run, expected in ((".." , "run name '..' is not valid"), ("loop", "being trained by other-host:42")):
        done = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "train", "--run", run, "--base-weights", tiny, "--backend", "hf",
             "--device", "cpu", "--no-publish", "--exit-if-busy"],
            env=env, capture_output=True, text=True, timeout=300,
        )
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0] and "Traceback" not in done.stderr, done.stderr
