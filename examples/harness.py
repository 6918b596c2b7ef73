"""What the example agents share so that `trajgate demo` can train and evaluate any of them: the `base_url` that names
a rollout's group and trajectory, the reward POST, training rounds (paced by the gateway's admission), the held-out
evaluation, and the command line. A task (short_answers.py, tool_agent.py) only says what its questions are and
how one episode goes; everything trajgate-specific about running it lives here.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import openai

Q = TypeVar("Q")


@dataclass
class Outcome:
    """One episode as the task scored it. `stats` are numbers a user watches besides the reward (averaged over a
    round or an evaluation), e.g. whether the episode made a valid tool call and how many model calls it took."""

    reward: float
    correct: bool
    text: str
    policy_version: int
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class Task(Generic[Q]):
    """A task the harness runs: train and held-out questions (a held-out one is never trained on), one episode
    through a client whose `base_url` already names the trajectory, and how a question shows in the eval JSON."""

    train: Sequence[Q]
    held_out: Sequence[Q]
    episode: Callable[[openai.OpenAI, str, Q], Outcome]
    describe: Callable[[Q], dict[str, Any]]


@dataclass
class Played:
    trajectory_id: str
    outcome: Outcome


class Agent(Generic[Q]):
    """Plays a task's episodes through the gateway, many in parallel, and posts each episode's reward."""

    def __init__(self, task: Task[Q], gateway: str, run: str, api_key: str = "none", admin_key: str | None = None,
                 workers: int = 16) -> None:  # fmt: skip
        self.task = task
        self.gateway = gateway.rstrip("/")
        self.run = run
        self.api_key = api_key
        self.admin_key = admin_key
        self.pool = ThreadPoolExecutor(max_workers=workers)
        self.session = uuid.uuid4().hex[:8]  # group ids stay unique across runs of this script

    def _http(self, method: str, path: str, body: Any = None, key: str | None = None) -> Any:
        headers = {"content-type": "application/json"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.gateway + path, data=data, headers=headers, method=method)
        # As patient as the model calls (the OpenAI client's 300 s): on a loaded 2-core machine the gateway once took
        # over 60 s to answer a progress poll while the trainer stepped, and the demo's agent gave up.
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())

    def play_one(self, question: Q, group: str, size: int, index: int, mode: str) -> Played:
        trajectory = f"{group}-t{index}"
        prefix = "/eval" if mode == "eval" else ""
        # The only change an agent needs: a base_url that names its group and trajectory.
        client = openai.OpenAI(
            base_url=f"{self.gateway}{prefix}/g/{group}/n/{size}/t/{trajectory}/v1",
            api_key=self.api_key,
            max_retries=3,
            timeout=300,
        )
        outcome = self.task.episode(client, self.run, question)
        self._http("POST", f"/v1/trajectories/{trajectory}/reward", {"reward": outcome.reward}, self.api_key)
        return Played(trajectory, outcome)

    def play(self, questions: Sequence[Q], size: int, label: str, mode: str = "train") -> list[list[Played]]:
        """Play each question `size` times, all in parallel; one group per question."""
        futures = []
        for q, question in enumerate(questions):
            group = f"{self.run}-{self.session}-{label}-q{q}"
            futures.append([self.pool.submit(self.play_one, question, group, size, i, mode) for i in range(size)])
        return [[f.result() for f in group] for group in futures]

    def progress(self) -> dict[str, Any]:
        """The run as the gateway sees it: policy version, groups by state, last step."""
        return self._http("GET", f"/v1/runs/{self.run}", key=self.admin_key)


@dataclass
class Summary:
    reward: float
    right: float
    versions: list[int]
    stats: dict[str, float]

    def line(self) -> str:
        extra = "".join(f" | {name} {value:.2f}" for name, value in self.stats.items())
        return (f"reward {self.reward:.3f} | right {self.right:.0%}{extra}"
                f" | policy v{','.join(map(str, self.versions))}")  # fmt: skip


def summarise(groups: list[list[Played]]) -> Summary:
    flat = [p.outcome for group in groups for p in group]
    names = sorted({name for o in flat for name in o.stats})
    return Summary(
        reward=sum(o.reward for o in flat) / len(flat),
        right=sum(o.correct for o in flat) / len(flat),
        versions=sorted({o.policy_version for o in flat}),
        stats={name: sum(o.stats.get(name, 0.0) for o in flat) / len(flat) for name in names},
    )


def rounds_of(questions: Sequence[Q], groups_per_round: int, seed: int) -> Iterator[list[Q]]:
    """Rounds of `groups_per_round` training questions: the whole set shuffled, then shuffled again, forever."""
    rng = random.Random(seed)
    order: list[Q] = []
    while True:
        if len(order) < groups_per_round:
            batch = list(questions)
            rng.shuffle(batch)
            order.extend(batch)
        round_questions, order = order[:groups_per_round], order[groups_per_round:]
        yield round_questions


def collect(agent: Agent[Q], rounds: int, groups_per_round: int, size: int, seed: int) -> Summary:
    """Play exactly `rounds` rounds and stop, whatever the run's steps: episodes recorded for another use than this
    run's training (a supervised warm start from the best of them, say). Meant for a run with admission "off" and no
    trainer; under admission "wait" its groups past the run's bound would wait for steps that never come."""
    played: list[list[Played]] = []
    for round_no, questions in zip(range(rounds), rounds_of(agent.task.train, groups_per_round, seed)):
        started = time.perf_counter()
        groups = agent.play(questions, size, f"c{round_no}")
        played.extend(groups)
        print(f"agent: collect {round_no:>3} | {len(groups)} groups x {size} | {summarise(groups).line()}"
              f" | {time.perf_counter() - started:.1f}s", flush=True)  # fmt: skip
    return summarise(played)


def train(agent: Agent[Q], steps: int, groups_per_round: int, size: int, seed: int, max_rounds: int) -> bool:
    """Play rounds back to back until the run has `steps` trained steps. The agent does not pace itself: the
    gateway admits a round's groups only while the trainer can take them before they are more than the run's
    max_staleness versions old, and holds their first calls until then (admission, docs/training.md). A round starts
    only while the run is short of `steps`, so the trainer always takes another step and makes room for it.
    False if `max_rounds` were not enough: the trainer drops groups whose episodes all earn the same reward, so a
    model that never gets one right (or always does) gives it nothing to learn from."""
    rounds = rounds_of(agent.task.train, groups_per_round, seed)
    round_no = 0
    while True:
        state = agent.progress()
        step = (state.get("last_step") or {}).get("step", 0)
        if step >= steps:
            print(f"agent: run {agent.run!r} reached step {step}; done after {round_no} rounds", flush=True)
            return True
        groups = state.get("groups", {})
        if round_no >= max_rounds:
            print(f"agent: {round_no} rounds played, the run is at step {step} of {steps} ({groups.get('dropped', 0)} "
                  "groups dropped, most likely because all their episodes earned the same reward); giving up",
                  flush=True)  # fmt: skip
            return False
        started = time.perf_counter()
        played = agent.play(next(rounds), size, f"r{round_no}")
        print(f"agent: round {round_no:>3} | {len(played)} groups x {size} | {summarise(played).line()}"
              f" | {time.perf_counter() - started:.1f}s", flush=True)  # fmt: skip
        round_no += 1


def fleet(agent: Agent[Q], steps: int, size: int, seed: int, episodes: int, poll_s: float = 5.0) -> bool:
    """Keep `episodes` episodes in flight until the run has `steps` trained steps, as a fleet of agents does: each
    worker starts the next episode the moment its last one ends, with no rounds and no pacing of its own. Groups fill
    in order (`size` episodes per question). Only the gateway's admission keeps such a fleet from outrunning the
    trainer; with admission `off` the groups it starts pile up and go stale, which is what this mode shows. An
    episode that fails is played again. False if every episode failed (the run cannot make progress)."""
    rng = random.Random(seed)
    slots = threading.Lock()
    order: list[Q] = []
    counter = {"group": 0, "slot": size, "played": 0, "failed": 0}
    question: list[Q] = []
    done = threading.Event()

    def next_slot() -> tuple[Q, str, int]:
        with slots:
            if counter["slot"] == size:
                if not order:
                    order.extend(rng.sample(list(agent.task.train), len(agent.task.train)))
                question[:] = [order.pop()]
                counter["group"] += 1
                counter["slot"] = 0
            counter["slot"] += 1
            return question[0], f"{agent.run}-{agent.session}-f{counter['group']}", counter["slot"] - 1

    def worker() -> None:
        slot = None
        while not done.is_set():
            slot = slot or next_slot()
            q, group, index = slot
            try:
                agent.play_one(q, group, size, index, "train")
                outcome, slot = "played", None
            except Exception as exc:  # refused or timed out waiting for admission: play the same slot again, so its
                outcome = "failed"  # group still fills (a group short of an episode would hold its place for ever)
                if not done.is_set():  # once the run has its steps, episodes still waiting for admission may fail
                    print(f"agent: episode {group}-t{index} failed ({type(exc).__name__}: {exc}); again", flush=True)
            with slots:
                counter[outcome] += 1

    workers = [threading.Thread(target=worker, name=f"fleet-{i}", daemon=True) for i in range(episodes)]
    for thread in workers:
        thread.start()
    started = time.perf_counter()
    while True:
        time.sleep(poll_s)
        state = agent.progress()
        step = (state.get("last_step") or {}).get("step", 0)
        admission = state.get("admission") or {}
        print(f"agent: fleet of {episodes} | step {step} | {counter['played']} episodes played, {counter['failed']} "
              f"failed | groups {state.get('groups', {})} | in flight {admission.get('in_flight')} of "
              f"{admission.get('slots')} | {time.perf_counter() - started:.0f}s", flush=True)  # fmt: skip
        if step >= steps:
            done.set()
            print(f"agent: run {agent.run!r} reached step {step}; the fleet stops", flush=True)
            return True
        if counter["failed"] >= episodes and not counter["played"]:
            done.set()
            print("agent: every episode of the fleet failed; giving up", flush=True)
            return False


def evaluate(agent: Agent[Q], samples: int, limit: int | None) -> dict[str, Any]:
    """Play every held-out question `samples` times in evaluation mode."""
    questions = list(agent.task.held_out[:limit] if limit else agent.task.held_out)
    started = time.perf_counter()
    played = agent.play(questions, samples, f"eval{int(time.time())}", mode="eval")
    summary = summarise(played)
    print(f"agent: eval | {len(questions)} held-out questions x {samples} | {summary.line()}"
          f" | {time.perf_counter() - started:.1f}s", flush=True)  # fmt: skip
    return {
        "run": agent.run,
        "policy_versions": summary.versions,
        "mean_reward": summary.reward,
        "right": summary.right,
        "stats": summary.stats,
        "questions": [
            {
                **agent.task.describe(question),
                "rewards": [p.outcome.reward for p in episodes],
                "correct": [p.outcome.correct for p in episodes],
                "answers": [p.outcome.text for p in episodes],
                "trajectories": [p.trajectory_id for p in episodes],  # GET /v1/trajectories/{id} shows the calls
            }
            for question, episodes in zip(questions, played, strict=True)
        ],
    }


def main_for(task: Task[Any], description: str, argv: Sequence[str] | None = None) -> int:
    """The command line every example agent has: `train` (rounds until the run has --steps steps), `collect`
    (--rounds rounds, then stop) or `eval`."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["train", "collect", "eval"])
    parser.add_argument("--gateway", default="http://127.0.0.1:8000", help="the gateway's address (no /v1)")
    parser.add_argument("--run", default="demo", help="the run: the `model` the agent asks for")
    parser.add_argument("--api-key", default="none", help="an agent key, if the gateway requires one")
    parser.add_argument("--admin-key", help="the admin key, if the gateway requires one (to read progress)")
    parser.add_argument("--steps", type=int, default=10, help="train: stop once the run has this many steps")
    parser.add_argument("--groups-per-round", type=int, default=4, help="train: questions per round")
    parser.add_argument("--group-size", type=int, default=8, help="train: episodes per question")
    parser.add_argument("--max-rounds", type=int, help="train: give up after this many rounds (default: 5 x steps)")
    parser.add_argument("--fleet", type=int, default=0,
                        help="train: keep this many episodes in flight, no rounds (a fleet of agents, paced only by "
                        "the gateway's admission); 0 = rounds of --groups-per-round groups")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="collect: rounds of --groups-per-round groups to play")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=4, help="eval: episodes per held-out question")
    parser.add_argument("--limit", type=int, help="eval: only the first N held-out questions")
    parser.add_argument("--out", help="eval: write the results here as JSON")
    args = parser.parse_args(argv)

    agent = Agent(task, args.gateway, args.run, args.api_key, args.admin_key)
    try:
        if args.mode == "train":
            if args.fleet > 0:
                return 0 if fleet(agent, args.steps, args.group_size, args.seed, args.fleet) else 1
            max_rounds = args.max_rounds or 5 * args.steps
            if not train(agent, args.steps, args.groups_per_round, args.group_size, args.seed, max_rounds):
                return 1
        elif args.mode == "collect":
            summary = collect(agent, args.rounds, args.groups_per_round, args.group_size, args.seed)
            print(f"agent: collected | {summary.line()}", flush=True)
        else:
            result = evaluate(agent, args.samples, args.limit)
            if args.out:
                with open(args.out, "w") as out:
                    json.dump(result, out, indent=1)
    except KeyboardInterrupt:
        return 130
    finally:
        agent.pool.shutdown(wait=False, cancel_futures=True)
    return 0


if __name__ == "__main__":
    sys.exit("harness.py is not an agent: run short_answers.py or tool_agent.py")
