"""Non-linear trajectories against real vLLM CPU + SmolLM2, in both token modes: the LangGraph supervisor with a
researcher sub-agent (examples/supervisor_langgraph.py), the agent that compacts its history
(examples/compacting_agent.py) and the LangGraph graph with parallel branches (examples/parallel_branches_langgraph.py)
are recorded as trees of calls, and groups of them train one step with one row per path and no token trained twice;
and the OpenAI Agents SDK handoff (examples/agents_sdk_handoff.py) records the specialist as a new root.

Train mode (temperature 1), so what the model says varies run to run: the assertions are about the tree the gateway
builds from the recorded ids and messages (which call extends which, why a root is one), never about the answers.
In chat mode the template re-renders each reply, so whether a resumption extends its own earlier call depends on the
re-rendering; there the test checks that the parent is that call exactly when its ids are a prefix. The figures the
bench/README.md and docs/trajectories.md quote (calls, roots, forks, rows per trajectory, tokens trained) are printed with `-s`.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.runs.settings import load_settings
from gateway.store import db
from gateway.store.lineage import COMPACTED, EXTENDS, FIRST_CALL, NEW_ROOT
from gateway.store.runs import steps_after
from tests.support.examples import load_example
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.stored import as_trajectory_data, stored_calls
from trainer.demo.vllm_cpu import ensure_smollm2
from trainer.samples import GroupData, build_samples
from trainer.worker.loop import Trainer, TrainerOptions

MODES = ("chat", "token_in")


supervisor = load_example("supervisor_langgraph")
compacting = load_example("compacting_agent")
parallel = load_example("parallel_branches_langgraph")
handoff = load_example("agents_sdk_handoff")


def create_run(gateway: RunningGateway, name: str, token_mode: str) -> None:
    body = {
        "name": name,
        "base_model": "smollm2",
        "base_weights": str(ensure_smollm2()),
        "config": {"token_mode": token_mode, "groups_per_step": 3, "learning_rate": 1e-4, "max_seq_len": 2048},
    }
    response = httpx.post(gateway.url + "/v1/runs", json=body, timeout=30)
    assert response.status_code in (200, 201), response.text


def play(gateway: RunningGateway, run: str, group: str, episode: Any, question: Any) -> list[str]:
    """Two episodes of one group, through a base_url naming each trajectory; their rewards 0 and 1 (set here, not by
    the model, so the group always has something to learn from)."""
    trajectories = [f"{group}-{i}" for i in range(2)]
    for reward, trajectory in enumerate(trajectories):
        client = openai.OpenAI(base_url=f"{gateway.url}/g/{group}/n/2/t/{trajectory}/v1", api_key="x", max_retries=0)
        episode(client, run, question)
        response = httpx.post(f"{gateway.url}/v1/trajectories/{trajectory}/reward", json={"reward": float(reward)})
        assert response.status_code == 200, response.text
    return trajectories


def tokens(call: dict[str, Any]) -> list[int]:
    return list(call["prompt_token_ids"]) + list(call["completion_token_ids"])


def extends(call: dict[str, Any], parent: dict[str, Any]) -> bool:
    return call["prompt_token_ids"][: len(tokens(parent))] == tokens(parent)


def parent_of(call: dict[str, Any]) -> tuple[int, int] | None:
    return None if call["tree_parent_seq"] is None else (call["tree_parent_seq"], call["tree_parent_choice"])


def key(call: dict[str, Any]) -> tuple[int, int]:
    return (call["seq"], call["choice_index"])


def check_tree_invariants(calls: list[dict[str, Any]]) -> None:
    """Whatever the model said: a call's parent is an earlier call whose ids its prompt starts with, and a call with
    no parent extends no earlier call."""
    by_key = {key(c): c for c in calls}
    for call in calls:
        parent = parent_of(call)
        earlier = [c for c in calls if c["seq"] < call["seq"]]
        if parent is None:
            assert not any(extends(call, c) for c in earlier), call["merge_reason"]
        else:
            assert call["merge_reason"] == EXTENDS and extends(call, by_key[parent])
            assert len(tokens(by_key[parent])) == max(len(tokens(c)) for c in earlier if extends(call, c))


def check_supervisor(calls: list[dict[str, Any]], mode: str) -> None:
    plan, research, report, conclude = calls
    assert plan["merge_reason"] == FIRST_CALL and parent_of(plan) is None
    # The researcher has its own system prompt: a new root of the same trajectory, not an edit of the supervisor's.
    assert research["merge_reason"] == NEW_ROOT and parent_of(research) is None
    for call, own in ((report, research), (conclude, plan)):
        if mode == "token_in":
            assert extends(call, own), call["segment_reason"]
        # The supervisor resumes its own call, never the researcher's call just before it.
        assert parent_of(call) == (key(own) if extends(call, own) else None)


def check_compacting(calls: list[dict[str, Any]], mode: str) -> None:
    first, second, summarise, compacted = calls
    assert first["merge_reason"] == FIRST_CALL
    assert compacted["merge_reason"] == COMPACTED and parent_of(compacted) is None
    for call, own in ((second, first), (summarise, second)):
        if mode == "token_in":
            assert extends(call, own)
        assert parent_of(call) == (key(own) if extends(call, own) else None)


def check_parallel(calls: list[dict[str, Any]], mode: str) -> None:
    plan, *later = calls  # the two checks ran at the same time: their order is the gateway's arrival order
    assert plan["merge_reason"] == FIRST_CALL
    for call in later:
        if mode == "token_in":
            assert extends(call, plan)
        # Each check and the join continue the planner's call: its children, never each other's.
        assert parent_of(call) == (key(plan) if extends(call, plan) else None)


CHECKS = {"supervisor": check_supervisor, "compacting": check_compacting, "parallel": check_parallel}
# Paths per trajectory in token_in mode (every continuation extends its own call): roots, forks.
TOKEN_IN_TREES = {"supervisor": (2, 0), "compacting": (2, 0), "parallel": (1, 2)}


@pytest.fixture
def gateway(vllm_base_url: str, tmp_path: Path) -> Any:
    url = f"sqlite:///{tmp_path}/trajgate.db"
    with running_gateway(
        database_url=url, upstream_url=vllm_base_url, base_model="smollm2", spool_dir=tmp_path / "spool"
    ) as gw:
        for mode in MODES:
            create_run(gw, f"tree-{mode}", mode)
        yield gw, url


def test_supervisor_and_compacting_agents_are_trees_and_train(
    gateway: tuple[RunningGateway, str], vllm_base_url: str, tmp_path: Path
) -> None:
    gw, url = gateway
    session = uuid.uuid4().hex[:6]
    groups: dict[str, dict[str, list[str]]] = {}
    for mode in MODES:
        run = f"tree-{mode}"
        groups[mode] = {
            "supervisor": play(gw, run, f"sup-{mode}-{session}", supervisor.episode, supervisor.TRAIN[0]),
            "compacting": play(gw, run, f"cmp-{mode}-{session}", compacting.episode, compacting.TRAIN[0]),
            "parallel": play(gw, run, f"par-{mode}-{session}", parallel.episode, parallel.TRAIN[0]),
        }
    gw.flush()

    for mode in MODES:
        data = []
        for agent, trajectories in groups[mode].items():
            for reward, trajectory in enumerate(trajectories):
                calls = stored_calls(url, trajectory)
                assert len(calls) == 4 and all(c["trainable"] for c in calls), [c["untrainable_reason"] for c in calls]
                check_tree_invariants(calls)
                CHECKS[agent](calls, mode)
                data.append((agent, as_trajectory_data(trajectory, float(reward), calls)))
        for agent in CHECKS:
            mine = [t for a, t in data if a == agent]
            stats = build_samples([GroupData(agent, mine)]).stats
            assert stats["tokens_trained_twice"] == 0
            completions = sum(len(c.completion_token_ids or ()) for t in mine for c in t.calls)
            assert stats["trainable_tokens"] == completions
            if mode == "token_in":
                # Supervisor: the supervisor and its resumption, the researcher's two turns; compacting: the calls up to
                # the summary, the compacted history; parallel: the planner's three children, one path each.
                roots, forks = TOKEN_IN_TREES[agent]
                assert (stats["roots"], stats["forks"], stats["rows"]) == (2 * roots, 2 * forks, 2 * (roots + forks))
            print(f"{mode} {agent}: calls {stats['calls']}, roots {stats['roots']}, forks {stats['forks']}, "
                  f"rows/trajectory {stats['rows_per_trajectory']:.1f}, trained tokens {stats['trainable_tokens']} "
                  f"of {stats['tokens']}")  # fmt: skip

    settings = load_settings(
        _env_file=None, database_url=url, checkpoint_dir=tmp_path / "ckpt", upstream_url=vllm_base_url
    )
    options = TrainerOptions(run="tree-token_in", backend="hf", device="cpu", poll_s=0.2, max_steps=1)
    with Trainer(settings, options) as trainer:
        assert trainer.run() == 1
    engine = db.make_engine(url)
    try:
        (step,) = steps_after(engine, "tree-token_in")
    finally:
        engine.dispose()
    metrics = step["metrics"]
    assert (metrics["roots"], metrics["forks"], metrics["rows"], metrics["tokens_trained_twice"]) == (10, 4, 14, 0)
    assert metrics["publish_error"] is None
    print(f"token_in step: rows {metrics['rows']}, tokens {metrics['tokens']}, trained {metrics['trainable_tokens']}, "
          f"shared prefix tokens {metrics['shared_prefix_tokens']}")  # fmt: skip


def test_agents_sdk_handoff_is_a_new_root(gateway: tuple[RunningGateway, str]) -> None:
    """Triage is made to call the handoff tool (tool_choice required), but at temperature 1 the model may still end
    its reply before the call closes, and then triage's answer is the episode's only call: the tree is checked for
    whichever happened."""
    gw, url = gateway
    session = uuid.uuid4().hex[:6]
    played = {mode: play(gw, f"tree-{mode}", f"hnd-{mode}-{session}", handoff.episode, handoff.TRAIN[0]) for mode in MODES}
    gw.flush()
    for mode, trajectories in played.items():
        data = []
        for reward, trajectory in enumerate(trajectories):
            calls = stored_calls(url, trajectory)
            assert all(c["trainable"] for c in calls), [c["untrainable_reason"] for c in calls]
            check_tree_invariants(calls)
            triage, *specialist = calls
            assert triage["merge_reason"] == FIRST_CALL
            handed_off = bool(triage["response"]["choices"][0]["message"].get("tool_calls"))
            assert len(specialist) == (1 if handed_off else 0)
            for call in specialist:  # the geographer: its own system prompt, so a new root of the same trajectory
                assert call["merge_reason"] == NEW_ROOT and parent_of(call) is None
            data.append(as_trajectory_data(trajectory, float(reward), calls))
        stats = build_samples([GroupData("handoff", data)]).stats
        assert stats["tokens_trained_twice"] == 0 and stats["rows"] == stats["roots"] == stats["calls"]
        print(f"{mode} handoff: calls {stats['calls']}, roots {stats['roots']}, forks {stats['forks']}, "
              f"rows/trajectory {stats['rows_per_trajectory']:.1f}, trained tokens {stats['trainable_tokens']} "
              f"of {stats['tokens']}")  # fmt: skip
