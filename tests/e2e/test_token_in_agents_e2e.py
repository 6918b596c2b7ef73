"""token_in with a LangGraph ReAct agent against real vLLM CPU + SmolLM2: each trajectory becomes one exact token
sequence, the agent sees the same OpenAI shapes as in chat mode, an edited history starts a new segment, and the
trainer trains such a run end to end.

Train mode (temperature 1), so what the model says varies run to run: every assertion is derived from the recorded
calls, never from what the model chose. The agent is invoked twice (the question, then a follow-up on the whole
history), so every trajectory has at least two turns whether or not the model called the tool; the ReAct loop is cut
at a few tool rounds. The merge ratios in both modes are printed (`-s`) for docs/agents.md.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage
from langchain_core.output_parsers.openai_tools import parse_tool_call
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent

from gateway.proxy.token_in import NO_MATCH
from gateway.store.lineage import EXTENDS, HISTORY_EDITED, TRUNCATED
from scripts.record_fixtures import TOOL_EXAMPLE, WEATHER_QUESTION, WEATHER_RESULT
from tests.e2e.one_step import reward_and_train_one_step
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.stored import as_trajectory_data, stored_calls, tree_rows
from tests.support.token_in_agent import continues_exactly
from trainer.demo.vllm_cpu import ensure_smollm2
from trainer.samples import GroupData, build_samples

TOKEN_RUN = "graph-token-in"
CHAT_RUN = "graph-chat"
FOLLOW_UP = "Thanks! And what should I wear?"
# Agent -> tools -> agent ... : at most 4 model calls per invoke.
RECURSION_LIMIT = 7


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return WEATHER_RESULT


def opening(question: str = WEATHER_QUESTION) -> list[BaseMessage]:
    """The repo's in-context tool example (SmolLM2's template ignores `tools`), then the question."""
    system, user, example = TOOL_EXAMPLE
    return [
        SystemMessage(system["content"]),
        HumanMessage(user["content"]),
        AIMessage(example["content"]),
        HumanMessage(question),
    ]


class Agent:
    """A LangGraph ReAct agent whose only trajgate-specific part is its base_url."""

    def __init__(self, gateway: RunningGateway, run: str, group: str, trajectory: str, stream: bool) -> None:
        model = ChatOpenAI(
            model=run,
            base_url=f"{gateway.url}/g/{group}/n/2/t/{trajectory}/v1",
            api_key="x",
            max_retries=0,
            max_tokens=32,
            streaming=stream,
        )
        self.graph = create_react_agent(model, [get_weather], checkpointer=InMemorySaver())
        self.config: Any = {"configurable": {"thread_id": trajectory}, "recursion_limit": RECURSION_LIMIT}

    def invoke(self, messages: list[BaseMessage]) -> list[BaseMessage]:
        """Run the graph on `messages` (the whole history); a loop of tool calls cut by the recursion limit keeps
        what it produced."""
        try:
            self.graph.invoke({"messages": messages}, self.config)
        except GraphRecursionError:
            pass
        history: list[BaseMessage] = self.graph.get_state(self.config).values["messages"]
        return history

    def converse(self) -> list[BaseMessage]:
        """The question, then (if the agent finished its tool rounds) a follow-up on the whole history."""
        history = self.invoke(opening())
        if isinstance(history[-1], AIMessage) and not history[-1].tool_calls:
            history = self.invoke([HumanMessage(FOLLOW_UP)])
        return history


def converse_streamed_and_not(gateway: RunningGateway, run: str, group: str) -> dict[str, list[BaseMessage]]:
    """Two trajectories of one group, the agent streaming in one and not in the other; recorded once this returns."""
    runs = {f"{group}-stream": True, f"{group}-plain": False}
    histories = {t: Agent(gateway, run, group, t, stream).converse() for t, stream in runs.items()}
    gateway.flush()
    return histories


def answers(history: list[BaseMessage]) -> list[AIMessage]:
    """The agent's answers: the AI messages after the in-context example."""
    return [m for m in history[len(opening()) :] if isinstance(m, AIMessage)]


def create_run(gateway: RunningGateway, name: str, token_mode: str) -> None:
    body = {
        "name": name,
        "base_model": "smollm2",
        "base_weights": str(ensure_smollm2()),
        "config": {"token_mode": token_mode, "groups_per_step": 1, "learning_rate": 1e-4, "max_seq_len": 2048},
    }
    response = httpx.post(gateway.url + "/v1/runs", json=body, timeout=30)
    assert response.status_code in (200, 201), response.text


def assert_client_saw_the_recorded_answers(
    history: list[BaseMessage], calls: list[dict[str, Any]], streamed: bool
) -> None:
    """Each AIMessage is the recorded response in the OpenAI shape: its content, and its tool calls as LangChain
    makes them from that response (when the model emitted one). LangChain parses a whole answer's arguments strictly
    (unparseable ones go to invalid_tool_calls) but a streamed answer's leniently (a cut JSON object becomes what
    parses of it, possibly {}), so the expectation goes through the same parser the client used."""
    ai = answers(history)
    assert len(ai) == len(calls)
    for message, call in zip(ai, calls):
        recorded = call["response"]["choices"][0]["message"]
        assert message.content == (recorded.get("content") or "")
        raw = recorded.get("tool_calls") or []
        if streamed:
            chunks = [
                {"name": c["function"]["name"], "args": c["function"]["arguments"], "id": c["id"], "index": i}
                for i, c in enumerate(raw)
            ]
            expected = AIMessageChunk(content="", tool_call_chunks=chunks)
            valid = [(c["name"], c["args"]) for c in expected.tool_calls]
            invalid = [(c["name"], c["args"]) for c in expected.invalid_tool_calls]
        else:
            valid, invalid = [], []  # invalid: arguments LangChain cannot parse; it keeps their text
            for c in raw:
                try:
                    parsed = parse_tool_call(c, return_id=False)
                except OutputParserException:
                    invalid.append((c["function"]["name"], c["function"]["arguments"]))
                else:
                    assert parsed is not None
                    valid.append((parsed["name"], parsed["args"]))
        assert [(c["name"], c["args"]) for c in message.tool_calls] == valid
        assert [(c["name"], c["args"]) for c in message.invalid_tool_calls] == invalid


@pytest.fixture
def gateway(vllm_base_url: str, tmp_path: Path) -> Any:
    url = f"sqlite:///{tmp_path}/trajgate.db"
    with running_gateway(
        database_url=url, upstream_url=vllm_base_url, base_model="smollm2", spool_dir=tmp_path / "spool"
    ) as gw:
        create_run(gw, TOKEN_RUN, "token_in")
        create_run(gw, CHAT_RUN, "chat")
        yield gw, url


def test_langgraph_agent_trajectories_are_one_sequence_each_and_train(
    gateway: tuple[RunningGateway, str], vllm_base_url: str, tmp_path: Path
) -> None:
    gw, url = gateway
    group = f"g-{uuid.uuid4().hex[:8]}"
    histories = converse_streamed_and_not(gw, TOKEN_RUN, group)
    runs = list(histories)

    from transformers import AutoTokenizer

    end = AutoTokenizer.from_pretrained(ensure_smollm2()).convert_tokens_to_ids("<|im_end|>")
    data = []
    whole = []  # trajectories every call of which continued its predecessor's exact tokens
    segments = 0  # training rows: one per call-tree root, and one per fork (a call extending an already continued call)
    for reward, (trajectory, history) in enumerate(histories.items()):
        calls = stored_calls(url, trajectory)
        assert len(calls) >= 2 and all(c["trainable"] for c in calls), [c["untrainable_reason"] for c in calls]
        assert_client_saw_the_recorded_answers(history, calls, trajectory.endswith("-stream"))
        assert (calls[0]["merge_reason"], calls[0]["segment_reason"]) == ("first_call", "first_call")
        for before, after in zip(calls, calls[1:]):
            if not continues_exactly(before, end):
                continue  # a cut or unparseable tool call comes back re-serialised by LangChain: a new segment is right
            previous = before["prompt_token_ids"] + before["completion_token_ids"]
            assert after["prompt_token_ids"][: len(previous)] == previous
            assert (after["merge_reason"], after["segment_reason"]) == (EXTENDS, None)
            # Linear storage: each turn stores only the ids past its predecessor's prompt + completion.
            assert after["parent_seq"] == before["seq"]
            assert after["prefix_len"] == len(previous)
        segments += tree_rows(calls)
        if all(after["tree_parent_seq"] == before["seq"] for before, after in zip(calls, calls[1:])):
            whole.append(trajectory)
        data.append(as_trajectory_data(trajectory, float(reward), calls))

    batch = build_samples([GroupData(group, data)])
    for recorded in data:
        if recorded.trajectory_id not in whole:
            continue
        (row,) = [r for r in batch.rows if r.trajectory_id == recorded.trajectory_id]  # one row per trajectory
        last = recorded.calls[-1]
        assert row.input_ids == last.prompt_token_ids + last.completion_token_ids
        trained = [t for t, m in zip(row.input_ids, row.loss_mask) if m]
        assert trained == [t for c in recorded.calls for t in c.completion_token_ids]
    stats = batch.stats
    print(f"token_in LangGraph merge ratio {stats['merge_ratio']:.2f} over {stats['merge_candidates']} turns")

    rewards = [(trajectory, float(reward)) for reward, trajectory in enumerate(runs)]
    metrics = reward_and_train_one_step(gw.url, url, vllm_base_url, TOKEN_RUN, rewards, tmp_path)
    turns = sum(len(t.calls) for t in data)
    assert (metrics["rows"], metrics["merged_calls"]) == (segments, turns - segments)
    if len(whole) == len(data):
        assert (metrics["merge_ratio"], metrics["merge_breaks"]) == (1.0, {})
    assert metrics["trainable_tokens"] == sum(len(c.completion_token_ids or ()) for t in data for c in t.calls)
    assert metrics["publish_error"] is None


def test_chat_mode_agent_is_unchanged_and_breaks_at_tool_calls(gateway: tuple[RunningGateway, str]) -> None:
    gw, url = gateway
    group = f"c-{uuid.uuid4().hex[:8]}"
    histories = converse_streamed_and_not(gw, CHAT_RUN, group)
    data = []
    tool_calls = 0
    for trajectory, history in histories.items():
        calls = stored_calls(url, trajectory)
        assert_client_saw_the_recorded_answers(history, calls, trajectory.endswith("-stream"))
        tool_calls += sum(bool(c["response"]["choices"][0]["message"].get("tool_calls")) for c in calls)
        assert all(c["segment_reason"] is None and c["history_key"] is None for c in calls)
        for before, after in zip(calls, calls[1:]):
            if before["response"]["choices"][0]["message"].get("tool_calls"):
                # SmolLM2's template drops the call, so the next prompt does not extend it: that call is a root, or
                # a second child of an earlier call whose ids it still extends (gateway.store.tree).
                assert after["tree_parent_seq"] != before["seq"]
                assert after["merge_reason"] in ("template_dropped_tool_call", EXTENDS)
        data.append(as_trajectory_data(trajectory, 0.0, calls))
    stats = build_samples([GroupData(group, data)], drop_zero_variance=False).stats
    print(f"chat LangGraph merge ratio {stats['merge_ratio']:.2f} over {stats['merge_candidates']} turns, "
          f"{tool_calls} tool calls, breaks {stats['merge_breaks']}")  # fmt: skip


def test_an_edited_history_starts_a_new_segment(gateway: tuple[RunningGateway, str]) -> None:
    gw, url = gateway
    trajectory = f"e-{uuid.uuid4().hex[:8]}"
    agent = Agent(gw, TOKEN_RUN, trajectory, trajectory, False)
    first = agent.invoke(opening())
    before = len(answers(first))
    # The agent rewrites its first question (another city) and asks again on top of the rewritten history.
    kept = first[len(opening()) :]
    if isinstance(kept[-1], AIMessage) and kept[-1].tool_calls:
        kept = kept[:-1]  # a tool loop cut by the recursion limit: go on from the last tool result
    fresh = Agent(gw, TOKEN_RUN, trajectory, trajectory, False)
    fresh.config["configurable"]["thread_id"] = f"{trajectory}-edited"
    fresh.invoke([*opening("What is the weather in Rome?"), *kept, HumanMessage(FOLLOW_UP)])
    gw.flush()
    calls = stored_calls(url, trajectory)
    previous, edit = calls[before - 1], calls[before]
    assert edit["segment_reason"] == NO_MATCH
    # Compared with the previous call: the ids differ inside its prompt (the question), so an edit, or a truncation
    # when the re-rendered history came out shorter (the template drops the tool calls the exact ids kept).
    assert edit["divergence"] < len(previous["prompt_token_ids"])
    shorter = len(edit["prompt_token_ids"]) < len(previous["prompt_token_ids"])
    assert edit["merge_reason"] == (TRUNCATED if shorter else HISTORY_EDITED)
    from transformers import AutoTokenizer

    end = AutoTokenizer.from_pretrained(ensure_smollm2()).convert_tokens_to_ids("<|im_end|>")
    for b, a in zip(calls[before:], calls[before + 1 :]):
        if continues_exactly(b, end):  # else LangChain hands a cut tool call back re-serialised: a new segment
            assert a["merge_reason"] == EXTENDS
    edited = as_trajectory_data(trajectory, 0.0, calls)
    stats = build_samples([GroupData("g", [edited])], drop_zero_variance=False).stats
    assert stats["rows"] == tree_rows(calls) and stats["merge_breaks"].get(edit["merge_reason"], 0) >= 1
