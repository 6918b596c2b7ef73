"""The gateway in front of a real vLLM CPU server, driven by the OpenAI SDK like an agent would."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessage

from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.hermes_tool_calls import tool_call_in
from tests.support.stored import stored_calls
from trainer.demo.vllm_cpu import ensure_smollm2
from trainer.samples import CallData, GroupData, TrajectoryData, build_samples

CALL_FIELDS = [f.name for f in fields(CallData)]

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


@pytest.fixture(scope="module")
def tokenizer(vllm_model_name: str) -> Any:
    """SmolLM2's tokenizer from the weights vLLM serves: what turns the captured ids back into text."""
    if vllm_model_name != "smollm2":
        pytest.skip("detokenizing needs the served model's tokenizer; only smollm2's is at hand")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_smollm2())


def extends(previous: dict, following: dict) -> bool:
    prefix = previous["prompt_token_ids"] + previous["completion_token_ids"]
    return following["prompt_token_ids"][: len(prefix)] == prefix


def tool_call_turn(message: ChatCompletionMessage) -> tuple[dict, str]:
    """The assistant turn the client sends back after asking for a tool, and the id of its call.

    The model's own call when vLLM parsed one; otherwise the client builds it, as an agent framework that forces a
    tool would: whether a 135M model emits well-formed hermes markup is up to the model (on some CPU builds it does
    not), and the history a client sends next is the client's business. Capture must hold either way.
    """
    if message.tool_calls:
        return message.model_dump(exclude_none=True), message.tool_calls[0].id
    call = {"id": "call_weather_paris", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}  # fmt: skip
    return {"role": "assistant", "content": None, "tool_calls": [call]}, call["id"]


def test_three_turn_conversation_with_tool_result(real_gateway: RunningGateway, pg_url: str, tokenizer: Any) -> None:
    # Evaluation mode keeps the client's temperature 0 (train mode samples at 1, `gateway.proxy.sampling`): greedy replies
    # keep the decoded-text comparisons below about capture, not about odd bytes a random sample may end on. Nothing
    # asserted depends on what the model says: every expectation is derived from the ids vLLM returned.
    client = openai.OpenAI(
        base_url=real_gateway.url + "/eval/g/conv/t/conv-1/v1", api_key="sk", max_retries=0
    )
    messages: list[dict] = [{"role": "user", "content": "Say hello in one short sentence."}]
    sent: list[list[dict]] = [[*messages]]
    first = client.chat.completions.create(model="agent", messages=messages, max_tokens=24, temperature=0)
    messages.append({"role": "assistant", "content": first.choices[0].message.content})
    messages.append({"role": "user", "content": "What is the weather in Paris?"})
    sent.append([*messages])
    second = client.chat.completions.create(
        model="agent", messages=messages, max_tokens=48, temperature=0, tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assistant, call_id = tool_call_turn(second.choices[0].message)
    messages.append(assistant)
    messages.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temp_c": 18, "sky": "clear"})})
    sent.append([*messages])
    third = client.chat.completions.create(model="agent", messages=messages, max_tokens=24, temperature=0)
    real_gateway.flush()

    calls = stored_calls(pg_url, "conv-1")
    assert len(calls) == 3 and calls[0]["seq"] < calls[1]["seq"] < calls[2]["seq"]  # every call, in order
    assert [c["choice_index"] for c in calls] == [0, 0, 0]
    assert all(c["trainable"] and c["group"]["group_id"] == "conv" for c in calls)
    assert all(len(c["completion_token_ids"]) == len(c["completion_logprobs"]) > 0 for c in calls)
    for call, reply, history in zip(calls, (first, second, third), sent):
        # The captured prompt is the one this call sent: it ends with the client's last message and the generation
        # prompt (the template's own rendering of the rest is vLLM's business).
        prompt = tokenizer.decode(call["prompt_token_ids"], skip_special_tokens=False)
        assert prompt.endswith(history[-1]["content"] + "<|im_end|>\n<|im_start|>assistant\n"), prompt[-200:]
        # The captured completion is what the client was shown: the text, or the tool call parsed from the markup.
        message = reply.choices[0].message
        if message.tool_calls:
            block = tool_call_in(tokenizer.decode(call["completion_token_ids"], skip_special_tokens=False))
            parsed = message.tool_calls[0].function
            assert block is not None and block["name"] == parsed.name
            assert block["arguments"] == json.loads(parsed.arguments)
        else:
            text = tokenizer.decode(call["completion_token_ids"], skip_special_tokens=True)
            assert text == (message.content or ""), (text, message.content)

    # SmolLM2's template renders an assistant turn's content only, so a tool-call turn comes back as an empty
    # assistant message (docs/design.md §4): turn 3's prompt holds none of turn 2's reply but its end-of-turn token.
    reply_tokens = [t for t in calls[1]["completion_token_ids"] if t != tokenizer.eos_token_id]
    assert not reply_tokens or not extends(calls[1], calls[2])
    # The trainer merges a call into the previous one's row exactly when its prompt extends that row, and starts a
    # new row otherwise; trained tokens are exactly the replies, with vLLM's logprobs.
    trajectory = TrajectoryData("conv-1", 1.0, [CallData(**{f: c[f] for f in CALL_FIELDS}) for c in calls])
    baseline = TrajectoryData("conv-2", 0.0, trajectory.calls)
    batch = build_samples([GroupData("conv", [trajectory, baseline])])
    rows = [row for row in batch.rows if row.trajectory_id == "conv-1"]
    segments: list[list[dict]] = [[calls[0]]]
    for previous, following in zip(calls, calls[1:]):
        if extends(previous, following):
            segments[-1].append(following)
        else:
            segments.append([following])
    assert batch.stats["merged_calls"] == 2 * (len(calls) - len(segments))
    assert len(rows) == len(segments)
    for row, segment in zip(rows, segments):
        assert row.input_ids == segment[-1]["prompt_token_ids"] + segment[-1]["completion_token_ids"]
        trained = [lp for lp, m in zip(row.behaviour_logprobs, row.loss_mask) if m]
        assert trained == [lp for c in segment for lp in c["completion_logprobs"]]
        assert [t for t, m in zip(row.input_ids, row.loss_mask) if m] == [
            t for c in segment for t in c["completion_token_ids"]
        ]


def test_stream_ids_match_what_vllm_sent(real_gateway: RunningGateway, pg_url: str, tokenizer: Any) -> None:
    client = openai.OpenAI(base_url=real_gateway.base_url, api_key="sk", max_retries=0)
    stream = client.chat.completions.create(
        model="agent",
        messages=[{"role": "user", "content": "Count from one to five."}],
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
        # Evaluation mode keeps temperature 0 (see the three-turn test).
        extra_headers={"X-Trajectory-Id": "stream-1", "X-Group-Id": "gs", "X-Mode": "eval"},
    )
    prompt_ids: list[int] = []
    ids: list[int] = []
    text = ""
    for chunk in stream:
        extra = chunk.model_extra or {}
        prompt_ids = extra.get("prompt_token_ids") or prompt_ids
        for choice in chunk.choices:
            ids.extend((choice.model_extra or {}).get("token_ids") or [])
            text += choice.delta.content or ""
        assert not any(choice.logprobs for choice in chunk.choices)  # not asked for, so stripped
    real_gateway.flush()
    (stored,) = stored_calls(pg_url, "stream-1")
    assert stored["prompt_token_ids"] == prompt_ids and stored["completion_token_ids"] == ids
    assert len(stored["completion_logprobs"]) == len(ids) and stored["trainable"]
    assert tokenizer.decode(stored["completion_token_ids"], skip_special_tokens=True) == text
