"""A LangGraph supervisor that hands each question to a researcher sub-agent and answers from its report, trained by
trajgate as one trajectory.

The graph is ordinary LangGraph over `ChatOpenAI`: a supervisor node with its own system prompt, a researcher node
with another (a sub-agent: its own history, two turns), then the supervisor again, resuming its own history with the
researcher's report. The only trajgate-specific code is the `base_url` (harness.py names the group and trajectory)
and the reward POST. The gateway records the episode as a tree of calls: the researcher's first call is a new root
of the same trajectory, its second call extends its first, and the supervisor's resumption extends the supervisor's
own first call, not the researcher call that came just before it; the trainer trains one row per path, every sampled
token once, with the episode's reward.

    python examples/supervisor_langgraph.py train --gateway http://127.0.0.1:8000 --run demo --steps 10
    python examples/supervisor_langgraph.py eval --gateway http://127.0.0.1:8000 --run demo --out eval.json

The task is short_answers.py's (one-word answers to factual questions, the same reward), so the two can be compared.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TypedDict

import openai
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py and short_answers.py beside this script
from harness import Outcome, Task, main_for  # noqa: E402
from short_answers import HELD_OUT, TRAIN, Question, describe, is_correct, reward  # noqa: E402

SUPERVISOR = "You are a supervisor. You delegate research to a researcher, then give the final answer."
RESEARCHER = "You are a researcher. Answer the question you are given with facts."
MAX_TOKENS = 24


class State(TypedDict, total=False):
    question: str
    supervisor: list[BaseMessage]  # the supervisor's own history
    report: str
    answer: str


def build_graph(llm: ChatOpenAI) -> Any:
    """supervisor (plans) -> researcher (two turns of its own) -> supervisor (resumes with the report) -> end."""

    def plan(state: State) -> State:
        history: list[BaseMessage] = [
            SystemMessage(SUPERVISOR),
            HumanMessage(f"Question: {state['question']} Say what to ask the researcher."),
        ]
        history.append(llm.invoke(history))
        return {"supervisor": history}

    def research(state: State) -> State:
        history: list[BaseMessage] = [SystemMessage(RESEARCHER), HumanMessage(state["question"])]
        history.append(llm.invoke(history))
        history.append(HumanMessage("Now say only the answer, in one word."))
        report = llm.invoke(history)
        return {"report": str(report.content)}

    def conclude(state: State) -> State:
        history = [
            *state["supervisor"],
            HumanMessage(f"The researcher reports: {state['report']} Give the final answer in one word."),
        ]
        final = llm.invoke(history)
        return {"supervisor": [*history, final], "answer": str(final.content)}

    graph = StateGraph(State)
    graph.add_node("plan", plan)
    graph.add_node("research", research)
    graph.add_node("conclude", conclude)
    graph.add_edge(START, "plan")
    graph.add_edge("plan", "research")
    graph.add_edge("research", "conclude")
    graph.add_edge("conclude", END)
    return graph.compile()


def episode(client: openai.OpenAI, model: str, question: Question) -> Outcome:
    """One supervised answer: four model calls, scored like short_answers.py."""
    text, accepted = question
    llm = ChatOpenAI(model=model, base_url=str(client.base_url), api_key=client.api_key, max_tokens=MAX_TOKENS,
                     max_retries=3, timeout=300, include_response_headers=True)  # fmt: skip
    result = build_graph(llm).invoke({"question": text})
    final = result["supervisor"][-1]
    version = int((final.response_metadata.get("headers") or {}).get("x-policy-version", -1))
    answer = str(result["answer"])
    return Outcome(reward(answer, accepted), is_correct(answer, accepted), answer, version)


TASK = Task(train=TRAIN, held_out=HELD_OUT, episode=episode, describe=describe)


if __name__ == "__main__":
    sys.exit(main_for(TASK, __doc__ or ""))
