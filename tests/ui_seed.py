"""A small run seeded through the store's own API, for the UI tests and the README screenshots: multi-turn tool
trajectories with known rewards, two committed steps (one group dropped, with its reason), a judge explanation,
evaluation trajectories on two policy versions, and one message carrying hostile HTML."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine

from gateway.store.records import write_calls
from gateway.store.rewards import RewardItem, store_rewards
from gateway.store.runs import record_train_step
from gateway.store.training import acquire_run_lease, claim_ready_groups, commit_step, drop_groups, publish_version
from tests.factories import make_record

RUN = "ui-run"
HOSTILE = '<script>alert("pwned")</script><img src=x onerror=alert(1)>'
SYSTEM = "You answer questions about the company directory. Use the tools."
# Group g0 and g1 get mixed rewards (trained at steps 1 and 2), g2 all zero (dropped for zero variance).
TRAIN_REWARDS = {"g0": [1.0, 0.0, 1.0, 0.0], "g1": [1.0, 1.0, 0.0, 0.0], "g2": [0.0, 0.0, 0.0, 0.0]}
EVAL_REWARDS = {0: [0.0, 1.0, 0.0, 0.0], 2: [1.0, 1.0, 0.0, 1.0]}
STEP_METRICS = [
    {"reward_mean": 0.5, "reward_std": 0.5, "loss": -0.0123, "ratio_mean": 1.001, "ratio_max": 1.31, "clip_frac": 0.02,
     "grad_norm": 0.81, "tokens_per_s": 412.0, "merge_ratio": 1.0, "groups_used": 1, "groups_dropped": 1,
     "drop_reasons": {"zero reward variance": 1}, "policy_version": 0},
    {"reward_mean": 0.625, "reward_std": 0.4841, "loss": 0.0045, "ratio_mean": 0.998, "ratio_max": 1.12,
     "clip_frac": 0.01, "grad_norm": 0.64, "tokens_per_s": 455.0, "merge_ratio": 1.0, "groups_used": 1,
     "groups_dropped": 0, "drop_reasons": {}, "policy_version": 1},
]  # fmt: skip


@dataclass
class Seeded:
    run: str = RUN
    trajectories: dict[str, list[str]] = field(default_factory=dict)  # group -> trajectory ids
    hostile_trajectory: str = ""


def _tool_call(query: str) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": json.dumps({"query": query})}}


def _episode(
    trajectory: str, group: str, mode: str, version: int, answer: str, question: str, seed: int, size: int
) -> list[Any]:
    """Two calls: the model calls `search`, then answers from the tool's result (the second prompt extends the
    first call's tokens, as in token_in mode)."""
    first_messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    call = _tool_call(question.split("'")[0][-20:] or "x")
    first = make_record(
        trajectory, seq=1, seed=seed, run=RUN, group_id=group, group_size=size, mode=mode, policy_version=version,
        request={"model": RUN, "messages": first_messages},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                               "finish_reason": "tool_calls"}]},
        finish_reason="tool_calls", completion_tokens=6, latency_ms=81.0,
    )  # fmt: skip
    second_messages = [
        *first_messages,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '[{"id": 7, "name": "Zenpri Ushven", "city": "Oslo"}]'},
    ]
    second = make_record(
        trajectory, seq=2, seed=seed + 1, run=RUN, group_id=group, group_size=size, mode=mode, policy_version=version,
        request={"model": RUN, "messages": second_messages},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]},
        prompt_token_ids=list(first.prompt_token_ids) + list(first.completion_token_ids) + [11, 12, 13],
        completion_tokens=5, latency_ms=64.0,
    )  # fmt: skip
    return [first, second]


def seed(engine: Engine) -> Seeded:
    """Write the run; every number the UI tests assert comes from the constants above."""
    out = Seeded()
    records: list[Any] = []
    seed_no = 0
    for group, rewards in TRAIN_REWARDS.items():
        ids = [f"{group}-t{i}" for i in range(len(rewards))]
        out.trajectories[group] = ids
        for i, tid in enumerate(ids):
            question = "In which city does Zenpri Ushven work?"
            if tid == "g0-t1":
                question = f"Ignore this: {HOSTILE}"
                out.hostile_trajectory = tid
            answer = "Oslo" if rewards[i] else "Stockholm"
            records += _episode(tid, group, "train", 0, answer, question, seed_no, len(rewards))
            seed_no += 2
    for version, rewards in EVAL_REWARDS.items():
        group = f"eval-v{version}"
        ids = [f"{group}-t{i}" for i in range(len(rewards))]
        out.trajectories[group] = ids
        for i, tid in enumerate(ids):
            answer = "Oslo" if rewards[i] else "Bergen"
            records += _episode(tid, group, "eval", version, answer, "Where does Ilo Marr work?", seed_no, len(rewards))
            seed_no += 2
    write_calls(engine, records)
    items = []
    for group, rewards in {**TRAIN_REWARDS, **{f"eval-v{v}": r for v, r in EVAL_REWARDS.items()}}.items():
        for tid, value in zip(out.trajectories[group], rewards, strict=True):
            metadata = {"judge": {"explanation": f"answer for {tid} checked against the directory", "model": "judge-x"}}
            items.append(RewardItem(tid, value, None, metadata if group == "g0" else None))
    store_rewards(engine, items)

    worker = "ui-test-worker"
    acquire_run_lease(engine, RUN, worker, 600)
    claimed = claim_ready_groups(engine, RUN, worker, 3, 600)
    assert sorted(claimed) == ["g0", "g1", "g2"], claimed
    seen = [t for g in claimed for t in out.trajectories[g]]
    drop_groups(engine, [("g2", "zero reward variance")], worker, trajectory_ids=seen)
    commit_step(engine, RUN, 1, worker, ["g0"], STEP_METRICS[0], trajectory_ids=out.trajectories["g0"],
                lease_holder=worker)  # fmt: skip
    publish_version(engine, RUN, 1, f"{RUN}@1", "/tmp/adapters/1")
    commit_step(engine, RUN, 2, worker, ["g1"], STEP_METRICS[1], trajectory_ids=out.trajectories["g1"],
                lease_holder=worker)  # fmt: skip
    publish_version(engine, RUN, 2, f"{RUN}@2", "/tmp/adapters/2")
    return out


def add_step(engine: Engine, step: int, reward_mean: float) -> None:
    """Another step's metrics, as the trainer would log it (the live-update test)."""
    record_train_step(engine, RUN, step, {**STEP_METRICS[1], "reward_mean": reward_mean})
