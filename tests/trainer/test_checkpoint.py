"""Checkpoints: an interrupted run resumes exactly; directories appear atomically; leftovers are cleaned."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch

from tests.support.tiny_models import build_tiny_llama, make, mixed_rows, set_behaviour
from trainer.backends import HFBackend, LoraSpec, TrainerBackend
from trainer.checkpoint import checkpoint_dir, discard_after, latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.loss import LossConfig

RUN = "email-agent"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def trainable(backend: HFBackend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.model.named_parameters() if p.requires_grad}


def optimizer_state(backend: HFBackend) -> list[dict[str, torch.Tensor]]:
    return [backend.optimizer.state[p] for p in backend.trainable]


def test_kill_and_resume_equals_an_uninterrupted_run(tiny: str, tmp_path: Path) -> None:
    """A: step 1, step 2. B: step 1, save, a new process-like backend loads it, step 2.
    Dropout is on, so the RNG states must be restored too, not only weights and Adam moments."""
    lora = LoraSpec(dropout=0.1)
    config = LossConfig(kind="cispo")
    reference = make(tiny, lora=lora)
    rows1 = set_behaviour(reference, mixed_rows(seed=10))
    rows2 = set_behaviour(reference, mixed_rows(seed=11))
    del reference

    a = make(tiny, lora=lora)
    a.train_step(rows1, config, micro_batch_tokens=32)
    a_metrics = a.train_step(rows2, config, micro_batch_tokens=32)

    b = make(tiny, lora=lora)
    b.train_step(rows1, config, micro_batch_tokens=32)
    path = save_checkpoint(b, tmp_path, RUN, 1, {"groups": ["g1", "g2"]})
    del b
    c = make(tiny, lora=lora)
    assert load_checkpoint(c, path) == {"groups": ["g1", "g2"]}
    assert c.step == 1
    c_metrics = c.train_step(rows2, config, micro_batch_tokens=32)

    a_params, c_params = trainable(a), trainable(c)
    assert a_params.keys() == c_params.keys()
    for name, value in a_params.items():
        torch.testing.assert_close(c_params[name], value, rtol=1e-6, atol=1e-8)
    for a_state, c_state in zip(optimizer_state(a), optimizer_state(c), strict=True):
        assert a_state.keys() == c_state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in a_state:
            torch.testing.assert_close(c_state[key], a_state[key], rtol=1e-6, atol=1e-10)
    for key in set(a_metrics) - {"seconds", "tokens_per_s"}:
        assert c_metrics[key] == pytest.approx(a_metrics[key], rel=1e-6, abs=1e-9), key
    assert c.step == a.step == 2


def test_checkpoint_layout_and_permissions(tiny: str, tmp_path: Path) -> None:
    backend = make(tiny)
    path = save_checkpoint(backend, tmp_path, RUN, 3, {"policy_version": 3})
    assert path == tmp_path / RUN / "00003"
    names = {p.name for p in path.iterdir()}
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.pt",
        "rng.pt",
        "trainer_state.json",
        "checkpoint.json",
    } <= names
    assert stat.S_IMODE(path.stat().st_mode) == 0o755  # vLLM may run as another user
    assert json.loads((path / "trainer_state.json").read_text())["lora"]["rank"] == 16
    assert latest_checkpoint(tmp_path, RUN) == (3, path)
    with pytest.raises(FileExistsError):
        save_checkpoint(backend, tmp_path, RUN, 3, {})


def test_a_checkpoint_of_another_lora_shape_is_refused(tiny: str, tmp_path: Path) -> None:
    path = save_checkpoint(make(tiny), tmp_path, RUN, 1, {})
    with pytest.raises(ValueError, match="another shape"):
        load_checkpoint(make(tiny, lora=LoraSpec(rank=8)), path)


class FileBackend(TrainerBackend):
    """Writes one file per save; ``fail`` makes save crash halfway, like a killed process."""

    name = "file"

    def __init__(self, fail: bool = False) -> None:
        super().__init__("none", LoraSpec(), 1e-5, device="cpu")
        self.fail = fail

    def logprobs(self, batch: dict[str, torch.Tensor], *, trained_only: bool) -> torch.Tensor:
        raise NotImplementedError

    def target_scores(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def save(self, directory: Path) -> None:
        (directory / "adapter_model.safetensors").write_bytes(b"weights")
        if self.fail:
            raise OSError("disk full")

    def load(self, directory: Path) -> None:
        self.loaded = (directory / "adapter_model.safetensors").read_bytes()

    def flops_per_token(self) -> float:
        return 0.0


def test_a_crashed_save_leaves_nothing_that_looks_like_a_checkpoint(tmp_path: Path) -> None:
    save_checkpoint(FileBackend(), tmp_path, RUN, 1, {})
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(FileBackend(fail=True), tmp_path, RUN, 2, {})
    assert sorted(p.name for p in (tmp_path / RUN).iterdir()) == ["00001"]
    assert latest_checkpoint(tmp_path, RUN) == (1, tmp_path / RUN / "00001")


def test_temp_dirs_are_ignored_and_discard_after_removes_uncommitted_steps(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path, RUN) is None
    assert discard_after(tmp_path, RUN, 0) == []
    for step in (1, 2, 3):
        save_checkpoint(FileBackend(), tmp_path, RUN, step, {"step": step})
    # What a process killed mid-save (or mid-delete) leaves behind.
    for leftover in (".tmp-00004-x1y2", ".trash-00009-123"):
        (tmp_path / RUN / leftover).mkdir()
        (tmp_path / RUN / leftover / "adapter_model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path, RUN) == (3, tmp_path / RUN / "00003")

    # The DB committed step 1 only: steps 2 and 3 were saved but never committed.
    assert discard_after(tmp_path, RUN, 1) == [2, 3]
    assert sorted(p.name for p in (tmp_path / RUN).iterdir()) == ["00001"]
    step, path = latest_checkpoint(tmp_path, RUN)  # type: ignore[misc]
    backend = FileBackend()
    assert (step, load_checkpoint(backend, path), backend.loaded) == (1, {"step": 1}, b"weights")
    save_checkpoint(FileBackend(), tmp_path, RUN, 2, {})  # the step is trained and saved again
    assert latest_checkpoint(tmp_path, RUN) == (2, tmp_path / RUN / "00002")


@pytest.mark.parametrize("run", ["", ".", "..", "../other", "a/../..", "a//b", "/abs"])
def test_run_names_cannot_escape_the_checkpoint_root(tmp_path: Path, run: str) -> None:
    with pytest.raises(ValueError, match="run name"):
        save_checkpoint(FileBackend(), tmp_path / "root", run, 1, {})
    with pytest.raises(ValueError, match="run name"):
        discard_after(tmp_path / "root", run, 0)
    assert not (tmp_path / "00001").exists()


def test_hub_style_run_names_get_one_directory_each(tmp_path: Path) -> None:
    """The gateway accepts `org/model` as a run name, so the store must too: one directory per run, no nesting
    (a run `org` and a run `org/model` must not share or contain each other's steps)."""
    save_checkpoint(FileBackend(), tmp_path, "org/model", 1, {})
    save_checkpoint(FileBackend(), tmp_path, "org", 2, {})
    assert latest_checkpoint(tmp_path, "org/model") == (1, checkpoint_dir(tmp_path, "org/model", 1))
    assert latest_checkpoint(tmp_path, "org") == (2, tmp_path / "org" / "00002")
    assert checkpoint_dir(tmp_path, "org/model", 1).parent.parent == tmp_path
    assert discard_after(tmp_path, "org", 0) == [2]
    assert latest_checkpoint(tmp_path, "org/model") is not None
