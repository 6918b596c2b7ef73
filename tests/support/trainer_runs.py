"""A trainer run on the tiny Llama (tests/support/tiny_models.py) over a database: rewarded groups seeded with the
model's own logprobs, a CPU trainer on them, and its checkpoints' adapter weights. Shared by the trainer-loop and SFT
tests and the torchrun e2e, which compare the adapters a run leaves."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gateway.runs.settings import load_settings
from gateway.store import db
from tests.support.tiny_models import PATTERN, VOCAB
from trainer.demo.seeded_groups import SeededTrajectory, seed_rewarded
from trainer.worker.loop import Trainer, TrainerOptions


def own_logprobs(model_dir: str, prompt: list[int], completion: list[int]) -> list[float]:
    """What a sampler serving these weights would have recorded (raw logprobs, no temperature)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    values = logprobs[torch.arange(len(targets)), targets]
    return values[len(prompt) - 1 :].tolist()


def seed_groups(
    url: str,
    tiny: str,
    groups: int,
    size: int = 4,
    seed: int | str = 0,
    *,
    run: str = "loop",
    prefix: str = "",
    first: int = 0,
    config: dict[str, Any] | None = None,
) -> None:
    """Rewarded groups whose completions that repeat PATTERN earn 1, others 0, with the model's own logprobs; ids
    start with `prefix` (several runs in one database), and `config`, when given, creates the run first."""
    rng = random.Random(seed)
    trajectories = []
    for g in range(first, first + groups):
        for t in range(size):
            prompt = [rng.randrange(VOCAB) for _ in range(6)]
            good = t % 2 == 0
            completion = [PATTERN] * 5 if good else [rng.randrange(VOCAB) for _ in range(5)]
            trajectories.append(
                SeededTrajectory(
                    trajectory_id=f"{prefix}g{g}-t{t}",
                    group_id=f"{prefix}g{g}",
                    prompt_token_ids=prompt,
                    completion_token_ids=completion,
                    completion_logprobs=own_logprobs(tiny, prompt, completion),
                    reward=1.0 if good else 0.0,
                )
            )
    engine = db.make_engine(url)
    try:
        seed_rewarded(engine, run, trajectories, config=config)
    finally:
        engine.dispose()


def adapter(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    (path,) = checkpoint.rglob("adapter_model.safetensors")
    return load_file(path)


# Every trainer make_trainer built; a test's teardown closes them, so each gives its run up as `trajgate train` does.
made: list[Trainer] = []


def make_trainer(
    url: str, tmp_path: Path, tiny: str, echo: Callable[[str], None] = lambda line: None, **options: object
) -> Trainer:
    settings = load_settings(_env_file=None, database_url=url, checkpoint_dir=tmp_path / "ckpt")
    trainer = Trainer(
        settings,
        TrainerOptions(
            run="loop", backend="hf", device="cpu", base_weights=tiny, poll_s=0.05, publish=False, **options
        ),
        echo=echo,
    )
    made.append(trainer)
    return trainer
