"""An agent that answers trivia questions, trained by trajgate without changing it.

It is an ordinary OpenAI SDK program: the only trajgate-specific thing is its `base_url`, which names the group and
the trajectory of each call (`/g/{group}/n/{size}/t/{trajectory}/v1`), and the reward it POSTs when an answer is in.
The task: answer a factual question with one word. The reward (0 to 1) is 0 for a wrong answer and 0.5 + 0.5 / (number
of words) for a right one: "Paris" earns 1, "The capital of France is Paris." 0.58, and an invented word nothing.

    python examples/short_answers.py eval  --gateway http://127.0.0.1:8000 --run demo --out before.json
    python examples/short_answers.py train --gateway http://127.0.0.1:8000 --run demo --steps 10

`train` plays rounds of groups (each question answered `--group-size` times) until the run has trained `--steps`
steps, staying at most `--ahead` rounds ahead of the trainer, so the policy that samples is at most that many
versions older than the one being trained. `eval` answers the held-out questions in evaluation mode (recorded and
rewarded, never trained) and writes the rewards per question as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import time
import urllib.request
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import openai

INSTRUCTION = "Answer with one word."

# (question, accepted answers). Every fourth one is held out for evaluation and never trained on.
QUESTIONS: list[tuple[str, tuple[str, ...]]] = [
    ("What is the capital of France?", ("paris",)),
    ("What is the capital of Japan?", ("tokyo",)),
    ("What is the capital of Italy?", ("rome",)),
    ("What is the capital of Germany?", ("berlin",)),
    ("What is the capital of Spain?", ("madrid",)),
    ("What is the capital of England?", ("london",)),
    ("What is the capital of Russia?", ("moscow",)),
    ("What is the capital of China?", ("beijing",)),
    ("What is the capital of Egypt?", ("cairo",)),
    ("What is the capital of Canada?", ("ottawa",)),
    ("What is the capital of Greece?", ("athens",)),
    ("What is the capital of Ireland?", ("dublin",)),
    ("What is the capital of Portugal?", ("lisbon",)),
    ("What is the capital of Austria?", ("vienna",)),
    ("What is the capital of Norway?", ("oslo",)),
    ("What is the capital of Sweden?", ("stockholm",)),
    ("What is the capital of Poland?", ("warsaw",)),
    ("What is the capital of Kenya?", ("nairobi",)),
    ("What is the capital of Peru?", ("lima",)),
    ("What is the capital of Cuba?", ("havana",)),
    ("What is the capital of Thailand?", ("bangkok",)),
    ("What is the capital of Australia?", ("canberra",)),
    ("What is the capital of Denmark?", ("copenhagen",)),
    ("What is the capital of Finland?", ("helsinki",)),
    ("What is the capital of Hungary?", ("budapest",)),
    ("What is the capital of Turkey?", ("ankara",)),
    ("What is the capital of Belgium?", ("brussels",)),
    ("What is the capital of the Netherlands?", ("amsterdam",)),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What color is grass?", ("green",)),
    ("What color is snow?", ("white",)),
    ("What color is a ripe banana?", ("yellow",)),
    ("What color is blood?", ("red",)),
    ("What color is coal?", ("black",)),
    ("What color is chocolate?", ("brown",)),
    ("What color is a lemon?", ("yellow",)),
    ("What color is a ripe strawberry?", ("red",)),
    ("What color do you get by mixing blue and yellow?", ("green",)),
    ("What color do you get by mixing red and white?", ("pink",)),
    ("What color is a carrot?", ("orange",)),
    ("Which animal barks?", ("dog", "dogs")),
    ("Which animal meows?", ("cat", "cats")),
    ("Which animal says moo?", ("cow", "cows")),
    ("Which animal is known as the king of the jungle?", ("lion",)),
    ("Which animal has a very long neck?", ("giraffe",)),
    ("Which insect makes honey?", ("bee", "bees", "honeybee")),
    ("Which bird is a symbol of peace?", ("dove",)),
    ("Which animal has black and white stripes?", ("zebra",)),
    ("What is the largest animal on Earth?", ("whale",)),
    ("Which animal carries its baby in a pouch?", ("kangaroo",)),
    ("What do caterpillars turn into?", ("butterfly", "butterflies", "moth")),
    ("What is a baby dog called?", ("puppy",)),
    ("What is a baby cat called?", ("kitten",)),
    ("What is the largest planet in our solar system?", ("jupiter",)),
    ("Which planet is known as the red planet?", ("mars",)),
    ("What is the closest star to Earth?", ("sun",)),
    ("What is the name of Earth's natural satellite?", ("moon",)),
    ("Which planet do we live on?", ("earth",)),
    ("What is the largest ocean on Earth?", ("pacific",)),
    ("What gas do humans need to breathe?", ("oxygen",)),
    ("What is frozen water called?", ("ice",)),
    ("What falls from clouds when it rains?", ("water", "rain", "raindrops")),
    ("What is the opposite of hot?", ("cold",)),
    ("What is the opposite of up?", ("down",)),
    ("What is the opposite of day?", ("night",)),
    ("What is the opposite of fast?", ("slow",)),
    ("What is the opposite of happy?", ("sad", "unhappy")),
    ("What is the opposite of black?", ("white",)),
    ("What is the opposite of open?", ("closed", "shut")),
    ("What is the opposite of left?", ("right",)),
    ("What is the opposite of wet?", ("dry",)),
    ("What is the opposite of big?", ("small", "little")),
    ("What is the opposite of yes?", ("no",)),
    ("What is the opposite of old?", ("young", "new")),
    ("How many legs does a spider have?", ("eight", "8")),
    ("How many days are in a week?", ("seven", "7")),
    ("How many sides does a triangle have?", ("three", "3")),
    ("How many months are in a year?", ("twelve", "12")),
    ("How many hours are in a day?", ("twenty-four", "24")),
    ("How many minutes are in an hour?", ("sixty", "60")),
    ("How many legs does a dog have?", ("four", "4")),
    ("How many wheels does a bicycle have?", ("two", "2")),
    ("How many sides does a square have?", ("four", "4")),
    ("What is two plus two?", ("four", "4")),
    ("What is three plus four?", ("seven", "7")),
    ("What is ten minus three?", ("seven", "7")),
    ("What is five times two?", ("ten", "10")),
    ("How many continents are there?", ("seven", "7")),
    ("What language is spoken in France?", ("french",)),
    ("What language is spoken in Spain?", ("spanish",)),
    ("What language is spoken in Germany?", ("german",)),
    ("What language is spoken in Italy?", ("italian",)),
    ("What language is spoken in Japan?", ("japanese",)),
    ("What language is spoken in Brazil?", ("portuguese",)),
    ("What language is spoken in Russia?", ("russian",)),
    ("What language is spoken in China?", ("chinese", "mandarin")),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("Who painted the Mona Lisa?", ("leonardo", "vinci", "davinci")),
    ("Who discovered gravity when an apple fell?", ("newton",)),
    ("What do you call a person who treats sick people?", ("doctor", "physician", "nurse")),
    ("What do you call a person who teaches students?", ("teacher",)),
    ("What do you call a person who flies airplanes?", ("pilot",)),
    ("What do you call a person who cooks in a restaurant?", ("chef", "cook")),
    ("What do bees live in?", ("hive", "hives", "beehive")),
    ("What do cows produce that people drink?", ("milk",)),
    ("What fruit keeps the doctor away?", ("apple", "apples")),
    ("What is the main ingredient of bread?", ("flour", "wheat")),
    ("What do you use to write on a blackboard?", ("chalk",)),
    ("What is the plural of mouse?", ("mice",)),
    ("What is the plural of child?", ("children",)),
    ("What is the plural of foot?", ("feet",)),
    ("What is the plural of tooth?", ("teeth",)),
    ("What season comes after winter?", ("spring",)),
    ("What season comes after summer?", ("autumn", "fall")),
    ("What day comes after Monday?", ("tuesday",)),
    ("What day comes after Friday?", ("saturday",)),
    ("What month comes after January?", ("february",)),
    ("What month comes after June?", ("july",)),
    ("What shape has no corners?", ("circle", "sphere", "oval")),
    ("What organ pumps blood through the body?", ("heart",)),
    ("What organ do we think with?", ("brain",)),
    ("What do plants need from the sun to grow?", ("light", "sunlight", "energy")),
    ("What is the hottest season of the year?", ("summer",)),
    ("What is the coldest season of the year?", ("winter",)),
]

HELD_OUT = [q for i, q in enumerate(QUESTIONS) if i % 4 == 3]
TRAIN = [q for i, q in enumerate(QUESTIONS) if i % 4 != 3]

_PUNCTUATION = str.maketrans("", "", string.punctuation.replace("-", ""))


def words(text: str) -> list[str]:
    """Lowercase words with punctuation stripped (hyphenated words stay one word: 'twenty-four')."""
    return [w for w in (raw.translate(_PUNCTUATION) for raw in text.lower().split()) if w]


def is_correct(answer: str, accepted: Sequence[str]) -> bool:
    return any(word in accepted for word in words(answer))


def reward(answer: str, accepted: Sequence[str]) -> float:
    """0 for a wrong answer; a right one earns 0.5, plus up to 0.5 for brevity (0.5 / number of words)."""
    said = words(answer)
    if not is_correct(answer, accepted):
        return 0.0
    return 0.5 + 0.5 / len(said)


@dataclass
class Answer:
    trajectory_id: str
    text: str
    reward: float
    correct: bool
    policy_version: int


class ShortAnswerAgent:
    """Answers questions through the gateway and posts a reward for each answer."""

    def __init__(self, gateway: str, run: str, api_key: str = "none", admin_key: str | None = None,
                 workers: int = 16) -> None:
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
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    def answer(self, question: str, accepted: Sequence[str], group: str, size: int, index: int,
               mode: str) -> Answer:
        trajectory = f"{group}-t{index}"
        prefix = "/eval" if mode == "eval" else ""
        # The only change an agent needs: a base_url that names its group and trajectory.
        client = openai.OpenAI(
            base_url=f"{self.gateway}{prefix}/g/{group}/n/{size}/t/{trajectory}/v1",
            api_key=self.api_key,
            max_retries=3,
            timeout=300,
        )
        raw = client.chat.completions.with_raw_response.create(
            model=self.run,
            messages=[{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        )
        text = raw.parse().choices[0].message.content or ""
        score = reward(text, accepted)
        self._http("POST", f"/v1/trajectories/{trajectory}/reward", {"reward": score}, self.api_key)
        return Answer(trajectory, text, score, is_correct(text, accepted),
                      int(raw.headers.get("x-policy-version", -1)))

    def play(self, questions: Sequence[tuple[str, Sequence[str]]], size: int, label: str,
             mode: str = "train") -> list[list[Answer]]:
        """Answer each question `size` times, all in parallel; one group per question."""
        futures = []
        for q, (question, accepted) in enumerate(questions):
            group = f"{self.run}-{self.session}-{label}-q{q}"
            futures.append([self.pool.submit(self.answer, question, accepted, group, size, i, mode)
                            for i in range(size)])
        return [[f.result() for f in group] for group in futures]

    def progress(self) -> dict[str, Any]:
        """The run as the gateway sees it: policy version, groups by state, last step."""
        return self._http("GET", f"/v1/runs/{self.run}", key=self.admin_key)


def _summary(groups: list[list[Answer]]) -> tuple[float, float, list[int]]:
    flat = [a for group in groups for a in group]
    return (
        sum(a.reward for a in flat) / len(flat),
        sum(a.correct for a in flat) / len(flat),
        sorted({a.policy_version for a in flat}),
    )


def train(agent: ShortAnswerAgent, steps: int, groups_per_round: int, size: int, ahead: int, seed: int,
          max_rounds: int) -> bool:
    """Play rounds until the run has `steps` trained steps, never more than `ahead` rounds beyond the trainer.
    False if `max_rounds` were not enough: the trainer drops groups whose answers all earn the same reward, so a
    model that never gets one right (or always does) gives it nothing to learn from."""
    rng = random.Random(seed)
    order: list[tuple[str, tuple[str, ...]]] = []
    round_no = 0
    while True:
        state = agent.progress()
        step = (state.get("last_step") or {}).get("step", 0)
        if step >= steps:
            print(f"agent: run {agent.run!r} reached step {step}; done after {round_no} rounds", flush=True)
            return True
        groups = state.get("groups", {})
        waiting = sum(groups.get(s, 0) for s in ("open", "ready", "claimed"))
        # Sample only once the newest step is served (less `ahead`), and keep at most `ahead` rounds queued.
        if waiting >= groups_per_round * (1 + ahead) or state.get("policy_version", 0) + ahead < step:
            time.sleep(0.5)
            continue
        if round_no >= max_rounds:
            print(f"agent: {round_no} rounds played, the run is at step {step} of {steps} ({groups.get('dropped', 0)} "
                  "groups dropped, most likely because all their answers earned the same reward); giving up",
                  flush=True)
            return False
        if len(order) < groups_per_round:
            batch = list(TRAIN)
            rng.shuffle(batch)
            order.extend(batch)
        questions, order = order[:groups_per_round], order[groups_per_round:]
        started = time.perf_counter()
        played = agent.play(questions, size, f"r{round_no}")
        mean, right, versions = _summary(played)
        print(
            f"agent: round {round_no:>3} | {len(played)} groups x {size} | reward {mean:.3f} | right {right:.0%}"
            f" | policy v{','.join(map(str, versions))} | {time.perf_counter() - started:.1f}s",
            flush=True,
        )
        round_no += 1


def evaluate(agent: ShortAnswerAgent, samples: int, limit: int | None) -> dict[str, Any]:
    """Answer every held-out question `samples` times in evaluation mode."""
    questions = HELD_OUT[:limit] if limit else HELD_OUT
    started = time.perf_counter()
    played = agent.play(questions, samples, f"eval{int(time.time())}", mode="eval")
    mean, right, versions = _summary(played)
    print(
        f"agent: eval | {len(questions)} held-out questions x {samples} | reward {mean:.3f} | right {right:.0%}"
        f" | policy v{','.join(map(str, versions))} | {time.perf_counter() - started:.1f}s",
        flush=True,
    )
    return {
        "run": agent.run,
        "policy_versions": versions,
        "mean_reward": mean,
        "right": right,
        "questions": [
            {
                "question": question,
                "accepted": list(accepted),
                "rewards": [a.reward for a in answers],
                "correct": [a.correct for a in answers],
                "answers": [a.text for a in answers],
                "trajectories": [a.trajectory_id for a in answers],  # GET /v1/trajectories/{id} shows the calls
            }
            for (question, accepted), answers in zip(questions, played, strict=True)
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["train", "eval"])
    parser.add_argument("--gateway", default="http://127.0.0.1:8000", help="the gateway's address (no /v1)")
    parser.add_argument("--run", default="demo", help="the run: the `model` the agent asks for")
    parser.add_argument("--api-key", default="none", help="an agent key, if the gateway requires one")
    parser.add_argument("--admin-key", help="the admin key, if the gateway requires one (to read progress)")
    parser.add_argument("--steps", type=int, default=10, help="train: stop once the run has this many steps")
    parser.add_argument("--groups-per-round", type=int, default=4, help="train: questions per round")
    parser.add_argument("--group-size", type=int, default=8, help="train: answers per question")
    parser.add_argument("--ahead", type=int, default=1, help="train: rounds the agent may run ahead of the trainer")
    parser.add_argument("--max-rounds", type=int, help="train: give up after this many rounds (default: 5 x steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=4, help="eval: answers per held-out question")
    parser.add_argument("--limit", type=int, help="eval: only the first N held-out questions")
    parser.add_argument("--out", help="eval: write the results here as JSON")
    args = parser.parse_args(argv)

    agent = ShortAnswerAgent(args.gateway, args.run, args.api_key, args.admin_key)
    try:
        if args.mode == "train":
            max_rounds = args.max_rounds or 5 * args.steps
            if not train(agent, args.steps, args.groups_per_round, args.group_size, args.ahead, args.seed, max_rounds):
                return 1
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
    sys.exit(main())
