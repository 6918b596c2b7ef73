"""The OpenAI SDK tool loop that token_in's fixtures were recorded with and its tests replay (and the e2e runs live),
and how a test points it at a gateway: the run set to token_in, a client on a trajectory's eval URL.

Turn 1 asks for the weather with the repo's in-context tool example (SmolLM2's template ignores `tools`); whatever
the model answers is echoed back the way the SDK's users do; a tool result follows even when the model called no
tool (so the merge of turns is checked whatever it chose to say), then a closing user turn.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai

from scripts.record_fixtures import TOOL_EXAMPLE, WEATHER_QUESTION, WEATHER_RESULT, WEATHER_TOOL
from tests.support.gateway_harness import RunningGateway

RUN = "tokenin-agent"


def start_token_in(gateway: RunningGateway) -> None:
    body = {"name": RUN, "config": {"token_mode": "token_in"}}
    response = httpx.post(gateway.url + "/v1/runs", json=body, timeout=30)
    assert response.status_code in (200, 201), response.text


def client_for(gateway: RunningGateway, trajectory: str) -> openai.OpenAI:
    # eval mode: the client's greedy sampling reaches vLLM, as when the exchanges were recorded
    return openai.OpenAI(base_url=f"{gateway.url}/eval/t/{trajectory}/v1", api_key="x", max_retries=0)


def echoed(message: Any) -> dict[str, Any]:
    """The assistant message as an SDK agent appends it to its history (`message.model_dump(exclude_none=True)`)."""
    return message.model_dump(exclude_none=True)


def tool_loop(client: openai.OpenAI, stream: bool, turns: int = 3, **extra: Any) -> list[dict[str, Any]]:
    """Run the loop; returns per turn {messages sent, assistant message} (assistant as the SDK built it)."""
    messages: list[dict[str, Any]] = [*TOOL_EXAMPLE, {"role": "user", "content": WEATHER_QUESTION}]
    kwargs: dict[str, Any] = {"model": RUN, "tools": [WEATHER_TOOL], "max_tokens": 48, "temperature": 0, **extra}
    out = []
    for turn in range(turns):
        sent = list(messages)
        assistant = _ask(client, sent, stream, kwargs)
        out.append({"messages": sent, "assistant": assistant})
        messages.append(assistant)
        if turn == 0:
            calls = assistant.get("tool_calls") or [{"id": "call-0"}]
            messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": WEATHER_RESULT})
        else:
            messages.append({"role": "user", "content": "Thanks! And what should I wear?"})
    return out


def _ask(client: openai.OpenAI, messages: list[dict[str, Any]], stream: bool, kwargs: dict[str, Any]) -> dict[str, Any]:
    if not stream:
        return echoed(client.chat.completions.create(messages=messages, **kwargs).choices[0].message)
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    chunks = client.chat.completions.create(
        messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.delta.content:
                content.append(choice.delta.content)
            for delta in choice.delta.tool_calls or ():
                empty = {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                slot = calls.setdefault(delta.index, empty)
                slot["id"] = delta.id or slot["id"]
                if delta.function is not None:
                    slot["function"]["name"] += delta.function.name or ""
                    slot["function"]["arguments"] += delta.function.arguments or ""
    assistant: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        assistant["tool_calls"] = [calls[i] for i in sorted(calls)]
    return assistant


def arguments(assistant: dict[str, Any]) -> list[Any]:
    return [json.loads(c["function"]["arguments"]) for c in assistant.get("tool_calls") or ()]


def continues_exactly(call: dict[str, Any], end_token_id: int) -> bool:
    """Whether token_in can continue this recorded answer exactly: it ended on the model's end token (not cut by
    max_tokens) and every tool call it made has arguments a client can hand back unchanged (a JSON object). At
    temperature 1 a 135M model sometimes does neither; then the next call rightly starts a new segment."""
    ids = call["completion_token_ids"] or []
    if call["finish_reason"] == "length" or not ids or ids[-1] != end_token_id:
        return False
    for tool_call in (call["response"]["choices"][0]["message"].get("tool_calls") or ()):
        try:
            if not isinstance(json.loads(tool_call["function"]["arguments"] or ""), dict):
                return False
        except ValueError:
            return False
    return True
