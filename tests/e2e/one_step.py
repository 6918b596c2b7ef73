"""What several e2e tests end with: reward the trajectories they played, let the real trainer (hf backend, CPU) take
one step of the run, and read that step's metrics back, so each test asserts on what was trained."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx

from gateway.runs.settings import load_settings
from gateway.store import db
from gateway.store.runs import steps_after
from trainer.worker.loop import Trainer, TrainerOptions


def reward_and_train_one_step(
    gateway_url: str, db_url: str, upstream_url: str, run: str, rewards: Iterable[tuple[str, float]], workdir: Path
) -> dict[str, Any]:
    """POST each (trajectory, reward), train one step of `run`, and return the step's metrics."""
    for trajectory, reward in rewards:
        response = httpx.post(f"{gateway_url}/v1/trajectories/{trajectory}/reward", json={"reward": reward})
        assert response.status_code == 200, response.text
    settings = load_settings(_env_file=None, database_url=db_url, checkpoint_dir=workdir / "ckpt", upstream_url=upstream_url)
    options = TrainerOptions(run=run, backend="hf", device="cpu", poll_s=0.2, max_steps=1)
    with Trainer(settings, options) as trainer:
        assert trainer.run() == 1
    engine = db.make_engine(db_url)
    try:
        (step,) = steps_after(engine, run)
    finally:
        engine.dispose()
    return step["metrics"]
