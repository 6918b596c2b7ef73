"""The call tree through the gateway: an agent's calls, made with the OpenAI SDK and answered from real vLLM
recordings (scripts/record_fixtures.py `record_tree`: greedy SmolLM2), come back from the read API with the parents,
reasons and branches of their shape, and train as one row per path with nothing trained twice. The shapes: a
supervisor with a researcher sub-agent, parallel branches off one call, a compacted history."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from gateway.store.db import make_engine
from gateway.store.training import load_groups
from tests.fake_upstream import FakeUpstream
from tests.gateway_harness import RunningGateway
from tests.test_gateway_capture import sdk_kwargs
from tests.trajectories import reward
from trainer.loop import to_groups
from trainer.samples import build_samples

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
