"""The OpenAI Agents SDK handoff (examples/agents_sdk_handoff.py) as the fixture recorder ran it and the fast tests
replay it: one question, in evaluation mode with greedy sampling (a RunConfig over the agents' settings), so a
re-record gives the same tokens and the replay sends vLLM exactly the recorded requests. One recording per token mode
(tests/fixtures/vllm/tree_handoff_<mode>.json, the gateway's upstream exchanges)."""

from __future__ import annotations

import asyncio

from agents import ModelSettings, RunConfig

from tests.support.examples import load_example

RUNS = {"chat": "handoff-chat", "token_in": "handoff-tokenin"}
GREEDY = RunConfig(model_settings=ModelSettings(temperature=0), tracing_disabled=True)


handoff = load_example("agents_sdk_handoff")
QUESTION = handoff.TRAIN[0][0]


def play(gateway_url: str, mode: str, trajectory: str) -> str:
    """The recorded episode through the gateway at `gateway_url`, on the run of `mode`; the final answer."""
    base_url = f"{gateway_url}/eval/t/{trajectory}/v1"
    return str(asyncio.run(handoff.run_agents(base_url, "x", RUNS[mode], QUESTION, GREEDY)))
