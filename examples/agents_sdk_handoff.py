"""An OpenAI Agents SDK triage agent that hands a question off to a specialist agent, trained by trajgate as one
trajectory.

Ordinary Agents SDK code: two `Agent`s, the triage one listing the specialist in `handoffs`, the run started with
`Runner.run`. The only trajgate-specific code is the client's `base_url` (harness.py names the group and trajectory)
and the reward POST. When the triage agent calls the handoff tool, the SDK runs the specialist on the conversation so
far under the specialist's own instructions: the gateway records that call as a new root of the same trajectory
(`new_root`: another system prompt) and the specialist's later calls as its children; the trainer trains each agent's
path as its own row, every sampled token once. Every question here is geography, so triage is told to hand off and
`tool_choice: required` makes it; a reply cut by max_tokens before the call closes is triage's answer, and that
episode is one path.

    python examples/agents_sdk_handoff.py train --gateway http://127.0.0.1:8000 --run demo --steps 10
    python examples/agents_sdk_handoff.py eval --gateway http://127.0.0.1:8000 --run demo --out eval.json

The task is short_answers.py's (one-word answers to factual questions, the same reward).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import openai
from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, set_tracing_disabled

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py and short_answers.py beside this script
from harness import Outcome, Task, main_for  # noqa: E402
from short_answers import HELD_OUT, INSTRUCTION, TRAIN, Question, describe, is_correct, reward  # noqa: E402

set_tracing_disabled(True)  # traces would go to OpenAI's servers
MAX_TOKENS = 48
MAX_TURNS = 4
# SmolLM2's chat template does not show the model its tools, so the triage instructions show the call (hermes markup,
# as vLLM's parser reads it); without it the constrained reply fills the empty arguments with whitespace.
TRIAGE = (
    "Hand every question off to the geographer: reply only with "
    '<tool_call>\n{"name": "transfer_to_geographer", "arguments": {}}\n</tool_call>'
)


def agents(client: openai.AsyncOpenAI, model: str) -> Agent:
    """The triage agent, with the specialist it may hand off to."""
    geographer = Agent(
        name="geographer",
        instructions=f"You are a geographer. {INSTRUCTION}",
        model=OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=ModelSettings(max_tokens=MAX_TOKENS),
    )
    return Agent(
        name="triage",
        instructions=TRIAGE,
        handoffs=[geographer],
        model=OpenAIResponsesModel(model=model, openai_client=client),
        # Every question here is geography, so triage always routes: `required` has vLLM constrain the reply to a
        # call of the handoff tool.
        model_settings=ModelSettings(max_tokens=MAX_TOKENS, tool_choice="required"),
    )


async def run_agents(base_url: str, api_key: str, model: str, question: str, config: RunConfig | None = None) -> str:
    """The question through triage and (once handed off) the geographer; the final answer. `config` overrides the
    agents' settings for the whole run (the fixture recorder and its replay sample greedily)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=3, timeout=300)
    try:
        result = await Runner.run(
            agents(client, model), f"{question} {INSTRUCTION}", max_turns=MAX_TURNS, run_config=config
        )
    finally:
        await client.close()
    return str(result.final_output or "")


def episode(client: openai.OpenAI, model: str, question: Question) -> Outcome:
    """One question through the agents (the harness's sync client names the trajectory; the SDK wants an async one)."""
    text, accepted = question
    answer = asyncio.run(run_agents(str(client.base_url), client.api_key, model, text))
    return Outcome(reward(answer, accepted), is_correct(answer, accepted), answer, -1)


TASK = Task(train=TRAIN, held_out=HELD_OUT, episode=episode, describe=describe)


if __name__ == "__main__":
    sys.exit(main_for(TASK, __doc__ or ""))
