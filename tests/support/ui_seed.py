"""A small run seeded through the store's own API, for the UI tests and the README screenshots: multi-turn tool
trajectories with known rewards, two committed steps (one group dropped, with its reason), a judge explanation,
evaluation trajectories on two policy versions, one message carrying hostile HTML, one trajectory whose completion
ids are real SmolLM2 tokens (its page's token text is recorded from vLLM: tests/fixtures/vllm/ui_token_text.json),
and one shaped as a tree (a supervisor, its sub-agent, a fork)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine

from gateway.store.records import write_calls
from gateway.store.rewards import RewardItem, store_rewards
from gateway.store.runs import record_train_step
from gateway.store.training import acquire_run_lease, claim_ready_groups, commit_step, drop_groups, publish_version
from tests.support.factories import make_record

RUN = "ui-run"
HOSTILE = '<script>alert("pwned")</script><img src=x onerror=alert(1)>'
SYSTEM = "You answer questions about the company directory. Use the tools."
# Group g0 and g1 get mixed rewards (trained at steps 1 and 2), g2 all zero (dropped for zero variance).
TRAIN_REWARDS = {"g0": [1.0, 0.0, 1.0, 0.0], "g1": [1.0, 1.0, 0.0, 0.0], "g2": [0.0, 0.0, 0.0, 0.0]}
EVAL_REWARDS = {0: [0.0, 1.0, 0.0, 0.0], 2: [1.0, 1.0, 0.0, 1.0]}
# g0-t0's completion ids: SmolLM2's '<', 'tool', '_', 'call', '>', '\n' for the tool call, then 'Os', 'lo' and the
# three byte-level tokens of ' 東' (vLLM gives the first two '' and the third the whole character).
TOKEN_TEXT_TRAJECTORY = "g0-t0"
TOKEN_TEXT_IDS = ([44, 19324, 79, 4350, 46, 198], [11062, 5365, 17097, 247, 126])
TOKEN_TEXTS = (["<", "tool", "_", "call", ">", "\n"], ["Os", "lo", "", "", " 東"])
# g1-t0 is a tree: the supervisor delegates (turn 0), its sub-agent answers under its own system prompt (turn 1, a
# new root), the supervisor resumes from turn 0 (turn 2), a parallel branch also continues turn 0 (turn 3, a fork),
# and the supervisor goes on from turn 2 (turn 4).
TREE_TRAJECTORY = "g1-t0"
SUB_SYSTEM = "You are the directory researcher. Answer with one city."
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
    real = {"completion_token_ids": list(TOKEN_TEXT_IDS[0])} if trajectory == TOKEN_TEXT_TRAJECTORY else {}
    first = make_record(
        trajectory, seq=1, seed=seed, run=RUN, group_id=group, group_size=size, mode=mode, policy_version=version,
        request={"model": RUN, "messages": first_messages},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                               "finish_reason": "tool_calls"}]},
        finish_reason="tool_calls", completion_tokens=6, latency_ms=81.0, **real,
    )  # fmt: skip
    real = {"completion_token_ids": list(TOKEN_TEXT_IDS[1])} if trajectory == TOKEN_TEXT_TRAJECTORY else {}
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
        completion_tokens=5, latency_ms=64.0, **real,
    )  # fmt: skip
    return [first, second]


def _tree_episode(trajectory: str, group: str, answer: str, seed: int, size: int) -> list[Any]:
    """Five calls shaped as TREE_TRAJECTORY says; each prompt's ids extend its parent's prompt + completion ids, the
    sub-agent's share nothing with the supervisor's, so the store's own lookup builds the tree."""
    common = {"run": RUN, "group_id": group, "group_size": size, "mode": "train", "policy_version": 0}

    def answered(content: str | None, tool_calls: list[Any] | None = None) -> dict[str, Any]:
        message = {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}
        return {"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if tool_calls else "stop"}]}

    def extending(parent: Any, bridge: list[int]) -> list[int]:
        return list(parent.prompt_token_ids) + list(parent.completion_token_ids) + bridge

    delegate = {"id": "call_9", "type": "function",
                "function": {"name": "ask_researcher", "arguments": json.dumps({"task": "Where does Zenpri Ushven work?"})}}  # fmt: skip
    asked = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where does Zenpri Ushven work?"}]
    delegated = [*asked, {"role": "assistant", "content": None, "tool_calls": [delegate]}]
    plan = make_record(trajectory, seq=1, seed=seed, request={"model": RUN, "messages": asked},
                       response=answered(None, [delegate]), finish_reason="tool_calls", completion_tokens=6,
                       **common)  # fmt: skip
    sub_messages = [{"role": "system", "content": SUB_SYSTEM}, {"role": "user", "content": "Where does Zenpri Ushven work?"}]
    sub = make_record(trajectory, seq=2, seed=seed + 1, request={"model": RUN, "messages": sub_messages},
                      response=answered(answer), completion_tokens=3, **common)  # fmt: skip
    resumed_messages = [*delegated, {"role": "tool", "tool_call_id": "call_9", "content": answer}]
    resumed = make_record(trajectory, seq=3, seed=seed + 2, request={"model": RUN, "messages": resumed_messages},
                          response=answered(f"{answer}."), prompt_token_ids=extending(plan, [21, 22, 23]),
                          completion_tokens=4, **common)  # fmt: skip
    branch_messages = [*delegated, {"role": "tool", "tool_call_id": "call_9", "content": "Bergen, or Oslo"}]
    branch = make_record(trajectory, seq=4, seed=seed + 3, request={"model": RUN, "messages": branch_messages},
                         response=answered("Two candidates."), prompt_token_ids=extending(plan, [31, 32]),
                         completion_tokens=4, **common)  # fmt: skip
    checked_messages = [*resumed_messages, {"role": "assistant", "content": f"{answer}."},
                        {"role": "user", "content": "Are you sure?"}]  # fmt: skip
    checked = make_record(trajectory, seq=5, seed=seed + 4, request={"model": RUN, "messages": checked_messages},
                          response=answered("Yes."), prompt_token_ids=extending(resumed, [41, 42]),
                          completion_tokens=2, **common)  # fmt: skip
    return [plan, sub, resumed, branch, checked]


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
            if tid == TREE_TRAJECTORY:
                records += _tree_episode(tid, group, answer, seed_no, len(rewards))
            else:
                records += _episode(tid, group, "train", 0, answer, question, seed_no, len(rewards))
            seed_no += 5
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
