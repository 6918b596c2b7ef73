"""A group of four agent trajectories for judge tests and for recording judge answers from real vLLM
(`scripts/record_judge_fixtures.py`): the same task, a shared system prompt, tool calls, tool results and final
answers, two right and two wrong. Written straight into the store as recorded calls."""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy import Engine

from gateway.store.call_record import CallRecord
from gateway.store.records import write_calls
from tests.support.factories import make_record

SYSTEM = "You are a shopping assistant. Use the calculator tool for arithmetic when it helps."
TASK = "Pencils cost $0.35 each. How much do 12 pencils cost? Answer with the total in dollars."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
IDS = ("j-1", "j-2", "j-3", "j-4")
GROUP = "jg-1"
RUN = "judge-run"


def _tool_call(call_id: str, expression: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
    }


# Each trajectory: the turns after the shared context, as (assistant message, tool result or None).
SCRIPTS: dict[str, list[tuple[dict[str, Any], str | None]]] = {
    "j-1": [  # right, with the tool
        ({"role": "assistant", "content": None, "tool_calls": [_tool_call("call_1", "12 * 0.35")]}, "4.2"),
        ({"role": "assistant", "content": "12 pencils cost $4.20."}, None),
    ],
    "j-2": [  # right, directly
        ({"role": "assistant", "content": "12 x $0.35 = $4.20. The total is $4.20."}, None),
    ],
    "j-3": [  # wrong, directly
        ({"role": "assistant", "content": "12 pencils cost $3.50."}, None),
    ],
    "j-4": [  # wrong tool call, wrong answer
        ({"role": "assistant", "content": None, "tool_calls": [_tool_call("call_9", "12 + 0.35")]}, "12.35"),
        ({"role": "assistant", "content": "The total is $12.35."}, None),
    ],
}


def shared_messages() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]


def trajectory_records(
    trajectory_id: str,
    turns: list[tuple[dict[str, Any], str | None]],
    *,
    run: str = RUN,
    group: str = GROUP,
    size: int | None = 4,
    start: float | None = None,
) -> list[CallRecord]:
    """The calls an agent keeping its history makes: each request is the previous one plus the reply and the tool
    result; the response holds the reply."""
    records = []
    messages = shared_messages()
    created = start if start is not None else time.time() - 3600
    for seq, (reply, tool_result) in enumerate(turns, start=1):
        request = {"model": run, "messages": list(messages), "tools": TOOLS}
        finish = "tool_calls" if reply.get("tool_calls") else "stop"
        response = {
            "id": f"chatcmpl-{trajectory_id}-{seq}",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": reply, "finish_reason": finish}],
        }
        records.append(
            make_record(
                trajectory_id,
                seq,
                seed=seq,
                run=run,
                group_id=group,
                group_size=size,
                request=request,
                response=response,
                finish_reason=finish,
                created_at=created + seq,
            )
        )
        messages.append(reply)
        if tool_result is not None:
            call_id = reply["tool_calls"][0]["id"]
            messages.append({"role": "tool", "tool_call_id": call_id, "content": tool_result})
    return records


def write_group(
    engine: Engine,
    *,
    run: str = RUN,
    group: str = GROUP,
    ids: tuple[str, ...] = IDS,
    size: int | None = 4,
    long_tool_output: int = 0,
    start: float | None = None,
) -> list[str]:
    """Write the four trajectories (renamed to `ids`) as recorded calls; `long_tool_output` pads j-1's tool result
    to that many characters, for truncation tests. Returns the trajectory ids."""
    records: list[CallRecord] = []
    for trajectory_id, (name, turns) in zip(ids, SCRIPTS.items()):
        if long_tool_output and name == "j-1":
            padding = "".join(f"row {i}: 0.35\n" for i in range(long_tool_output // 13 + 1))[:long_tool_output]
            turns = [(turns[0][0], padding + "\nresult: 4.2"), turns[1]]
        records += trajectory_records(trajectory_id, turns, run=run, group=group, size=size, start=start)
    write_calls(engine, records)
    return list(ids)
