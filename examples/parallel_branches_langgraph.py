"""A LangGraph graph with parallel branches: a planner, two checks run at the same time with LangGraph's `Send`, and a
join that answers from them, trained by trajgate as one trajectory.

Ordinary LangGraph over `ChatOpenAI`; the only trajgate-specific code is the `base_url` (harness.py names the group
and trajectory) and the reward POST. Every later call continues the planner's conversation, so the gateway records
a tree with three children under the planner's call (the second check and the join are forks); the trainer trains
one row per path (planner + first check, second check, join), the planner's answer in one of them only.

    python examples/parallel_branches_langgraph.py train --gateway http://127.0.0.1:8000 --run demo --steps 10
    python examples/parallel_branches_langgraph.py eval --gateway http://127.0.0.1:8000 --run demo --out eval.json

The task is short_answers.py's (one-word answers to factual questions, the same reward).
"""

from __future__ import annotations

import operator
import sys
from pathlib import Path
from typing import Annotated, Any, TypedDict

import openai
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py and short_answers.py beside this script
from harness import Outcome, Task, main_for  # noqa: E402
from short_answers import HELD_OUT, TRAIN, Question, describe, is_correct, reward  # noqa: E402

SYSTEM = "You answer factual questions carefully."
CHECKS = ("Which country is the question about?", "What kind of place is asked for?")
MAX_TOKENS = 24


class State(TypedDict, total=False):
    question: str
    history: list[BaseMessage]  # the planner's conversation, which every branch continues
    checks: Annotated[list[str], operator.add]  # one per branch, merged as the branches finish
    answer: str


class Branch(TypedDict):
    history: list[BaseMessage]
    check: str


def build_graph(llm: ChatOpenAI) -> Any:
    """plan -> (check, check) in parallel -> join -> end."""

    def plan(state: State) -> State:
        history: list[BaseMessage] = [SystemMessage(SYSTEM), HumanMessage(f"{state['question']} Think first.")]
        return {"history": [*history, llm.invoke(history)]}

    def fan_out(state: State) -> list[Send]:
        return [Send("check", {"history": state["history"], "check": check}) for check in CHECKS]

    def check(branch: Branch) -> State:
        reply = llm.invoke([*branch["history"], HumanMessage(branch["check"])])
        return {"checks": [str(reply.content)]}

    def join(state: State) -> State:
        notes = " ".join(state.get("checks", []))
        final = llm.invoke([*state["history"], HumanMessage(f"Notes: {notes} Now answer in one word.")])
        return {"answer": str(final.content)}

    graph = StateGraph(State)
    graph.add_node("plan", plan)
    graph.add_node("check", check)
    graph.add_node("join", join)
    graph.add_edge(START, "plan")
    graph.add_conditional_edges("plan", fan_out, ["check"])
    graph.add_edge("check", "join")
    graph.add_edge("join", END)
    return graph.compile()


def episode(client: openai.OpenAI, model: str, question: Question) -> Outcome:
    """One answer through the graph: four model calls, two of them at the same time."""
    text, accepted = question
    llm = ChatOpenAI(model=model, base_url=str(client.base_url), api_key=client.api_key, max_tokens=MAX_TOKENS,
                     max_retries=3, timeout=300, include_response_headers=True)  # fmt: skip
    result = build_graph(llm).invoke({"question": text})
    answer = str(result["answer"])
    version = int((result["history"][-1].response_metadata.get("headers") or {}).get("x-policy-version", -1))
    return Outcome(reward(answer, accepted), is_correct(answer, accepted), answer, version)


TASK = Task(train=TRAIN, held_out=HELD_OUT, episode=episode, describe=describe)


if __name__ == "__main__":
    sys.exit(main_for(TASK, __doc__ or ""))
