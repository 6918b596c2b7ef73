"""Anthropic SDK agents through the gateway's /v1/messages, in front of real vLLM CPU + SmolLM2.

The tool loop is tests/support/messages_agent.py's (a tool_result follows turn 1 whatever the model answered). Nothing
asserted depends on what the model says: every expectation is derived from the ids vLLM returned and the Message
the SDK built from them. The first test runs greedy (eval mode) so the decoded text comparisons are about capture,
not about a random sample ending inside a UTF-8 sequence; the second trains a train-mode group one step.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from gateway.store.lineage import EXTENDS
from tests.e2e.one_step import reward_and_train_one_step
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.hermes_tool_calls import tool_call_in
from tests.support.messages_agent import tool_loop, tool_uses
from tests.support.stored import stored_calls
from tests.support.token_in_agent import continues_exactly
from trainer.demo.vllm_cpu import ensure_smollm2

TOKEN_RUN = "messages-token-in"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_smollm2())


@pytest.fixture
def gateway(vllm_base_url: str, tmp_path: Path) -> Any:
    url = f"sqlite:///{tmp_path}/trajgate.db"
    with running_gateway(
        database_url=url, upstream_url=vllm_base_url, base_model="smollm2", spool_dir=tmp_path / "spool"
    ) as gw:
        yield gw, url


def assert_client_saw_the_recorded_ids(answer: Any, call: dict[str, Any], tokenizer: Any) -> None:
    """The Message's blocks are what the recorded completion ids decode to: a tool_use is the hermes markup vLLM
    parsed (name and input), a text block the decoded text."""
    decoded = tokenizer.decode(call["completion_token_ids"], skip_special_tokens=True)
    calls = tool_uses(answer)
    if calls:
        block = tool_call_in(tokenizer.decode(call["completion_token_ids"], skip_special_tokens=False))
        assert block is not None and (block["name"], block["arguments"]) == (calls[0].name, calls[0].input)
    else:
        assert decoded == "".join(b.text for b in answer.content if b.type == "text"), decoded
    assert answer.usage.output_tokens == len(call["completion_token_ids"]) == len(call["completion_logprobs"])
    assert answer.usage.input_tokens == len(call["prompt_token_ids"])


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_anthropic_tool_loop_is_recorded_as_the_client_saw_it(
    gateway: tuple[RunningGateway, str], tokenizer: Any, stream: bool
) -> None:
    gw, url = gateway
    trajectory = f"m-{uuid.uuid4().hex[:8]}"
    sdk = anthropic.Anthropic(base_url=f"{gw.url}/eval/g/{trajectory}/t/{trajectory}", api_key="x", max_retries=0)
    turns = tool_loop(sdk, stream)
    gw.flush()
    calls = stored_calls(url, trajectory)
    assert len(calls) == 3 and all(c["endpoint"] == "messages" and c["trainable"] for c in calls)
    for turn, call in zip(turns, calls):
        assert_client_saw_the_recorded_ids(turn["answer"], call, tokenizer)
        # the prompt is this turn's history: its last message (a question or the tool result) is in it
        last = turn["messages"][-1]["content"]
        text = last if isinstance(last, str) else last[0]["content"]
        assert text in tokenizer.decode(call["prompt_token_ids"], skip_special_tokens=False)


def test_a_group_of_anthropic_agents_trains_one_step(
    gateway: tuple[RunningGateway, str], vllm_base_url: str, tmp_path: Path, tokenizer: Any
) -> None:
    gw, url = gateway
    body = {
        "name": TOKEN_RUN,
        "base_model": "smollm2",
        "base_weights": str(ensure_smollm2()),
        "config": {"token_mode": "token_in", "groups_per_step": 1, "learning_rate": 1e-4, "max_seq_len": 2048},
    }
    response = httpx.post(gw.url + "/v1/runs", json=body, timeout=30)
    assert response.status_code in (200, 201), response.text
    group = f"g-{uuid.uuid4().hex[:8]}"
    trajectories = {f"{group}-stream": True, f"{group}-plain": False}
    for trajectory, stream in trajectories.items():
        sdk = anthropic.Anthropic(base_url=f"{gw.url}/g/{group}/n/2/t/{trajectory}", api_key="x", max_retries=0)
        tool_loop(sdk, stream, model=TOKEN_RUN)  # train mode: the gateway samples neutral, whatever the client asks
    gw.flush()
    tokens = 0
    for trajectory in trajectories:
        calls = stored_calls(url, trajectory)
        assert len(calls) == 3 and all(c["trainable"] for c in calls), [c["untrainable_reason"] for c in calls]
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        for before, after in zip(calls, calls[1:]):
            if continues_exactly(before, end):  # else (a cut or unparseable tool call) a new segment is right
                assert after["merge_reason"] == EXTENDS
        tokens += sum(len(c["completion_token_ids"]) for c in calls)
    rewards = [(trajectory, float(reward)) for reward, trajectory in enumerate(trajectories)]
    metrics = reward_and_train_one_step(gw.url, url, vllm_base_url, TOKEN_RUN, rewards, tmp_path)
    assert metrics["trainable_tokens"] == tokens
    assert metrics["publish_error"] is None
