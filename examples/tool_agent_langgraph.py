"""The tool agent's task (tool_agent.py: a made-up directory, `search` / `lookup`, its reward)
as a LangGraph ReAct agent, trained through trajgate the same way.

The agent is LangGraph's prebuilt `create_react_agent` over `ChatOpenAI`. The only trajgate-specific code is the
`base_url` the harness hands it (naming the group and trajectory) and the reward POST the harness makes at the end.

    python examples/tool_agent_langgraph.py train --gateway http://127.0.0.1:8000 --run demo --steps 10
    python examples/tool_agent_langgraph.py eval --gateway http://127.0.0.1:8000 --run demo --out eval.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import openai
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py and tool_agent.py beside this script
from harness import Outcome, Task, main_for  # noqa: E402
from tool_agent import (  # noqa: E402
    DIRECTORY,
    MAX_CALLS,
    MAX_TOKENS,
    SYSTEM,
    Question,
    describe,
    example_messages,
    reward,
    right,
)


@tool
def search(query: str) -> str:
    """Find people in the directory whose name matches the query; returns their records."""
    return json.dumps(DIRECTORY.search(query))


@tool
def lookup(id: str) -> str:  # noqa: A002 - the argument's name is what the model writes
    """The directory record of the person with this id: city and phone extension."""
    return json.dumps(DIRECTORY.lookup(id))


def _worked_examples() -> list[BaseMessage]:
    """tool_agent.py's worked episodes as LangChain messages: the tool calls stay markup in the content, which
    SmolLM2's template renders (it drops structured tool calls)."""
    out: list[BaseMessage] = []
    for number, message in enumerate(example_messages(DIRECTORY)):
        if message["role"] == "user":
            out.append(HumanMessage(message["content"]))
        elif message["role"] == "assistant":
            out.append(AIMessage(message["content"]))
        else:
            out.append(ToolMessage(message["content"], tool_call_id=f"example-{number}"))
    return out


def episode(client: openai.OpenAI, model: str, question: Question) -> Outcome:
    """One ReAct run: the model calls tools until it answers, at most MAX_CALLS model calls."""
    llm = ChatOpenAI(model=model, base_url=str(client.base_url), api_key=client.api_key, max_tokens=MAX_TOKENS,
                     max_retries=3, timeout=300, include_response_headers=True)  # fmt: skip
    agent = create_react_agent(llm, [search, lookup])
    history = [SystemMessage(SYSTEM), *_worked_examples()]
    asked = HumanMessage(question.text)
    # Each model call and each round of tool calls is a step of the graph; out of steps, the graph ends with a
    # canned apology of its own, which no model wrote.
    state = agent.invoke({"messages": [*history, asked]}, {"recursion_limit": 2 * MAX_CALLS})
    messages: list[BaseMessage] = state["messages"][len(history) + 1:]
    replies = [m for m in messages if isinstance(m, AIMessage) and m.response_metadata]
    results = [m for m in messages if isinstance(m, ToolMessage)]
    # LangGraph hands a call the tools cannot run back to the model as an error result; this task scores it 0.
    malformed = any(m.status == "error" for m in results) or any(
        m.invalid_tool_calls or "<tool_call>" in str(m.content) for m in replies
    )
    answered = bool(replies) and messages[-1] is replies[-1] and not replies[-1].tool_calls
    final = str(replies[-1].content) if answered else None
    looked_up = any(m.status != "error" for m in results)
    score = 0.0 if malformed else reward(final, question.answer, looked_up)
    version = int((replies[-1].response_metadata.get("headers") or {}).get("x-policy-version", -1)) if replies else -1
    stats = {"tool_call": float(looked_up), "calls": float(len(replies)),
             "malformed": float(malformed)}  # fmt: skip
    text = final if final is not None else "(malformed)" if malformed else "(no_answer)"
    return Outcome(score, not malformed and right(final, question.answer), text, version, stats)


TASK = Task(train=DIRECTORY.train, held_out=DIRECTORY.held_out, episode=episode, describe=describe)


if __name__ == "__main__":
    sys.exit(main_for(TASK, __doc__ or ""))
