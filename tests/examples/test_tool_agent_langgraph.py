"""The LangGraph ReAct version of the tool agent against the same scripted server as the OpenAI SDK loop: it plays
the task the same way and scores it the same (tool_agent.py's reward, 0 for a call the tools cannot run)."""

from __future__ import annotations

import json
from typing import Any

from tests.support.examples import load_example
from tests.support.scripted_server import agent, person_of, text_reply, tool_reply

graph_agent = load_example("tool_agent_langgraph")


def test_search_then_answer_is_right(scripted: Any) -> None:
    question = agent.DIRECTORY.train[0]
    person = person_of(question)
    server = scripted([tool_reply("search", json.dumps({"query": person.name})), text_reply(question.answer)])
    outcome = graph_agent.episode(server.client(), "demo", question)
    assert (outcome.reward, outcome.correct, outcome.text, outcome.policy_version) == (1.0, True, question.answer, 3)
    assert outcome.stats == {"tool_call": 1.0, "calls": 2.0, "malformed": 0.0}
    first, second = server.requests
    assert first["model"] == "demo" and first["max_completion_tokens"] == agent.MAX_TOKENS  # LangChain's key for it
    assert sorted(t["function"]["name"] for t in first["tools"]) == ["lookup", "search"]
    assert first["messages"][0] == {"role": "system", "content": agent.SYSTEM}
    assert [m["content"] for m in first["messages"][1:-1]] == [
        m["content"] for m in agent.example_messages(agent.DIRECTORY)
    ]  # the worked episodes, their tool calls as markup
    assert first["messages"][-1] == {"role": "user", "content": question.text}
    tool = second["messages"][-1]
    assert tool["role"] == "tool" and json.loads(tool["content"]) == [person.record()]
    assert tool["tool_call_id"] == second["messages"][-2]["tool_calls"][0]["id"]


def test_a_call_the_tools_cannot_run_earns_nothing_even_if_the_answer_is_right(scripted: Any) -> None:
    question = agent.DIRECTORY.train[0]
    server = scripted([tool_reply("phone_book", '{"name": "x"}'), text_reply(question.answer)])
    outcome = graph_agent.episode(server.client(), "demo", question)
    assert (outcome.reward, outcome.correct) == (0.0, False)
    assert outcome.stats["malformed"] == 1.0 and outcome.stats["tool_call"] == 0.0


def test_a_wrong_answer_earns_nothing_and_a_lookup_without_the_right_answer_the_credit(scripted: Any) -> None:
    question = agent.DIRECTORY.train[0]
    wrong = graph_agent.episode(scripted([text_reply("1234")]).client(), "demo", question)
    assert (wrong.reward, wrong.correct, wrong.text, wrong.stats["calls"]) == (0.0, False, "1234", 1.0)
    searched = scripted([tool_reply("search", '{"query": "x"}'), text_reply("1234")])
    wrong_after_search = graph_agent.episode(searched.client(), "demo", question)
    assert (wrong_after_search.reward, wrong_after_search.correct) == (agent.LOOKUP_CREDIT, False)
    looping = scripted([tool_reply("search", '{"query": "x"}')] * agent.MAX_CALLS)
    endless = graph_agent.episode(looping.client(), "demo", question)
    assert (endless.reward, endless.correct, endless.text) == (agent.LOOKUP_CREDIT, False, "(no_answer)")
    assert len(looping.requests) == agent.MAX_CALLS and not looping.replies  # stopped after MAX_CALLS model calls
