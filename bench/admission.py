"""A fleet of concurrent episodes against one trainer, with and without the gateway's admission: how many groups go
stale, how stale the trained ones are, and who waits (the trainer for data, or the agents for admission).

Real gateway (in-process, SQLite by default), the recorded-vLLM fake upstream (answers at once; each call then takes
`--call-s` on the agent's side, jittered ±50 %, standing in for generation so episodes finish in varied order), and a
scripted trainer on the real store API: it waits as trainer/worker/loop.py does (enough ready groups, none due still
playing), claims, drops groups staler than max_staleness with trainer/samples.py's rule, sleeps `--step-s` for the
optimizer step, commits and publishes the next version. No model: the figures are about scheduling.

`--gateways 2` runs that many gateways on one database (give a Postgres `--database-url`: gateways on SQLite do not
wait for each other's writers before a reward), each episode sending its turns to them in turn, so the calls of one
group alternate gateways, as behind a load balancer without sticky sessions.

    python bench/admission.py [--fleet 64] [--group-size 4] [--steps 12] [--step-s 1.0] [--call-s 0.3] [--gateways 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import openai  # noqa: E402

from gateway.store import db  # noqa: E402
from gateway.store.admission import due_groups  # noqa: E402
from gateway.store.training import (  # noqa: E402
    acquire_run_lease,
    claim_ready_groups,
    commit_step,
    count_ready_groups,
    drop_groups,
    load_groups,
    publish_version,
)
from tests.support.fake_upstream import FakeUpstream  # noqa: E402
from tests.support.gateway_harness import running_gateway  # noqa: E402
from tests.support.openai_calls import sdk_kwargs  # noqa: E402
from trainer.samples import build_samples  # noqa: E402
from trainer.worker.loop import to_groups  # noqa: E402

RUN = "my-agent"
TRAINER = "bench-trainer"


class Trainer:
    """trainer/worker/loop.py's schedule without the model: wait, claim, drop stale, step (sleep), commit, publish."""

    def __init__(self, engine: Any, groups_per_step: int, max_staleness: int, step_s: float) -> None:
        self.engine, self.per_step, self.max_staleness, self.step_s = engine, groups_per_step, max_staleness, step_s
        self.steps: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _ready(self) -> bool:
        due = due_groups(self.engine, RUN)
        enough = count_ready_groups(self.engine, RUN) >= self.per_step
        return enough and (due.playing == 0 or due.ready >= self.per_step)

    def _run(self) -> None:
        step, idle = 0, 0.0
        while not self.stop.is_set():
            waiting = time.perf_counter()
            while not self._ready():
                if self.stop.wait(0.05):
                    return
            idle += time.perf_counter() - waiting
            started = time.perf_counter()
            claimed = claim_ready_groups(self.engine, RUN, TRAINER, self.per_step, 600)
            groups = to_groups(load_groups(self.engine, claimed))
            batch = build_samples(groups, current_policy_version=step, max_staleness=self.max_staleness,
                                  drop_zero_variance=False)  # fmt: skip
            seen = [t.trajectory_id for g in groups for t in g.trajectories]
            drop_groups(self.engine, batch.dropped_groups, TRAINER, trajectory_ids=seen)
            stale = batch.stats["drop_reasons"].get("stale policy", 0)
            if not batch.rows:
                self.steps.append({"stale": stale, "staleness": [], "idle_s": 0.0, "busy_s": 0.0, "trained": False})
                continue
            time.sleep(self.step_s)
            used = sorted(set(claimed) - {gid for gid, _ in batch.dropped_groups})
            trained = [t.trajectory_id for g in groups if g.group_id in used for t in g.trajectories]
            step += 1
            commit_step(self.engine, RUN, step, TRAINER, used, {"step_seconds": self.step_s, "wait_seconds": idle},
                        trajectory_ids=trained, lease_holder=TRAINER)  # fmt: skip
            publish_version(self.engine, RUN, step, "smollm2", f"/adapters/{step}")
            staleness = [
                step - 1 - min(c.policy_version for t in g.trajectories for c in t.calls)
                for g in groups
                if g.group_id in used
            ]
            busy = time.perf_counter() - started
            self.steps.append({"stale": stale, "staleness": staleness, "idle_s": idle, "busy_s": busy, "trained": True})
            idle = 0.0


def episode(bases: list[str], group: str, trajectory: str, size: int, turns: int, call_s: float,
            body: dict[str, Any], rng: random.Random, waits: list[float]) -> None:  # fmt: skip
    """One episode; turn t goes to gateway (start + t) % len(bases), start drawn per episode."""
    start = rng.randrange(len(bases)) if len(bases) > 1 else 0
    clients = [openai.OpenAI(base_url=f"{base}/g/{group}/n/{size}/t/{trajectory}/v1", api_key="k", max_retries=0,
                             timeout=600) for base in bases]  # fmt: skip
    base = bases[start]
    for turn in range(turns):
        asked = time.perf_counter()
        clients[(start + turn) % len(bases)].chat.completions.create(**body)
        if turn == 0:
            waits.append(time.perf_counter() - asked)  # the fake answers at once: this is the admission wait
        time.sleep(call_s * rng.uniform(0.5, 1.5))
    httpx.post(f"{base}/v1/trajectories/{trajectory}/reward", json={"reward": float(rng.random() < 0.5)}, timeout=60)


def fleet_member(bases: list[str], index: int, args: argparse.Namespace, body: dict[str, Any], stop: threading.Event,
                 waits: list[float], played: list[float]) -> None:  # fmt: skip
    """One group at a time, its `group_size` episodes in parallel, until told to stop."""
    rng = random.Random(index)
    round_no = 0
    while not stop.is_set():
        group = f"f{index}-r{round_no}"
        started = time.perf_counter()
        threads = [
            threading.Thread(target=episode, args=(bases, group, f"{group}-t{t}", args.group_size, args.turns,
                                                   args.call_s, body, random.Random(rng.random()), waits))  # fmt: skip
            for t in range(args.group_size)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        played.append(time.perf_counter() - started)
        round_no += 1


def measure(admission: str, args: argparse.Namespace, upstream: FakeUpstream, workdir: Path) -> dict[str, Any]:
    url = f"sqlite:///{workdir / f'{admission}.db'}" if args.database_url is None else args.database_url
    settings = {"database_url": url, "upstream_url": upstream.base_url, "base_model": "smollm2",
                "spool_dir": workdir / f"spool-{admission}", "admission_poll_s": 0.1}  # fmt: skip
    body = sdk_kwargs(upstream.fixture("chat"))
    with ExitStack() as stack:
        gateways = [
            stack.enter_context(running_gateway(**{**settings, "spool_dir": workdir / f"spool-{admission}-{n}"}))
            for n in range(args.gateways)
        ]
        gw = gateways[0]
        config = {"groups_per_step": args.groups_per_step, "max_staleness": args.max_staleness,
                  "admission": admission, "admission_timeout_s": 600}  # fmt: skip
        assert httpx.post(gw.base_url + "/runs", json={"name": RUN, "config": config}).status_code in (200, 201)
        engine = db.make_engine(url)
        acquire_run_lease(engine, RUN, TRAINER, 3600)
        while admission != "off" and any(g.app.state.router.resolve(RUN, "smollm2").admission is None
                                         for g in gateways):  # fmt: skip
            time.sleep(0.05)
        trainer = Trainer(engine, args.groups_per_step, args.max_staleness, args.step_s)
        stop = threading.Event()
        waits: list[float] = []
        played: list[float] = []
        members = [
            threading.Thread(target=fleet_member, args=([g.url for g in gateways], i, args, body, stop, waits, played),
                             daemon=True)  # fmt: skip
            for i in range(args.fleet // args.group_size)
        ]
        started = time.perf_counter()
        trainer.thread.start()
        for member in members:
            member.start()
        while sum(s["trained"] for s in trainer.steps) < args.steps:
            time.sleep(0.1)
        wall = time.perf_counter() - started
        steps = [s for s in trainer.steps if s["trained"]][: args.steps]
        upto = trainer.steps.index(steps[-1]) + 1
        counted = trainer.steps[:upto]
        stop.set()  # the fleet finishes the groups it has started; the trainer keeps consuming so none is stranded
        for member in members:
            member.join(120)
        trainer.stop.set()
        trainer.thread.join(30)
        view = httpx.get(f"{gw.base_url}/runs/{RUN}", timeout=60).json()["admission"]
        engine.dispose()
    staleness = [s for step in steps for s in step["staleness"]]
    idle = sum(s["idle_s"] for s in steps)
    busy = sum(s["busy_s"] for s in steps)
    return {
        "admission": admission,
        "wall_s": wall,
        "groups_trained": len(staleness),
        "groups_dropped_stale": sum(s["stale"] for s in counted),
        "staleness_mean": statistics.fmean(staleness) if staleness else float("nan"),
        "staleness_max": max(staleness, default=0),
        "trainer_idle_share": idle / (idle + busy) if idle + busy else float("nan"),
        "first_call_wait_mean_s": statistics.fmean(waits) if waits else float("nan"),
        "agent_wait_share": view["agent_wait_share"],
        "groups_played_per_s": len(played) / wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fleet", type=int, default=64, help="concurrent episodes (default 64)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12, help="trained steps measured per mode")
    parser.add_argument("--step-s", type=float, default=1.0, help="seconds an optimizer step takes")
    parser.add_argument("--call-s", type=float, default=0.3, help="seconds a model call takes, mean (±50 %%)")
    parser.add_argument("--turns", type=int, default=2, help="model calls per episode")
    parser.add_argument("--modes", default="off,wait")
    parser.add_argument("--database-url", help="default: a fresh SQLite file per mode")
    parser.add_argument("--gateways", type=int, default=1, help="gateways on the one database (default 1)")
    args = parser.parse_args()
    upstream = FakeUpstream().start()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for mode in args.modes.split(","):
                rows.append(measure(mode, args, upstream, Path(tmp)))
    finally:
        upstream.stop()
    print(f"fleet {args.fleet} episodes ({args.fleet // args.group_size} groups x {args.group_size}), "
          f"{args.groups_per_step} groups/step, max_staleness {args.max_staleness}, step {args.step_s}s, "
          f"call {args.call_s}s x {args.turns}, {args.steps} steps per mode, {args.gateways} gateway(s)")  # fmt: skip
    keys = [k for k in rows[0] if k != "admission"]
    print(f"| figure | {' | '.join('admission ' + r['admission'] for r in rows)} |")
    print(f"|---|{'---|' * len(rows)}")
    for key in keys:
        cells = [f"{r[key]:.3f}" if isinstance(r[key], float) else str(r[key]) for r in rows]
        print(f"| {key} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
