"""The gateway in front of a real vLLM CPU server, driven by the OpenAI SDK like an agent would."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.gateway_harness import RunningGateway, running_gateway
from tests.stored import stored_calls

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture
def real_gateway(vllm_base_url: str, vllm_model_name: str, pg_url: str, tmp_path: Path) -> Iterator[RunningGateway]:
    with running_gateway(
        database_url=pg_url, upstream_url=vllm_base_url, base_model=vllm_model_name, spool_dir=tmp_path / "spool"
    ) as gw:
        yield gw


def extends(previous: dict, following: dict) -> bool:
    prefix = previous["prompt_token_ids"] + previous["completion_token_ids"]
    return following["prompt_token_ids"][: len(prefix)] == prefix


def test_three_turn_conversation_with_tool_result(real_gateway: RunningGateway, pg_url: str) -> None:
    client = openai.OpenAI(
        base_url=real_gateway.url + "/g/conv/t/conv-1/v1", api_key="sk", max_retries=0
    )
    messages: list[dict] = [{"role": "user", "content": "Say hello in one short sentence."}]
    first = client.chat.completions.create(model="agent", messages=messages, max_tokens=24, temperature=0)
    messages.append({"role": "assistant", "content": first.choices[0].message.content})
    # Named tool_choice is not enforced by vLLM 0.32 CPU: the question is one SmolLM2 answers with a valid call.
    messages.append({"role": "user", "content": "What is the weather in Paris?"})
    second = client.chat.completions.create(
        model="agent", messages=messages, max_tokens=48, temperature=0, tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = second.choices[0].message.tool_calls[0]
    messages.append(second.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18, "sky": "clear"})})
    third = client.chat.completions.create(model="agent", messages=messages, max_tokens=24, temperature=0)
    assert third.choices[0].message.content
    real_gateway.flush()

    calls = stored_calls(pg_url, "conv-1")
    assert len(calls) == 3 and all(c["trainable"] for c in calls)
    assert all(len(c["completion_token_ids"]) == len(c["completion_logprobs"]) > 0 for c in calls)
    # A plain chat turn extends the previous prompt + completion exactly: the trainer can merge it.
    assert extends(calls[0], calls[1])
    # SmolLM2's template drops an assistant message's tool_calls, so the turn after a tool call does not
    # extend it (DESIGN §3); the trainer must start a new row there. Report what we see.
    print(f"turn 3 extends turn 2 after a tool call: {extends(calls[1], calls[2])}")


def test_stream_ids_match_what_vllm_sent(real_gateway: RunningGateway, pg_url: str) -> None:
    client = openai.OpenAI(base_url=real_gateway.base_url, api_key="sk", max_retries=0)
    stream = client.chat.completions.create(
        model="agent",
        messages=[{"role": "user", "content": "Count from one to five."}],
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
        extra_headers={"X-Trajectory-Id": "stream-1", "X-Group-Id": "gs"},
    )
    prompt_ids: list[int] = []
    ids: list[int] = []
    for chunk in stream:
        extra = chunk.model_extra or {}
        prompt_ids = extra.get("prompt_token_ids") or prompt_ids
        for choice in chunk.choices:
            ids.extend((choice.model_extra or {}).get("token_ids") or [])
        assert not any(choice.logprobs for choice in chunk.choices)  # not asked for, so stripped
    real_gateway.flush()
    (stored,) = stored_calls(pg_url, "stream-1")
    assert stored["prompt_token_ids"] == prompt_ids and stored["completion_token_ids"] == ids
    assert len(stored["completion_logprobs"]) == len(ids) and stored["trainable"]
