"""The example agents' trees and what one training step of each makes of them, in both token modes (issue 21's note).

Each example under examples/ that builds a non-linear trajectory (the LangGraph supervisor with a researcher
sub-agent, the LangGraph graph with parallel branches, the agent that compacts its history, the OpenAI Agents SDK
handoff) plays one group of `--episodes` episodes per token mode, in train mode (temperature 1), through a gateway
(SQLite in a temporary directory) in front of one real vLLM CPU serving SmolLM2 as the e2e tests start it. The
trainer's own row builder (trainer.samples.build_samples) then lays each group out as one step would. Rewards are set
here, alternating 0 and 1, so no group is dropped for zero variance: the figures are about the layout, not learning.

Printed: one line per (mode, agent): calls, roots, forks and rows per trajectory, and per step (the group) the
tokens in its rows, the tokens trained (completion tokens under the loss), prefix tokens shared by rows and tokens
trained twice (goal 0); then every mode's four groups as one step, with build_samples' stats.

Run: `python bench/tree_agents.py [--episodes 4] [--base-url http://127.0.0.1:PORT/v1]` (a running SmolLM2 server,
e.g. `python -m trainer.demo.vllm_cpu serve --model smollm2 --tools`; without it one is started and stopped). CPU heavy:
about 30 s per episode on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.support.examples import load_example  # noqa: E402
from tests.support.gateway_harness import RunningGateway, running_gateway  # noqa: E402
from tests.support.stored import as_trajectory_data, stored_calls  # noqa: E402
from trainer.demo.vllm_cpu import smollm2_server  # noqa: E402
from trainer.samples import GroupData, build_samples  # noqa: E402

AGENTS = {
    "supervisor": "supervisor_langgraph",
    "parallel": "parallel_branches_langgraph",
    "compacting": "compacting_agent",
    "handoff": "agents_sdk_handoff",
}
MODES = ("chat", "token_in")
SHOWN_STATS = ("calls", "roots", "forks", "rows", "rows_per_trajectory", "tokens", "trainable_tokens",
               "shared_prefix_tokens", "tokens_trained_twice", "merge_breaks", "untrainable_calls")  # fmt: skip


@contextlib.contextmanager
def vllm(base_url: str | None) -> Iterator[str]:
    if base_url:
        yield base_url.rstrip("/")
        return
    with smollm2_server() as server:
        yield server.base_url


def play_group(gateway: RunningGateway, run: str, group: str, example: Any, episodes: int) -> list[str]:
    """`episodes` episodes of one group, each on its own trajectory and question, as harness.py's train rounds play
    them (a base_url naming group, size and trajectory)."""
    trajectories = []
    for i in range(episodes):
        trajectory = f"{group}-{i}"
        url = f"{gateway.url}/g/{group}/n/{episodes}/t/{trajectory}/v1"
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
        example.episode(client, run, example.TRAIN[i % len(example.TRAIN)])
        trajectories.append(trajectory)
    return trajectories


def group_data(db_url: str, group: str, trajectories: list[str]) -> GroupData:
    """The group as the trainer loads it, rewards alternating 0 and 1."""
    data = []
    for i, trajectory in enumerate(trajectories):
        data.append(as_trajectory_data(trajectory, float(i % 2), stored_calls(db_url, trajectory)))
    return GroupData(group, data)


def line(mode: str, agent: str, stats: dict[str, Any], episodes: int, seconds: float) -> str:
    per = max(1, stats["trajectories"])
    return (f"| {mode:8} | {agent:10} | {stats['calls'] / per:5.2f} | {stats['roots'] / per:5.2f} | "
            f"{stats['forks'] / per:5.2f} | {stats['rows_per_trajectory']:4.2f} | {stats['tokens']:6} | "
            f"{stats['trainable_tokens']:6} | {stats['shared_prefix_tokens']:6} | {stats['tokens_trained_twice']:5} | "
            f"{seconds / episodes:5.1f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--episodes", type=int, default=4, help="episodes per group (one group per agent and mode)")
    parser.add_argument("--base-url", help="a running vLLM serving SmolLM2 as `smollm2` with tools")
    parser.add_argument("--agents", nargs="+", choices=list(AGENTS), default=list(AGENTS))
    args = parser.parse_args()
    examples = {agent: load_example(AGENTS[agent]) for agent in args.agents}
    session = f"{int(time.time()) % 100000}"
    rows: list[str] = []
    steps: dict[str, dict[str, Any]] = {}
    with vllm(args.base_url) as base_url, tempfile.TemporaryDirectory() as tmp:
        db_url = f"sqlite:///{tmp}/trajgate.db"
        with running_gateway(
            database_url=db_url, upstream_url=base_url, base_model="smollm2", spool_dir=f"{tmp}/spool"
        ) as gateway:
            for mode in MODES:
                run = f"tree-{mode}"
                body = {"name": run, "config": {"token_mode": mode}}
                httpx.post(gateway.url + "/v1/runs", json=body, timeout=30).raise_for_status()
            groups: dict[str, list[GroupData]] = {mode: [] for mode in MODES}
            for mode in MODES:
                for agent, example in examples.items():
                    group = f"{agent}-{mode}-{session}"
                    started = time.monotonic()
                    trajectories = play_group(gateway, f"tree-{mode}", group, example, args.episodes)
                    seconds = time.monotonic() - started
                    gateway.flush()
                    data = group_data(db_url, group, trajectories)
                    groups[mode].append(data)
                    rows.append(line(mode, agent, build_samples([data]).stats, args.episodes, seconds))
                    print(rows[-1], flush=True)
            for mode in MODES:
                steps[mode] = build_samples(groups[mode]).stats

    print(f"\nSmolLM2-135M on vLLM CPU, train mode (temperature 1), {args.episodes} episodes per group; per trajectory: "
          "calls, roots, forks, rows; per step (one group): tokens in rows, tokens trained, prefix tokens shared by "
          "rows, tokens trained twice; seconds per episode\n")  # fmt: skip
    print("| mode     | agent      | calls | roots | forks | rows | tokens | trained | shared | twice | s/ep  |")
    print("| -------- | ---------- | ----- | ----- | ----- | ---- | ------ | ------- | ------ | ----- | ----- |")
    print("\n".join(rows))
    for mode, stats in steps.items():
        print(f"\n{mode}: the {len(args.agents)} groups as one step (build_samples stats)")
        for key in SHOWN_STATS:
            value = stats[key]
            print(f"  {key}: {value:.2f}" if isinstance(value, float) else f"  {key}: {value}")
        if stats["untrainable_reasons"]:
            print(f"  untrainable_reasons: {stats['untrainable_reasons']}")


if __name__ == "__main__":
    main()
