"""The Anthropic SDK tool loop that the messages fixtures were recorded with, the fast tests replay and the e2e runs
live (the Messages-API twin of tests/support/token_in_agent.py).

Turn 1 asks for the weather with the repo's in-context tool example (SmolLM2's template ignores `tools`); the answer
is echoed back whole, as Anthropic SDK agents do (`message.content` as the next assistant turn); a `tool_result`
follows even when the model called no tool (so every later turn is exercised whatever it chose to say), then a
closing user turn.
"""

from __future__ import annotations

from typing import Any

import anthropic
from anthropic.types import Message

from scripts.record_fixtures import TOOL_EXAMPLE, TOOL_SYSTEM, WEATHER_QUESTION, WEATHER_RESULT, WEATHER_TOOL

RUN = "messages-agent"
TOOL = {
    "name": WEATHER_TOOL["function"]["name"],
    "description": WEATHER_TOOL["function"]["description"],
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
# TOOL_EXAMPLE without its system message, which the Messages API takes apart.
HISTORY: list[dict[str, Any]] = [
    *(m for m in TOOL_EXAMPLE if m["role"] != "system"),
    {"role": "user", "content": WEATHER_QUESTION},
]
# The loop's first turn (train mode sends neutral sampling, which replay does not match on).
FIRST: dict[str, Any] = {
    "model": RUN,
    "system": TOOL_SYSTEM,
    "tools": [TOOL],
    "max_tokens": 48,
    "messages": HISTORY,
    "metadata": {"user_id": "agent-7"},
}
# The count_tokens request recorded beside the loop.
COUNT_TOKENS = {"model": RUN, "system": TOOL_SYSTEM, "messages": HISTORY, "tools": [TOOL]}
# A greedy call that stops on a stop sequence the model is known (from the recording) to produce.
STOP_CALL = {
    "model": RUN,
    "max_tokens": 32,
    "extra_body": {"temperature": 0},
    "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    "stop_sequences": ["Paris"],
}


def echoed(message: Message) -> dict[str, Any]:
    """The answer as an Anthropic SDK agent appends it to its history."""
    return {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]}


def tool_uses(message: Message) -> list[Any]:
    return [block for block in message.content if block.type == "tool_use"]


def tool_loop(client: anthropic.Anthropic, stream: bool, turns: int = 3, **extra: Any) -> list[dict[str, Any]]:
    """Run the loop; returns per turn {messages sent, the Message the SDK built}."""
    messages: list[dict[str, Any]] = list(HISTORY)
    kwargs: dict[str, Any] = {
        "model": RUN,
        "system": TOOL_SYSTEM,
        "tools": [TOOL],
        "max_tokens": 48,
        # greedy, so a re-record gives the same tokens (train mode sends neutral sampling whatever the client asks);
        # the SDK has no sampling arguments any more, the API still takes them
        "extra_body": {"temperature": 0},
        # reaches vLLM as `user`; it also keeps turn 1's chat body apart from the chat_tools recording's
        "metadata": {"user_id": "agent-7"},
        **extra,
    }
    out = []
    for turn in range(turns):
        sent = list(messages)
        answer = ask(client, sent, stream, kwargs)
        out.append({"messages": sent, "answer": answer})
        messages.append(echoed(answer))
        if turn == 0:
            calls = tool_uses(answer)
            tool_use_id = calls[0].id if calls else "toolu_0"
            result = {"type": "tool_result", "tool_use_id": tool_use_id, "content": WEATHER_RESULT}
            messages.append({"role": "user", "content": [result]})
        else:
            messages.append({"role": "user", "content": "Thanks! And what should I wear?"})
    return out


def ask(client: anthropic.Anthropic, messages: list[dict[str, Any]], stream: bool, kwargs: dict[str, Any]) -> Message:
    if not stream:
        return client.messages.create(messages=messages, **kwargs)  # type: ignore[arg-type]
    with client.messages.stream(messages=messages, **kwargs) as events:  # type: ignore[arg-type]
        return events.get_final_message()
