"""How long the web UI's pages take to read on a big run: the store reads behind each page (gateway/store/ui_reads.py),
timed on a run with 100k calls (and a second, small run beside it), on SQLite and Postgres.

The run: groups of 8 trajectories of 3 calls each (a tool call, its result, an answer), every trajectory rewarded,
every group trained, 300 training steps and eval trajectories on 10 policy versions. Calls are written straight
into the store with the writer's own `write_calls`, in batches, not through the gateway. Each page is read 5 times;
the median is printed, with the first (cold) read. A page that grew with the run's size would show here as a read
far slower than on the small run. The trajectory page's figure includes laying out its call tree, not its tokens'
text, which vLLM gives (gateway.ui.token_text: a derender request the first time a page is shown).

Run: `python bench/ui_pages.py [--calls 100000] [--pg-url URL | --no-pg]` (without --pg-url it starts a throwaway
Postgres with tests.support.pgcluster, as the tests do).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from sqlalchemy import Engine, update  # noqa: E402

from gateway.store import db  # noqa: E402
from gateway.store.models import Group, Trajectory  # noqa: E402
from gateway.store.records import write_calls  # noqa: E402
from gateway.store.rewards import RewardItem, store_rewards  # noqa: E402
from gateway.store.runs import record_train_step  # noqa: E402
from gateway.store.ui_reads import (  # noqa: E402
    TrajectoryFilter,
    group_page,
    run_page,
    runs_overview,
    search_trajectories,
    trajectory_page,
)
from gateway.ui.tree_view import layout as tree_layout  # noqa: E402
from tests.support.factories import make_record  # noqa: E402

GROUP = 8
CALLS_PER_TRAJECTORY = 3
STEPS = 300
EVAL_VERSIONS = 10


def fill(engine: Engine, run: str, calls: int) -> None:
    trajectories = calls // CALLS_PER_TRAJECTORY
    batch: list[Any] = []
    rewards: list[RewardItem] = []
    for t in range(trajectories):
        group = t // GROUP
        is_eval = group % 20 == 0  # every 20th group is an evaluation group
        tid = f"{run}-t{t}"
        for seq in range(1, CALLS_PER_TRAJECTORY + 1):
            batch.append(
                make_record(
                    tid, seq=seq, seed=t * 10 + seq, run=run, group_id=f"{run}-g{group}", group_size=GROUP,
                    mode="eval" if is_eval else "train", policy_version=(group * EVAL_VERSIONS) * GROUP // trajectories,
                    prompt_tokens=64, completion_tokens=32,
                )
            )  # fmt: skip
        rewards.append(RewardItem(tid, float((t * 7) % 5) / 4))
        if len(batch) >= 3000:
            write_calls(engine, batch)
            store_rewards(engine, rewards)
            batch, rewards = [], []
    if batch:
        write_calls(engine, batch)
        store_rewards(engine, rewards)
    with engine.begin() as conn:
        conn.execute(update(Group).where(Group.run == run, Group.mode == "train").values(state="trained", trained_step=1))
        conn.execute(update(Trajectory).where(Trajectory.run == run, Trajectory.mode == "train").values(trained_step=1))
    for step in range(1, STEPS + 1):
        record_train_step(engine, run, step, {"reward_mean": 0.5, "reward_std": 0.3, "loss": 0.01, "ratio_mean": 1.0,
                                              "groups_used": 4, "groups_dropped": 0, "drop_reasons": {}})  # fmt: skip


def timed(fn: Callable[[], Any], repeats: int = 5) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return times[0], statistics.median(times)


def measure(label: str, url: str, calls: int) -> None:
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        started = time.perf_counter()
        fill(engine, "big", calls)
        fill(engine, "small", 300)
        print(f"{label}: wrote {calls} + 300 calls in {time.perf_counter() - started:.0f}s")
        _, cursor = search_trajectories(engine, TrajectoryFilter(run="big"), None, 50)
        deep = cursor
        for _ in range(100):  # the 101st page
            _, deep = search_trajectories(engine, TrajectoryFilter(run="big"), deep, 50)
        for run in ("big", "small"):
            pages: dict[str, Callable[[], Any]] = {
                "runs list": lambda: runs_overview(engine),
                "run": lambda run=run: run_page(engine, run),
                "group": lambda run=run: group_page(engine, f"{run}-g3"),
                "trajectory + call tree": lambda run=run: tree_layout(trajectory_page(engine, f"{run}-t25")["calls"]),
                "search, first page": lambda run=run: search_trajectories(engine, TrajectoryFilter(run=run), None, 50),
                "search, reward >= 0.75": lambda run=run: search_trajectories(
                    engine, TrajectoryFilter(run=run, mode="train", reward_min=0.75), None, 50
                ),
            }
            if run == "big":
                pages["search, page 101"] = lambda: search_trajectories(engine, TrajectoryFilter(run="big"), deep, 50)
            for name, fn in pages.items():
                cold, median = timed(fn)
                print(f"{label:8} {run:5} {name:24} cold {cold:7.1f} ms  median {median:7.1f} ms")
    finally:
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--pg-url", help="a Postgres database to fill (default: a throwaway cluster)")
    parser.add_argument("--no-pg", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        measure("sqlite", f"sqlite:///{Path(tmp) / 'ui.db'}", args.calls)
    if args.no_pg:
        return
    if args.pg_url:
        measure("postgres", args.pg_url, args.calls)
        return
    from tests.support.pgcluster import PgCluster, create_database

    cluster = PgCluster()
    cluster.start()
    try:
        measure("postgres", create_database(cluster.url()), args.calls)
    finally:
        cluster.destroy()


if __name__ == "__main__":
    main()
