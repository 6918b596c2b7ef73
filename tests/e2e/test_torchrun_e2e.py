"""`torchrun --nproc_per_node 2 -m gateway.cli -- train` with gloo on the tiny random Llama, against the same
groups trained in one process: the same gradients (step metrics) and adapters, resuming from a one-process
checkpoint and resumed from a two-rank one, with the model whole on each rank (DDP) or its base weights sharded
(`--fsdp`); two runs in one job as in one process (`--runs`); and a rank killed mid-step commits nothing.

In the e2e tier (no vLLM here) because a torchrun launch loads torch and transformers in three processes: about
20 s on an idle 2-core machine, over a minute on a busy one. The fast tier checks the same arithmetic with two
spawned ranks (tests/trainer/test_distributed.py). The databases are SQLite files: only rank 0 touches the database, and
the loop's store calls are the ones tests/trainer/worker/test_trainer_loop.py runs on both backends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gateway.runs.settings import load_settings
from gateway.store import db
from gateway.store.runs import steps_after, upsert_run
from gateway.store.training import group_states
from tests.support.tiny_models import build_tiny_llama
from tests.support.trainer_runs import adapter, seed_groups
from trainer.worker.loop import Runs, Trainer, TrainerOptions

GROUPS, PER_STEP = 8, 2
# The adapters after steps 2-4 (step 1 is the same process on both sides). The gradients agree to ~1e-7
# (float32 sums in another order), but AdamW divides by √v, which turns that noise in a near-zero coordinate
# into up to ~1e-4 of a weight (weights ~0.13, lr 1e-2), and in the rare coordinate whose gradient is near that noise
# into more (4.2e-4 in 1 of 1,024, seen on an Intel AVX-512 machine, where gloo and the one process sum in other
# orders than on the AMD machines). A wrong gradient moves most weights by ~lr = 1e-2; so at most ADAPTER_OUTLIERS of
# a tensor's elements may be past ADAPTER_ATOL, and none past ADAPTER_MAX (a sign flipped by noise moves one by 2 lr).
ADAPTER_ATOL = 2e-4
ADAPTER_OUTLIERS = 1 / 256
ADAPTER_MAX = 2e-2
# grad_norm is computed from the summed gradient, before AdamW: it shows a wrongly scaled gradient, which
# AdamW's first step (invariant to the gradient's scale) would hide from the adapter comparison.
METRIC_REL = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny")))


def seeded(path: Path, tiny: str) -> str:
    """A SQLite database with GROUPS ready groups of run 'loop', which trains PER_STEP groups per step."""
    url = f"sqlite:///{path}"
    db.upgrade(url)
    seed_groups(url, tiny, groups=GROUPS)
    engine = db.make_engine(url)
    try:
        upsert_run(engine, "loop", {"groups_per_step": PER_STEP, "learning_rate": 1e-2, "loss": "grpo"})
    finally:
        engine.dispose()
    return url


def trainer(url: str, directory: Path, tiny: str, steps: int) -> Trainer:
    """The same trainer in this process (world size 1), checkpoints under ``directory/ckpt``."""
    settings = load_settings(_env_file=None, database_url=url, checkpoint_dir=directory / "ckpt")
    options = TrainerOptions(
        run="loop", backend="hf", device="cpu", base_weights=tiny, poll_s=0.05, publish=False, max_steps=steps
    )
    return Trainer(settings, options, echo=lambda line: None)


def torchrun(
    url: str, checkpoints: Path, tiny: str, *args: str, module: str = "gateway.cli", runs: str = "--run=loop",
    **env: str,
) -> subprocess.CompletedProcess[str]:
    """Two gloo ranks on the CPU training run 'loop' (``--standalone``: a free port, so parallel jobs don't
    collide). `--` keeps torchrun's parser off `--run` (its
    `--run-path` would claim it as an abbreviation)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", module, "--",
        "train", runs, "--backend", "hf", "--device", "cpu", "--base-weights", tiny,
        "--no-publish", "--poll-s", "0.05", *args,
    ]  # fmt: skip
    environment = {
        **os.environ,
        "TRAJGATE_DATABASE_URL": url,
        "TRAJGATE_CHECKPOINT_DIR": str(checkpoints),
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),  # the repository root, where gateway/ and tests/ are
        **env,
    }
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=240)


def steps(url: str, run: str = "loop") -> list[dict]:
    engine = db.make_engine(url)
    try:
        return steps_after(engine, run)
    finally:
        engine.dispose()


def states(url: str) -> list[str]:
    engine = db.make_engine(url)
    try:
        return sorted(group_states(engine, "loop").values())
    finally:
        engine.dispose()


def run_alone(url: str, directory: Path, tiny: str, steps: int) -> int:
    """Train ``steps`` steps in this process; returns the step it resumed at."""
    alone = trainer(url, directory, tiny, steps)
    try:
        resumed = alone.step
        assert alone.run() == steps
    finally:
        alone.close()
    return resumed


@pytest.mark.parametrize("sharding", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_two_ranks_train_the_single_process_steps_and_resume_at_any_world_size(
    tmp_path: Path, tiny: str, sharding: list[str]
) -> None:
    reference = seeded(tmp_path / "reference.db", tiny)
    run_alone(reference, tmp_path / "alone", tiny, steps=4)

    url = seeded(tmp_path / "ranks.db", tiny)
    checkpoints = tmp_path / "ranks" / "ckpt"
    run_alone(url, tmp_path / "ranks", tiny, steps=1)
    # Rank 0 resumes from the one-process checkpoint and hands it to rank 1; then two data-parallel steps.
    done = torchrun(url, checkpoints, tiny, "--steps", "2", *sharding)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "run 'loop' is at step 3" in done.stdout
    assert run_alone(url, tmp_path / "ranks", tiny, steps=1) == 3  # one process resumes a two-rank checkpoint

    got, want = steps(url), steps(reference)
    assert [s["step"] for s in got] == [s["step"] for s in want] == [1, 2, 3, 4]
    for mine, theirs in zip(got, want, strict=True):
        for key in ("grad_norm", "loss", "tokens", "ratio_mean", "ratio_max", "clip_frac", "input_tokens"):
            assert mine["metrics"][key] == pytest.approx(theirs["metrics"][key], rel=METRIC_REL, abs=1e-7), key
        assert mine["metrics"]["groups_used"] == theirs["metrics"]["groups_used"] == PER_STEP
    for step in (2, 3, 4):
        a = adapter(checkpoints / "loop" / f"{step:05d}")
        b = adapter(tmp_path / "alone" / "ckpt" / "loop" / f"{step:05d}")
        assert a.keys() == b.keys()
        for key in b:
            same_adapter(a[key], b[key], key)
    assert states(url) == ["trained"] * GROUPS


def same_adapter(got: torch.Tensor, want: torch.Tensor, key: str) -> None:
    """One adapter tensor trained on two ranks against the same trained in one process (see ADAPTER_ATOL)."""
    assert got.shape == want.shape, key
    difference = (got.float() - want.float()).abs()
    outliers = int((difference > ADAPTER_ATOL).sum())
    assert outliers <= ADAPTER_OUTLIERS * difference.numel(), (key, outliers, difference.numel(), difference.max())
    assert float(difference.max()) <= ADAPTER_MAX, (key, float(difference.max()))


def same_steps(got: list[dict], want: list[dict], groups_used: int) -> None:
    """Step by step, the metrics a wrong gradient or normaliser would move."""
    assert [s["step"] for s in got] == [s["step"] for s in want]
    for mine, theirs in zip(got, want, strict=True):
        for key in ("grad_norm", "loss", "tokens", "ratio_mean", "ratio_max", "clip_frac", "input_tokens"):
            assert mine["metrics"][key] == pytest.approx(theirs["metrics"][key], rel=METRIC_REL, abs=1e-7), key
        assert mine["metrics"]["groups_used"] == theirs["metrics"]["groups_used"] == groups_used


def two_runs(path: Path, tiny: str) -> str:
    """A SQLite database with runs 'ra' (GRPO, lr 1e-2) and 'rb' (CISPO, lr 5e-3, other groups): two runs that
    differ in data and objective, so a step given the other run's replica or settings shows."""
    url = f"sqlite:///{path}"
    db.upgrade(url)
    seed_groups(url, tiny, groups=4, run="ra", prefix="a-", seed=1,
                config={"groups_per_step": PER_STEP, "learning_rate": 1e-2, "loss": "grpo"})
    seed_groups(url, tiny, groups=4, run="rb", prefix="b-", seed=2,
                config={"groups_per_step": PER_STEP, "learning_rate": 5e-3, "loss": "cispo"})  # fmt: skip
    return url


def test_two_runs_in_one_job_train_as_in_one_process(tmp_path: Path, tiny: str) -> None:
    """`--runs ra,rb` under torchrun: every rank keeps a replica per run on its one base model, and each run's steps
    and adapters equal those of the same two runs trained in one process (trainer.worker.loop.Runs)."""
    reference = two_runs(tmp_path / "reference.db", tiny)
    settings = load_settings(_env_file=None, database_url=reference, checkpoint_dir=tmp_path / "alone" / "ckpt")
    options = TrainerOptions(
        run="", backend="hf", device="cpu", base_weights=tiny, poll_s=0.05, publish=False, max_steps=2
    )
    alone = Runs(settings, options, ["ra", "rb"], echo=lambda line: None)
    try:
        assert alone.run() == 4
    finally:
        alone.close()

    url = two_runs(tmp_path / "ranks.db", tiny)
    checkpoints = tmp_path / "ranks" / "ckpt"
    done = torchrun(url, checkpoints, tiny, "--steps", "2", runs="--runs=ra,rb")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "run 'ra' is at step 2, run 'rb' is at step 2" in done.stdout, done.stdout[-2000:]
    for run in ("ra", "rb"):
        same_steps(steps(url, run), steps(reference, run), PER_STEP)
        for step in (1, 2):
            a = adapter(checkpoints / run / f"{step:05d}")
            b = adapter(tmp_path / "alone" / "ckpt" / run / f"{step:05d}")
            assert a.keys() == b.keys()
            for key in b:
                same_adapter(a[key], b[key], key)
    # the runs really differ: a replica mixed up between them would not pass the comparison above
    assert steps(url, "ra")[0]["metrics"]["grad_norm"] != pytest.approx(steps(url, "rb")[0]["metrics"]["grad_norm"])


def test_a_rank_that_dies_mid_step_leaves_nothing_committed(tmp_path: Path, tiny: str) -> None:
    url = seeded(tmp_path / "ranks.db", tiny)
    checkpoints = tmp_path / "ckpt"
    died = torchrun(
        url, checkpoints, tiny, "--steps", "1", "--lease-s", "1",
        module="tests.support.torchrun_fault", TRAJGATE_TEST_KILL_RANK="1",
    )  # fmt: skip
    assert died.returncode != 0
    assert "exitcode  : 3" in died.stderr  # rank 1 died as the fault hook made it; rank 0 then failed
    assert steps(url) == []
    assert not any(p.name.isdigit() for p in (checkpoints / "loop").glob("*"))
    assert "trained" not in states(url)

    time.sleep(1.1)  # the dead job's claims run out; the groups are first in line again
    assert run_alone(url, tmp_path, tiny, steps=1) == 0
    assert [s["step"] for s in steps(url)] == [1]
