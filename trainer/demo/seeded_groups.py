"""Rewarded groups written straight into a store, as if agents had played them through the gateway and posted
rewards: what a trainer needs to take steps without a gateway, vLLM or agent. The trainer tests seed their tiny
model's groups with it and bench/many_runs.py seeds SmolLM2's, so both write the same rows the gateway would."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from gateway.store.call_record import CallRecord
from gateway.store.records import write_calls
from gateway.store.rewards import RewardItem, store_rewards
from gateway.store.runs import upsert_run


@dataclass(frozen=True)
class SeededTrajectory:
    """One single-call trajectory of a group: the tokens the sampler saw and chose, its logprobs, its reward."""

    trajectory_id: str
    group_id: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    reward: float


def _record(run: str, base_model: str, trajectory: SeededTrajectory, group_size: int) -> CallRecord:
    prompt, completion = trajectory.prompt_token_ids, trajectory.completion_token_ids
    return CallRecord(
        id=uuid.uuid4().hex,
        run=run,
        base_model=base_model,
        trajectory_id=trajectory.trajectory_id,
        group_id=trajectory.group_id,
        group_size=group_size,
        mode="train",
        seq=1,
        choice_index=0,
        policy_version=0,
        endpoint="chat",
        stream=False,
        request={"model": run, "messages": [{"role": "user", "content": "(seeded)"}]},
        response={"choices": [{"message": {"role": "assistant", "content": "(seeded)"}}]},
        prompt_token_ids=list(prompt),
        completion_token_ids=list(completion),
        completion_logprobs=list(trajectory.completion_logprobs),
        finish_reason="stop",
        usage={"prompt_tokens": len(prompt), "completion_tokens": len(completion)},
        status_code=200,
        error=None,
        trainable=True,
        untrainable_reason=None,
        latency_ms=None,
        ttft_ms=None,
        retry_count=0,
        idempotency_key=None,
        created_at=time.time(),
    )


def seed_rewarded(
    engine: Engine,
    run: str,
    trajectories: Sequence[SeededTrajectory],
    *,
    config: dict[str, Any] | None = None,
    base_model: str = "base-model",
    base_weights: str | None = None,
) -> None:
    """Record the trajectories' calls and rewards; each group's expected size is how many of them it has, so every
    group is complete and ready once rewarded. `config`, when given, creates (or updates) the run first."""
    sizes: dict[str, int] = {}
    for trajectory in trajectories:
        sizes[trajectory.group_id] = sizes.get(trajectory.group_id, 0) + 1
    if config is not None:
        upsert_run(engine, run, config, base_model=base_model, base_weights=base_weights)
    write_calls(engine, [_record(run, base_model, t, sizes[t.group_id]) for t in trajectories])
    store_rewards(engine, [RewardItem(t.trajectory_id, t.reward) for t in trajectories])
