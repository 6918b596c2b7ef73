"""vLLM's adapter slots (docs/training.md, "Several runs in one trainer"): the trainer refuses runs that need more
slots than vLLM has, queues a publication while every slot is taken, never has more adapters loaded than
`--max-loras`, takes a half-published version back from every replica, and two trainers racing for the last slot
cannot both take it. vLLM is FakeVllm, which answers as vLLM 0.32 does and counts what it would have evicted."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from gateway import cli
from gateway.runs.settings import load_settings
from gateway.store import db, peers
from gateway.store.adapter_slots import adapters_held
from gateway.store.runs import steps_after, upsert_run
from gateway.store.training import acquire_run_lease, commit_step, loaded_versions, publish_version
from tests.support.fake_vllm_admin import FakeAdmin, FakeVllm
from trainer.worker.loop import Runs, TrainerError, TrainerOptions
from trainer.worker.publish import Publisher, VllmAdmin, VllmReplicas


@pytest.fixture
def vllm() -> Iterator[FakeVllm]:
    fake = FakeVllm(max_loras=3).start()
    yield fake
    fake.stop()


def make_runs(engine: Engine, *names: str) -> None:
    for name in names:
        upsert_run(engine, name, {}, base_model="smollm2")
        acquire_run_lease(engine, name, "w", 600)


def commit(engine: Engine, run: str, step: int) -> None:
    commit_step(engine, run, step, "w", [], {}, trajectory_ids=[], lease_holder="w")


def publisher(engine: Engine, admin: Any, run: str, tmp_path: Path, lines: list[str], max_loras: int = 3) -> Publisher:
    def checkpoint(step: int) -> Path:
        path = tmp_path / run / str(step)
        path.mkdir(parents=True, exist_ok=True)
        return path

    return Publisher(engine, admin, run, checkpoint, keep=2, echo=lines.append, max_loras=max_loras)


def step_metrics(engine: Engine, run: str, step: int) -> dict[str, Any]:
    return next(s["metrics"] for s in steps_after(engine, run, 0) if s["step"] == step)


def test_fake_vllm_answers_as_vllm_does(vllm: FakeVllm, tmp_path: Path) -> None:
    admin = VllmAdmin(vllm.base_url)
    (tmp_path / "a").mkdir()
    admin.load("r@1", tmp_path / "a")
    admin.load("r@1", tmp_path / "a")  # vLLM's 400 for a name loaded twice: VllmAdmin reloads it
    assert admin.models() == {"smollm2", "r@1"} and vllm.peak == 1
    assert [status for status in _statuses(vllm)] == ["load", "load", "unload", "load"]
    admin.unload("nobody@1")  # vLLM's 404 for an unknown name is not an error
    with pytest.raises(Exception, match="404"):
        admin.load("r@2", tmp_path / "missing")
    assert admin.check_answers("r@1") >= 0


def _statuses(vllm: FakeVllm) -> list[str]:
    return [path.removeprefix("/v1/").removesuffix("_lora_adapter") for path, _ in vllm.requests]


def test_a_publication_waits_while_every_slot_is_taken_and_goes_on_once_one_is_unloaded(
    engine: Engine, vllm: FakeVllm, tmp_path: Path
) -> None:
    make_runs(engine, "a")
    lines: list[str] = []
    pub = publisher(engine, VllmAdmin(vllm.base_url), "a", tmp_path, lines)
    for step in (1, 2):
        commit(engine, "a", step)
        assert pub.publish(step, 0.0)
    # A live gateway that has not reloaded its routes: a retired version stays loaded until it has.
    peers.beat(engine, "gw", lambda _: None, 600, routes_read_at=0.0)
    commit(engine, "a", 3)
    assert pub.publish(3, 0.0)  # the third slot; a@1 is retired, not unloadable yet
    assert vllm.loaded == ["a@1", "a@2", "a@3"]
    commit(engine, "a", 4)
    assert not pub.publish(4, 0.0)  # 3/3 in use: waits, loads nothing
    pub.reconcile()
    pub.reconcile()
    waiting = [line for line in lines if "waits" in line]
    assert waiting == ["publish of step 4 waits: adapter slots 3/3 in use (a 3; TRAJGATE_VLLM_MAX_LORAS): waiting "
                       "for a retired adapter to be unloaded"]  # said once
    assert step_metrics(engine, "a", 4)["publish_waiting"] == waiting[0].removeprefix("publish of step 4 waits: ")
    assert pub.pending() == 4 and vllm.peak == 3
    with engine.connect() as conn:
        now = peers.clock(conn)
    peers.beat(engine, "gw", lambda _: None, 600, routes_read_at=now)  # the gateway reloaded: a@1 can go
    pub.reconcile()
    assert pub.pending() is None and [v.served_name for v in loaded_versions(engine, "a")] == ["a@3", "a@4"]
    assert step_metrics(engine, "a", 4)["publish_waiting"] is None
    assert vllm.peak == 3 and vllm.evicted == []


def test_never_more_adapters_than_slots_across_runs(engine: Engine, vllm: FakeVllm, tmp_path: Path) -> None:
    """Two runs, keep 2 each, on 3 slots (too few: the start-up check would refuse this, but two trainers starting
    together could both see room): vLLM never holds more than 3, and neither run waits forever (one gives up its
    older version early rather than both holding theirs)."""
    make_runs(engine, "a", "b")
    lines: list[str] = []
    pubs = {run: publisher(engine, VllmAdmin(vllm.base_url), run, tmp_path, lines) for run in ("a", "b")}
    for step in range(1, 6):
        for run, pub in pubs.items():
            commit(engine, run, step)
            pub.publish(step, 0.0)
            for other in pubs.values():
                other.reconcile()
            assert len(vllm.loaded) <= 3
            assert sum(len(names) for names in adapters_held(engine).values()) <= 3
    for _ in range(2):
        for pub in pubs.values():
            pub.reconcile()
    assert vllm.peak == 3 and vllm.evicted == []
    assert any("waits" in line for line in lines) and any("early" in line for line in lines)
    assert {run: pub.pending() for run, pub in pubs.items()} == {"a": None, "b": None}  # both serve step 5
    assert {len(names) for names in adapters_held(engine).values()} == {1, 2}


def test_a_version_one_replica_refuses_is_taken_back_from_the_others(engine: Engine, tmp_path: Path) -> None:
    make_runs(engine, "r")
    commit(engine, "r", 1)
    a, b = FakeAdmin("a"), FakeAdmin("b")
    b.refuse = True
    pub = publisher(engine, VllmReplicas([a, b]), "r", tmp_path, [])
    assert not pub.publish(1, 0.0)
    assert a.served == set() and a.loads == 1  # a had loaded it: unloaded again, no slot leaked
    assert adapters_held(engine) == {} and loaded_versions(engine, "r") == []
    b.refuse = False
    pub._next_try = 0.0  # past the backoff
    pub.reconcile()
    assert a.served == b.served == {"r@1"} and adapters_held(engine) == {"r": ["r@1"]}


def test_a_version_that_does_not_answer_on_one_replica_is_taken_back(engine: Engine, tmp_path: Path) -> None:
    make_runs(engine, "r")
    commit(engine, "r", 1)
    a, b = FakeAdmin("a"), FakeAdmin("b")
    b.mute = True
    pub = publisher(engine, VllmReplicas([a, b]), "r", tmp_path, [])
    assert not pub.publish(1, 0.0)
    assert a.served == b.served == set() and adapters_held(engine) == {}


def test_a_refused_unload_keeps_the_slot_until_it_is_undone(engine: Engine, tmp_path: Path) -> None:
    """A version that failed and could not be unloaded from a replica still holds that replica's slot: its claim
    stays counted, and a later reconcile takes it back once the replica lets go."""
    make_runs(engine, "r")
    commit(engine, "r", 1)
    a = FakeAdmin("a")
    a.mute = a.refuse_unload = True
    pub = publisher(engine, VllmReplicas([a]), "r", tmp_path, [])
    assert not pub.publish(1, 0.0)
    assert adapters_held(engine) == {"r": ["r@1"]} and a.served == {"r@1"}  # still counted
    commit(engine, "r", 2)
    a.mute = a.refuse_unload = False
    pub._next_try = 0.0  # past the backoff
    pub.reconcile()  # step 1 is superseded by step 2: its claim is taken back, step 2 published
    assert adapters_held(engine) == {"r": ["r@2"]} and a.served == {"r@2"}


def test_trainers_racing_for_the_last_slots_never_overcommit(db_url: str, vllm: FakeVllm, tmp_path: Path) -> None:
    """Each run's publisher on its own engine (as separate trainer processes would be), six publishing at once
    into 3 slots: exactly 3 get one."""
    db.upgrade(db_url)
    setup = db.make_engine(db_url)
    names = [f"r{i}" for i in range(6)]
    make_runs(setup, *names)
    for name in names:
        commit(setup, name, 1)
    engines = [db.make_engine(db_url) for _ in names]
    barrier = threading.Barrier(len(names))
    results: dict[str, bool] = {}

    def publish(name: str, engine: Engine) -> None:
        pub = publisher(engine, VllmAdmin(vllm.base_url), name, tmp_path, [])
        barrier.wait()
        results[name] = pub.publish(1, 0.0)

    threads = [threading.Thread(target=publish, args=(n, e)) for n, e in zip(names, engines, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert sum(results.values()) == 3 and vllm.peak == 3 and vllm.evicted == []
        assert sum(len(held) for held in adapters_held(setup).values()) == 3
    finally:
        for engine in [setup, *engines]:
            engine.dispose()


def test_start_up_refuses_runs_that_need_more_slots_than_vllm_has(engine: Engine) -> None:
    make_runs(engine, "x")
    for step in (1, 2):
        commit(engine, "x", step)
        publish_version(engine, "x", step, f"x@{step}", f"/c/x/{step}")
    settings = load_settings(_env_file=None)
    options = TrainerOptions(run="a", keep_adapters=2, max_loras=4)
    with pytest.raises(TrainerError) as refused:
        Runs(settings, options, ["a", "b", "c"], engine=engine)
    assert str(refused.value) == (
        "3 runs need 9 adapter slots (keep-adapters 2 + 1 being published, each) and run x holds 2; vLLM has "
        "--max-loras 4 (TRAJGATE_VLLM_MAX_LORAS): raise it to 11 or lower --keep-adapters"
    )
    Runs(settings, TrainerOptions(run="a", max_loras=11), ["a", "b", "c"], engine=engine)  # fits exactly
    Runs(settings, TrainerOptions(run="a", max_loras=None), ["a", "b", "c"], engine=engine)  # unknown: unchecked
    Runs(settings, TrainerOptions(run="a", max_loras=4, publish=False), ["a", "b", "c"], engine=engine)
    Runs(settings, TrainerOptions(run="x", max_loras=3), ["x"], engine=engine)  # x's own adapters are its share


def test_cli_refusal_is_one_line_and_status_2(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    db.upgrade(sqlite_url)
    monkeypatch.setenv("TRAJGATE_DATABASE_URL", sqlite_url)
    monkeypatch.setenv("TRAJGATE_VLLM_MAX_LORAS", "5")
    assert cli.main(["train", "--runs", "a,b", "--keep-adapters", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "trajgate train: 2 runs need 6 adapter slots (keep-adapters 2 + 1 being published, each); vLLM has "
        "--max-loras 5 (TRAJGATE_VLLM_MAX_LORAS): raise it to 6 or lower --keep-adapters"
    ]
    assert cli.main(["train", "--runs", "a,b", "--max-loras", "3", "--keep-adapters", "1"]) == 2
    assert "need 4 adapter slots" in capsys.readouterr().err  # the flag overrides the setting
    monkeypatch.delenv("TRAJGATE_VLLM_MAX_LORAS")
    assert cli.main(["train", "--runs", "a,b", "--keep-adapters", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "trajgate train: --keep-adapters 0: keep at least the newest adapter loaded"
    ]
    assert cli.main(["train", "--runs", "a,b"]) == 2  # started (then found no run a): unset is a warning only
    unset, missing = capsys.readouterr().err.strip().splitlines()
    assert unset.startswith("trajgate train: TRAJGATE_VLLM_MAX_LORAS is unset, so nothing checks")
    assert missing.startswith("trajgate train: run 'a' does not exist yet")


def test_all_runs_leaves_out_a_run_that_would_not_fit_and_takes_it_once_there_is_room(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("a", "b", "c"):
        upsert_run(engine, name, {}, base_model="smollm2")
    settings = load_settings(_env_file=None)
    lines: list[str] = []
    started: list[str] = []

    def start(self: Runs, name: str) -> None:  # no model: the slot rule is what is under test
        started.append(name)
        self.trainers[name] = object()  # type: ignore[assignment]

    monkeypatch.setattr(Runs, "_start", start)
    runs = Runs(settings, TrainerOptions(run="", keep_adapters=1, max_loras=5), None, engine=engine, echo=lines.append)
    runs._attach()
    runs._attach()
    assert started == ["a", "b"]  # c would need 6 of 5 slots
    assert lines == [
        "run 'c' not attached, retried while the others train: 3 runs need 6 adapter slots (keep-adapters 1 + 1 "
        "being published, each); vLLM has --max-loras 5 (TRAJGATE_VLLM_MAX_LORAS): raise it to 6 or lower "
        "--keep-adapters"
    ]  # said once
    runs.options.max_loras = 6
    runs._attach()
    assert started == ["a", "b", "c"]
