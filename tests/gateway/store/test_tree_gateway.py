"""The call tree through the gateway: an agent's calls, made with the OpenAI SDK and answered from real vLLM
recordings (scripts/record_fixtures.py `record_tree`: greedy SmolLM2), come back from the read API with the parents,
reasons and branches of their shape, and train as one row per path with nothing trained twice. The shapes: a
supervisor with a researcher sub-agent, parallel branches off one call, a compacted history; and the OpenAI Agents
SDK handoff of examples/agents_sdk_handoff.py in both token modes (tests/support/handoff_agent.py, recorded through the
gateway by `record_tree_handoff`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest

from gateway.store.db import make_engine
from gateway.store.training import load_groups
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.handoff_agent import RUNS, handoff
from tests.support.handoff_agent import play as play_handoff
from tests.support.openai_calls import sdk_kwargs
from tests.support.stored import stored_calls
from tests.support.trajectories import reward
from trainer.samples import CallData, GroupData, TrajectoryData, build_samples
from trainer.worker.loop import to_groups

SUPERVISOR = ["tree_plan", "tree_research", "tree_report", "tree_conclude"]
PARALLEL = ["tree_plan", "tree_branch_a", "tree_branch_b", "tree_conclude"]
COMPACTED = ["tree_plan", "tree_conclude", "tree_compacted"]


def play(gateway: RunningGateway, upstream: FakeUpstream, trajectory: str, names: list[str]) -> None:
    """The calls in order, as an agent whose base_url names the trajectory sends them."""
    client = openai.OpenAI(base_url=f"{gateway.url}/g/g-tree/n/3/t/{trajectory}/v1", api_key="x", max_retries=0)
    for name in names:
        client.chat.completions.create(**sdk_kwargs(upstream.fixture(name)))


def tree(gateway: RunningGateway, trajectory: str) -> list[tuple[str, int | None, int]]:
    """(merge_reason, index of the parent call, index of the branch's first call) per call, from the read API."""
    response = httpx.get(f"{gateway.base_url}/trajectories/{trajectory}", timeout=30)
    assert response.status_code == 200, response.text
    calls: list[dict[str, Any]] = response.json()["calls"]
    index = {c["seq"]: i for i, c in enumerate(calls)}
    return [(c["merge_reason"], index[c["parent"]["seq"]] if c["parent"] else None, index[c["branch"]]) for c in calls]


def test_recorded_agent_shapes_are_trees_and_train_one_row_per_path(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    play(gateway, upstream, "supervisor", SUPERVISOR)
    play(gateway, upstream, "parallel", PARALLEL)
    play(gateway, upstream, "compacted", COMPACTED)
    gateway.flush()

    # The researcher has another system prompt: a new root. Its second turn does not extend its first in chat mode
    # (the template re-renders the answer cut at max_tokens to other ids: a root), and the supervisor resumes its own
    # call, not the researcher's just before it.
    assert tree(gateway, "supervisor") == [("first_call", None, 0), ("new_root", None, 1),
                                           ("completion_rerendered", None, 2), ("extends", 0, 0)]  # fmt: skip
    # Both branches and the join hang off the plan; the plan's branch goes on in the first, the others fork.
    assert tree(gateway, "parallel") == [("first_call", None, 0), ("extends", 0, 0), ("extends", 0, 2),
                                         ("extends", 0, 3)]  # fmt: skip
    assert tree(gateway, "compacted") == [("first_call", None, 0), ("extends", 0, 0), ("compacted", None, 2)]

    for value, trajectory in enumerate(("supervisor", "parallel", "compacted")):
        assert reward(gateway, trajectory, float(value)).status_code == 200
    engine = make_engine(db_url)
    try:
        groups = to_groups(load_groups(engine, ["g-tree"]))
    finally:
        engine.dispose()
    batch = build_samples(groups)
    rows = {t: sum(1 for r in batch.rows if r.trajectory_id == t) for t in ("supervisor", "parallel", "compacted")}
    assert rows == {"supervisor": 3, "parallel": 3, "compacted": 2}
    stats = batch.stats
    assert (stats["roots"], stats["forks"], stats["tokens_trained_twice"]) == (3 + 1 + 2, 2, 0)
    completions = sum(len(c.completion_token_ids or ()) for g in groups for t in g.trajectories for c in t.calls)
    assert stats["trainable_tokens"] == completions


@pytest.mark.parametrize("mode", ["chat", "token_in"])
def test_an_agents_sdk_handoff_is_a_new_root_of_the_same_trajectory(
    gateway_settings: dict[str, object], db_url: str, mode: str
) -> None:
    """Triage calls the handoff tool; the SDK then runs the geographer on the conversation so far under its own
    instructions: a call of the same trajectory that extends nothing (another system prompt), so a new root."""
    with running_gateway(**gateway_settings) as gw:
        body = {"name": RUNS[mode], "config": {"token_mode": mode}}
        assert httpx.post(gw.url + "/v1/runs", json=body, timeout=30).status_code in (200, 201)
        answer = play_handoff(gw.url, mode, f"handoff-{mode}")
        gw.flush()
        assert tree(gw, f"handoff-{mode}") == [("first_call", None, 0), ("new_root", None, 1)]
    triage, geographer = stored_calls(db_url, f"handoff-{mode}")
    [tool_call] = triage["response"]["choices"][0]["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "transfer_to_geographer"
    messages = geographer["request"]["messages"]
    assert messages[0] == {"role": "system", "content": f"You are a geographer. {handoff.INSTRUCTION}"}
    assert messages[-1]["role"] == "tool" and messages[-1]["tool_call_id"] == tool_call["id"]
    assert geographer["response"]["choices"][0]["message"]["content"] == answer
    assert geographer["prompt_token_ids"][: len(triage["prompt_token_ids"])] != triage["prompt_token_ids"]

    # Eval calls (greedy) are not trainable; as the trainer would lay them out if they were: one row per agent.
    calls = [replace(CallData(**{f: c[f] for f in CallData.__dataclass_fields__}), trainable=True)
             for c in (triage, geographer)]  # fmt: skip
    stats = build_samples([GroupData("g", [TrajectoryData("t0", 0.0, calls), TrajectoryData("t1", 1.0, calls)])]).stats
    assert (stats["roots"], stats["forks"], stats["rows"], stats["tokens_trained_twice"]) == (4, 0, 4, 0)
