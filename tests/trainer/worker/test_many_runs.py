"""Several runs in one trainer process (trainer.worker.loop.Runs): one base model, per-run everything else, a fair
turn between the runs with ready groups, per-run resume and per-run leases."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gateway.runs.settings import Settings, load_settings
from gateway.store import db
from gateway.store.runs import steps_after, upsert_run
from gateway.store.training import group_states
from tests.support.tiny_models import build_tiny_llama
from tests.support.trainer_runs import adapter, seed_groups
from trainer.backends import HFBackend, LoraSpec
from trainer.worker import loop
from trainer.worker.loop import Runs, Trainer, TrainerOptions

RUNS = ["ra", "rb"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny")))


# -- the fair rule, on a scripted store -------------------------------------------------------------------------


class Scripted:
    """A run's trainer as Runs sees it; `has_data(clock)` scripts the store: whether the run has a step's groups
    ready after `clock` steps of all runs."""

    def __init__(
        self, name: str, has_data: Callable[[int], bool], log: list[str], stop: threading.Event, last: int
    ) -> None:
        self.spec = SimpleNamespace(name=name)
        self.backend = object()
        self.step = 0
        self.idle_s = 0.0
        self._has_data, self._log, self._stop, self._last = has_data, log, stop, last

    def poll_ready(self) -> bool:
        return self._has_data(len(self._log))

    def train_one_step(self) -> dict[str, Any]:
        self.step += 1
        self._log.append(str(self.spec.name))
        if len(self._log) == self._last:
            self._stop.set()
        return {}


Script = Callable[[str, list[str]], Callable[[int], bool]]


def turns(sqlite_url: str, scripts: dict[str, Script], steps: int) -> list[str]:
    """The order Runs gives the scripted runs their steps, until `steps` are done."""
    log: list[str] = []
    stop = threading.Event()
    fakes: list[Any] = [Scripted(name, script(name, log), log, stop, steps) for name, script in scripts.items()]
    settings = load_settings(_env_file=None, database_url=sqlite_url)
    runs = Runs(settings, TrainerOptions(run="", poll_s=0.01), list(scripts), attached=fakes)
    assert runs.run(stop) == steps
    assert runs.done == {name: log.count(name) for name in scripts if name in log}
    return log


def always(_name: str, _log: list[str]) -> Callable[[int], bool]:
    return lambda _clock: True


def test_runs_take_turns_and_one_whose_data_stops_blocks_nobody(sqlite_url: str) -> None:
    def two_steps_then_nothing(name: str, log: list[str]) -> Callable[[int], bool]:
        return lambda _clock: log.count(name) < 2  # its agents stop after two steps' worth of groups

    log = turns(sqlite_url, {"ra": always, "rb": always, "rc": two_steps_then_nothing}, steps=12)
    # Round-robin in attach order while all three have data; then ra and rb alternate, never waiting on rc.
    assert log == ["ra", "rb", "rc", "ra", "rb", "rc", "ra", "rb", "ra", "rb", "ra", "rb"]


def test_a_run_with_scarce_data_goes_first_whenever_it_has_some(sqlite_url: str) -> None:
    def every_third(_name: str, _log: list[str]) -> Callable[[int], bool]:
        return lambda clock: clock % 3 == 0

    # rb has groups only now and then: each time it has, it has waited longer than ra and goes next (at clock 0
    # neither has had a turn, and attach order decides).
    log = turns(sqlite_url, {"ra": always, "rb": every_third}, steps=9)
    assert log == ["ra", "ra", "ra", "rb", "ra", "ra", "rb", "ra", "ra"]


# -- real runs on a tiny model ----------------------------------------------------------------------------------


def test_an_adapter_on_a_shared_base_counts_the_flops_of_its_own_model(tiny: str) -> None:
    first = HFBackend(tiny, LoraSpec(rank=16), 1e-2, device="cpu")
    second = HFBackend(tiny, LoraSpec(rank=8, targets=["q_proj"]), 1e-2, device="cpu", share_base=first)
    alone = HFBackend(tiny, LoraSpec(rank=8, targets=["q_proj"]), 1e-2, device="cpu")
    assert second.flops_per_token() == alone.flops_per_token() < first.flops_per_token()


def seed_run(url: str, tiny: str, run: str, groups: int, size: int = 4, first: int = 0) -> None:
    """Rewarded groups of `run` (PATTERN-repeating completions earn 1) with the model's own logprobs. Each run its
    own objective settings: rb another loss and learning rate, and a smaller adapter, set before the calls, which
    would create the run with the defaults (a trainer may be looking)."""
    config: dict[str, Any] = {"groups_per_step": 2, "learning_rate": 1e-2, "loss": "grpo"}
    if run == "rb":
        config = {**config, "learning_rate": 5e-3, "loss": "cispo", "lora_rank": 8, "lora_alpha": 16}
    seed_groups(url, tiny, groups, size, f"{run}-{first}", run=run, prefix=f"{run}-", first=first, config=config)


def settings_for(url: str, tmp_path: Path) -> Settings:
    return load_settings(_env_file=None, database_url=url, checkpoint_dir=tmp_path / "ckpt")


def options(tiny: str, **extra: Any) -> TrainerOptions:
    fields: dict[str, Any] = {"run": "", "backend": "hf", "device": "cpu", "base_weights": tiny, "poll_s": 0.05}
    return TrainerOptions(**{**fields, "publish": False, **extra})


_made: list[Runs | Trainer] = []


@pytest.fixture
def two_runs(db_url: str, tiny: str) -> Iterator[str]:
    db.upgrade(db_url)
    for run in RUNS:
        seed_run(db_url, tiny, run, groups=4)
    yield db_url
    while _made:  # give every run up, as `trajgate train` does on exit
        _made.pop().close()


def many(url: str, tmp_path: Path, tiny: str, echo: Callable[[str], None] = lambda line: None, **extra: Any) -> Runs:
    runs = Runs(settings_for(url, tmp_path), options(tiny, **extra), RUNS, echo=echo)
    _made.append(runs)
    return runs


def base_tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    model: Any = trainer.backend.model
    return {n: p for n, p in model.get_base_model().named_parameters() if "lora_" not in n}


def test_two_runs_share_the_base_weights_and_train_apart(two_runs: str, tmp_path: Path, tiny: str) -> None:
    runs = many(two_runs, tmp_path, tiny, max_steps=2)
    assert runs.run() == 4
    ra, rb = runs.trainers["ra"], runs.trainers["rb"]
    # The base weights are in memory once: every base parameter is the same storage for both runs.
    a_base, b_base = base_tensors(ra), base_tensors(rb)
    assert a_base.keys() == b_base.keys() and a_base
    assert all(a_base[n].data_ptr() == b_base[n].data_ptr() for n in a_base)
    assert ra.backend.trainable and not {id(p) for p in ra.backend.trainable} & {id(p) for p in rb.backend.trainable}
    assert runs.steps() == {"ra": 2, "rb": 2}
    for run in RUNS:
        assert [s["step"] for s in steps_after(runs.engine, run)] == [1, 2]
        assert sorted(group_states(runs.engine, run).values()) == ["trained"] * 4
        assert sorted(p.name for p in (tmp_path / "ckpt" / run).iterdir()) == ["00001", "00002"]
    lora_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert adapter(tmp_path / "ckpt" / "rb" / "00002")[lora_a].shape[0] == 8  # rb's own lora_rank

    # A run trained beside another is the run trained alone: same adapter after the same steps.
    alone_url = f"sqlite:///{tmp_path / 'alone.db'}"
    db.upgrade(alone_url)
    seed_run(alone_url, tiny, "rb", groups=4)
    alone_settings = settings_for(alone_url, tmp_path / "alone")
    alone = Trainer(alone_settings, options(tiny, run="rb", max_steps=2), echo=lambda _: None)
    _made.append(alone)
    assert alone.run() == 2
    shared, own = adapter(tmp_path / "ckpt" / "rb" / "00002"), adapter(tmp_path / "alone" / "ckpt" / "rb" / "00002")
    assert shared.keys() == own.keys() and all(torch.allclose(shared[k], own[k], atol=1e-6) for k in own)


def test_each_run_resumes_from_its_own_last_step_after_a_kill_mid_step(
    two_runs: str, tmp_path: Path, tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = many(two_runs, tmp_path, tiny, max_steps=1, lease_s=0.5, run_lease_s=0.5)
    assert first.run() == 2  # one step each: ra at 1, rb at 1
    commit = loop.commit_step

    def die_on_rb(engine: Any, run: str, step: int, *args: Any, **kwargs: Any) -> None:
        if run == "rb":
            raise SystemExit("killed after rb's checkpoint, before its commit")
        commit(engine, run, step, *args, **kwargs)

    monkeypatch.setattr(loop, "commit_step", die_on_rb)
    first.done.clear()
    with pytest.raises(SystemExit):
        first.run()  # ra commits step 2 (its turn comes first), then the process dies in rb's step 2
    for trainer in first.trainers.values():
        trainer.lease.stop(release=False)  # a dead process renews nothing
    _made.remove(first)
    assert (tmp_path / "ckpt" / "rb" / "00002").exists()  # the orphan the kill leaves
    monkeypatch.undo()
    time.sleep(0.6)  # the dead trainer's leases (run and claims) run out
    seed_run(two_runs, tiny, "ra", groups=2, first=4)  # ra's agents go on meanwhile

    lines: list[str] = []
    restarted = many(two_runs, tmp_path, tiny, echo=lines.append, max_steps=1)
    assert restarted.run() == 2
    said = "\n".join(lines)
    assert "[ra] resumed run 'ra' at step 2" in said and "[rb] resumed run 'rb' at step 1" in said
    assert restarted.steps() == {"ra": 3, "rb": 2}
    assert [s["step"] for s in steps_after(restarted.engine, "ra")] == [1, 2, 3]
    assert [s["step"] for s in steps_after(restarted.engine, "rb")] == [1, 2]  # the killed step, trained again
    for run, groups in (("ra", 6), ("rb", 4)):
        assert sorted(group_states(restarted.engine, run).values()) == ["trained"] * groups


def test_one_run_taken_over_by_another_trainer_while_the_others_go_on(two_runs: str, tmp_path: Path, tiny: str) -> None:
    lines: list[str] = []
    runs = many(two_runs, tmp_path, tiny, echo=lines.append, max_steps=2, run_lease_s=0.3)
    runs._attach()  # both runs held by this trainer
    runs.trainers["rb"].lease.stop(release=False)  # its hold on rb stalls (cut off, frozen)
    successor = Trainer(settings_for(two_runs, tmp_path), options(tiny, run="rb", max_steps=1), echo=lambda _: None)
    _made.append(successor)  # it waited for rb's lease to run out, and took rb over
    assert runs.run() == 2  # ra's two steps; rb is given up without touching ra
    assert runs.steps() == {"ra": 2} and runs.wanted == ["ra"]
    assert any("run 'rb' was taken over by" in line and "training the other runs on" in line for line in lines)
    assert successor.run() == 1
    assert [s["step"] for s in steps_after(runs.engine, "ra")] == [1, 2]
    assert [s["step"] for s in steps_after(runs.engine, "rb")] == [1]


def test_cli_trains_several_runs_and_refuses_them_only_with_fsdp(sqlite_url: str, tmp_path: Path, tiny: str) -> None:
    """Several runs train under torchrun too (tests/e2e/test_torchrun_e2e.py); sharding one base model (--fsdp) for
    several runs is refused before the job is joined."""
    db.upgrade(sqlite_url)
    for run in RUNS:
        seed_run(sqlite_url, tiny, run, groups=2)
    env = {**os.environ, "TRAJGATE_DATABASE_URL": sqlite_url, "TRAJGATE_CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    command = [sys.executable, "-m", "gateway.cli", "train", "--runs", "ra,rb", "--base-weights", tiny,
               "--device", "cpu", "--no-publish", "--steps", "1", "--poll-s", "0.05"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "2 step(s) done; run 'ra' is at step 1, run 'rb' is at step 1" in done.stdout
    assert "[ra] step    1 |" in done.stdout and "[rb] step    1 |" in done.stdout

    ranked = {**env, "RANK": "0", "WORLD_SIZE": "2"}
    refused = subprocess.run([*command, "--fsdp"], env=ranked, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--fsdp shards one run's base model" in refused.stderr, refused.stderr


def test_all_runs_picks_up_a_run_created_later_and_skips_one_it_cannot_train(
    db_url: str, tmp_path: Path, tiny: str
) -> None:
    db.upgrade(db_url)
    seed_run(db_url, tiny, "ra", groups=2)
    engine = db.make_engine(db_url)
    upsert_run(engine, "..", {}, base_model="base")  # made before the gateway refused such names
    lines: list[str] = []
    runs = Runs(settings_for(db_url, tmp_path), options(tiny), None, engine=engine, echo=lines.append)
    stop = threading.Event()
    worker = threading.Thread(target=runs.run, args=(stop,))
    worker.start()
    try:
        deadline = time.monotonic() + 120
        while not steps_after(engine, "ra") and time.monotonic() < deadline:
            time.sleep(0.1)
        seed_run(db_url, tiny, "rb", groups=2)  # a run created while the trainer runs
        while not steps_after(engine, "rb") and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        worker.join(60)
        runs.close()
    assert [s["step"] for s in steps_after(engine, "ra")] == [1]
    assert [s["step"] for s in steps_after(engine, "rb")] == [1]
    skipped = [line for line in lines if "not training it" in line]  # said once, though looked at every round
    assert len(skipped) == 1 and skipped[0].startswith("run name '..' is not valid: ")
    engine.dispose()
