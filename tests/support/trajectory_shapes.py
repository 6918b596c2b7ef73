"""Trajectories of the shapes agents have, as CallRecords with exact ids, for storage tests and bench/storage.py.

Every prompt is built from the token chunks the agents have seen, and every chunk an agent adds (a user message, a
tool result, a completion, a summary) is fresh random ids, so a trajectory's distinct ids are counted exactly as they
are made: what its stored ids should stay close to, whatever its shape.

- `linear`: one chat, each call extending the previous prompt + completion.
- `supervisor`: a chat that hands every `every`-th call to a sub-agent (its own system prompt and a new task: a root
  of the call tree) and resumes with the sub-agent's answer as a tool result.
- `forks`: two branches after a common first call, their calls alternating (parallel tool agents, a tree search).
- `compaction`: a chat whose history is replaced by a summary every `every` calls.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.store.call_record import CallRecord
from tests.support.factories import make_record

SHAPES = ("linear", "supervisor", "forks", "compaction")
SYSTEM = [1, 9690, 198, 2610, 359, 253, 5356, 11173, 30, 2, 198]  # "<|im_start|>system\nYou are ...<|im_end|>\n"
SUB_SYSTEM = [1, 9690, 198, 2610, 359, 253, 1813, 7634, 30, 2, 198]
SUB_SYSTEM_SHARED = 6  # ids it starts with that SYSTEM starts with too


@dataclass
class _Agent:
    ids: list[int]
    messages: list[dict[str, Any]]


@dataclass
class Shaped:
    records: list[CallRecord]
    distinct: int  # distinct ids made: system prompts once each, every fresh chunk
    final: int  # the main agent's last prompt + completion, in ids
    calls: int = field(init=False)

    def __post_init__(self) -> None:
        self.calls = len(self.records)


def shaped(
    shape: str,
    turns: int,
    seed: int = 0,
    new_tokens: int = 40,
    completion_tokens: int = 20,
    every: int = 8,
    trajectory_id: str | None = None,
    run: str = "run-a",
    group_id: str = "group-1",
) -> Shaped:
    """`turns` calls of one trajectory of `shape` (SHAPES); each call adds `new_tokens` prompt ids (a user message,
    a tool result, a task or a summary) and answers `completion_tokens`."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: one of {SHAPES}")
    rng = random.Random(seed)
    trajectory = trajectory_id or uuid.uuid4().hex
    records: list[CallRecord] = []
    made = [len(SYSTEM)]

    def fresh(n: int) -> list[int]:
        made[0] += n
        return [rng.randrange(10, 49_000) for _ in range(n)]

    def start(system: list[int], name: str) -> _Agent:
        return _Agent(list(system), [{"role": "system", "content": name}])

    def call(agent: _Agent, role: str) -> list[int]:
        """The agent adds a message and calls; returns its completion (already in its history)."""
        chunk = fresh(new_tokens)
        agent.messages = [*agent.messages, {"role": role, "content": " ".join(map(str, chunk))}]
        prompt = agent.ids + chunk
        completion = fresh(completion_tokens)
        answer = {"role": "assistant", "content": " ".join(map(str, completion))}
        records.append(_record(trajectory, run, group_id, len(records) + 1, agent.messages, answer, prompt, completion))
        agent.ids = prompt + completion
        agent.messages = [*agent.messages, answer]
        return completion

    main = start(SYSTEM, "main")
    if shape == "linear":
        for _ in range(turns):
            call(main, "user")
    elif shape == "supervisor":
        made[0] += len(SUB_SYSTEM) - SUB_SYSTEM_SHARED
        role = "user"
        for turn in range(turns):
            if turn % every == every - 1:
                call(start(SUB_SYSTEM, "sub-agent"), "user")  # its answer is the supervisor's next tool result
                role = "tool"
            else:
                call(main, role)
                role = "user"
    elif shape == "forks":
        call(main, "user")
        branches = [_Agent(list(main.ids), list(main.messages)) for _ in range(2)]
        for turn in range(turns - 1):
            call(branches[turn % 2], "user")
        main = branches[(turns - 2) % 2] if turns > 1 else main
    else:  # compaction
        for turn in range(turns):
            if turn and turn % every == 0:
                summary = fresh(new_tokens)
                main = _Agent(SYSTEM + summary, [main.messages[0], {"role": "user", "content": f"summary {turn}"}])
            call(main, "user")
    return Shaped(records, made[0], len(main.ids))


def _record(
    trajectory_id: str,
    run: str,
    group_id: str,
    seq: int,
    messages: list[dict[str, Any]],
    answer: dict[str, Any],
    prompt: list[int],
    completion: list[int],
) -> CallRecord:
    return make_record(
        trajectory_id,
        seq,
        run=run,
        base_model="smollm2",
        group_id=group_id,
        request={"model": run, "messages": messages},
        response={"choices": [{"index": 0, "message": answer, "finish_reason": "stop"}]},
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=[-0.5] * len(completion),
        usage={"prompt_tokens": len(prompt), "completion_tokens": len(completion)},
        latency_ms=10.0,
        created_at=time.time() + seq * 1e-3,
    )
