"""The tool conversation recorded from real vLLM + SmolLM2 as the gateway records it (four calls whose lineage is
known: extends, extends, template_dropped_tool_call, extends), and the ways a writer may store calls: what the
token-lineage and message-storage tests write, then read back."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Engine, update

from gateway.store.call_record import CallRecord
from gateway.store.models import Trajectory
from gateway.store.records import LineageCache, write_calls
from tests.support.factories import make_record
from tests.support.fake_upstream import FIXTURES

TURNS = ("conversation_turn1", "conversation_turn2_tool_call", "conversation_turn2_tool_result", "conversation_turn3")


def _turn_record(name: str, seq: int, trajectory_id: str = "traj-1", **overrides: Any) -> CallRecord:
    """A call as the gateway records it from one recorded exchange."""
    fixture: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    response = fixture["response"]
    choice = response["choices"][0]
    fields = {
        "seq": seq,
        "request": fixture["request"],
        "response": {"choices": [{"index": 0, "message": choice["message"], "finish_reason": choice["finish_reason"]}]},
        "prompt_token_ids": response["prompt_token_ids"],
        "completion_token_ids": choice["token_ids"],
        "completion_logprobs": [entry["logprob"] for entry in choice["logprobs"]["content"]],
        "finish_reason": choice["finish_reason"],
        **overrides,
    }
    return make_record(trajectory_id, **fields)


def conversation(trajectory_id: str = "traj-1") -> list[CallRecord]:
    return [_turn_record(name, seq, trajectory_id) for seq, name in enumerate(TURNS, start=1)]


BATCHINGS = ["one_batch", "a_batch_per_call", "a_batch_per_call_cold"]


def write_batched(engine: Engine, calls: list[CallRecord], batching: str) -> None:
    """Write the calls as the writer may: all in one batch, one per batch with the writer's predecessor cache, or one
    per batch with none (another gateway process, or a restart, wrote the predecessor: the store must rebuild it)."""
    if batching == "one_batch":
        write_calls(engine, calls)
        return
    cache = None if batching.endswith("cold") else LineageCache()
    for call in calls:
        write_calls(engine, [call], cache)


def set_reward(engine: Engine, trajectory_id: str, reward: float = 1.0) -> None:
    """The trajectory's reward, straight in the store (the trainer's load reads rewarded trajectories only)."""
    with engine.begin() as conn:
        conn.execute(update(Trajectory).where(Trajectory.trajectory_id == trajectory_id).values(reward=reward))
