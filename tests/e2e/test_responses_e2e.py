"""An OpenAI Agents SDK agent (`OpenAIResponsesModel` pointed at the gateway, one function tool) against real vLLM
CPU + SmolLM2: its Responses calls are recorded with ids that detokenize to what the agent was shown, and a group of
two such trajectories trains one step.

Train mode (temperature 1), so what the model says varies: every assertion is derived from what the agent received
and what was recorded, never from what the model chose (a trajectory may call the tool or not, and may stop at the
turn limit). One trajectory chains its calls by `previous_response_id` (the gateway's memory), the other resends every
item as the SDK does by default; one streams, the other does not. A token_in run, so a trajectory's turns extend each
other's exact ids whatever the chat template does with tool calls.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    ModelResponse,
    ModelSettings,
    OpenAIResponsesModel,
    RunHooks,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from gateway.store.lineage import EXTENDS
from scripts.record_fixtures import TOOL_SYSTEM, WEATHER_RESULT
from tests.e2e.one_step import reward_and_train_one_step
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.responses_agent import TOOL_ITEMS
from tests.support.stored import stored_calls, tree_rows
from tests.support.token_in_agent import continues_exactly
from trainer.demo.vllm_cpu import ensure_smollm2

RUN = "agents-sdk"
MAX_TURNS = 4
TOOL_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@function_tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return WEATHER_RESULT


class Seen(RunHooks[Any]):
    """Every model answer the agent received, in order (kept even if the run stops at its turn limit)."""

    def __init__(self) -> None:
        self.responses: list[ModelResponse] = []
        self.cut = 0  # 1 when the run stopped on an answer cut by max_output_tokens (recorded, never handed over)

    async def on_llm_end(self, context: Any, agent: Any, response: ModelResponse) -> None:
        self.responses.append(response)


async def run_agent(gw: RunningGateway, group: str, trajectory: str, stream: bool, chain: bool) -> Seen:
    client = AsyncOpenAI(base_url=f"{gw.url}/g/{group}/n/2/t/{trajectory}/v1", api_key="x", max_retries=0)
    agent = Agent(
        name="weather",
        instructions=TOOL_SYSTEM,
        model=OpenAIResponsesModel(model=RUN, openai_client=client),
        tools=[get_weather],
        model_settings=ModelSettings(max_tokens=48),
    )
    seen = Seen()
    items: Any = list(TOOL_ITEMS)
    try:
        if stream:
            result = Runner.run_streamed(
                agent, items, max_turns=MAX_TURNS, hooks=seen, auto_previous_response_id=chain
            )
            async for _ in result.stream_events():
                pass
        else:
            await Runner.run(agent, items, max_turns=MAX_TURNS, hooks=seen, auto_previous_response_id=chain)
    except MaxTurnsExceeded:
        pass  # the model kept calling the tool: what it did so far is still recorded and checked
    except ModelBehaviorError as exc:
        if "max_output_tokens" not in str(exc):
            raise
        seen.cut = 1  # a streamed answer cut by max tokens ends the SDK's run: the calls before it are still checked
    return seen


@pytest.fixture
def gateway(vllm_base_url: str, tmp_path: Path) -> Any:
    url = f"sqlite:///{tmp_path}/trajgate.db"
    with running_gateway(
        database_url=url, upstream_url=vllm_base_url, base_model="smollm2", spool_dir=tmp_path / "spool"
    ) as gw:
        body = {
            "name": RUN,
            "base_model": "smollm2",
            "base_weights": str(ensure_smollm2()),
            "config": {"token_mode": "token_in", "groups_per_step": 1, "learning_rate": 1e-4, "max_seq_len": 2048},
        }
        response = httpx.post(gw.url + "/v1/runs", json=body, timeout=30)
        assert response.status_code in (200, 201), response.text
        yield gw, url


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_smollm2())


def assert_recorded_what_the_agent_saw(response: ModelResponse, call: dict[str, Any], tokenizer: Any) -> None:
    assert call["endpoint"] == "responses" and call["trainable"], call["untrainable_reason"]
    assert call["id"] == "req-" + (response.response_id or "").removeprefix("resp_")
    completion = tokenizer.decode(call["completion_token_ids"], skip_special_tokens=True)
    text = "".join(
        part.text for item in response.output if item.type == "message" for part in item.content
        if part.type == "output_text"
    )  # fmt: skip
    calls = [item for item in response.output if item.type == "function_call"]
    if calls:
        blocks = [json.loads(block) for block in TOOL_CALL_RE.findall(completion)]
        assert [(b["name"], b["arguments"]) for b in blocks] == [(c.name, json.loads(c.arguments)) for c in calls]
    else:
        assert completion == text, (completion, text)


def test_agents_sdk_agent_is_recorded_and_trains(
    gateway: tuple[RunningGateway, str], vllm_base_url: str, tmp_path: Path, tokenizer: Any
) -> None:
    set_tracing_disabled(True)
    gw, url = gateway
    group = f"a-{uuid.uuid4().hex[:8]}"
    plans = {f"{group}-chained-stream": (True, True), f"{group}-items-plain": (False, False)}
    seen = {t: asyncio.run(run_agent(gw, group, t, stream, chain)) for t, (stream, chain) in plans.items()}
    gw.flush()

    for trajectory, agent_saw in seen.items():
        calls = stored_calls(url, trajectory)
        assert len(calls) == len(agent_saw.responses) + agent_saw.cut >= 1
        for response, call in zip(agent_saw.responses, calls):
            assert_recorded_what_the_agent_saw(response, call, tokenizer)
        # every later turn (after a tool result, or a chained call) extends the exact ids of the one before, when
        # that one can be continued exactly
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        for before, after in zip(calls, calls[1:]):
            if continues_exactly(before, end):
                assert after["merge_reason"] == EXTENDS
                head = before["prompt_token_ids"] + before["completion_token_ids"]
                assert after["prompt_token_ids"][: len(head)] == head
        tool_calls = sum(item.type == "function_call" for r in agent_saw.responses for item in r.output)
        print(f"{trajectory}: {len(calls)} Responses calls, {tool_calls} function calls")

    rewards = [(trajectory, float(reward)) for reward, trajectory in enumerate(seen)]
    metrics = reward_and_train_one_step(gw.url, url, vllm_base_url, RUN, rewards, tmp_path)
    calls = [c for trajectory in seen for c in stored_calls(url, trajectory)]
    # one token sequence per root of each trajectory's call tree, plus one per fork
    assert metrics["rows"] == sum(tree_rows(stored_calls(url, trajectory)) for trajectory in seen)
    assert metrics["trainable_tokens"] == sum(len(c["completion_token_ids"]) for c in calls)
    assert metrics["publish_error"] is None
