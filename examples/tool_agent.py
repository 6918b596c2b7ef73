"""A multi-turn tool agent that learns to look things up, trained through trajgate.

The task: answer questions about the people of a made-up company directory ("What is Kaven Dorsa's phone
extension?"). The names, cities and extensions are generated, so no model knows them: the only way to a right
answer is a tool, `search(query)` (the records of the people whose name matches) or `lookup(id)` (one record), then
a short final answer: two or three model calls. Reward 1 for the right answer; 0.1 for an episode that looked
something up (its tool calls ran) but did not answer right; 0 otherwise (a tool call the tools cannot run, or a wrong
answer or none without looking anything up).

The agent is a plain OpenAI SDK tool loop. The only trajgate-specific code is the `base_url` (it names the group
and the trajectory, so the gateway groups the rollouts for GRPO) and the POST of the reward at the end.

SmolLM2-135M's chat template ignores `tools`, so the system prompt describes them and two worked episodes show the
hermes `<tool_call>` markup that vLLM's parser (`--tool-call-parser hermes`) turns into `tool_calls`.

    python examples/tool_agent.py train --gateway http://127.0.0.1:8000 --run demo --steps 10
    python examples/tool_agent.py eval --gateway http://127.0.0.1:8000 --run demo --out eval.json
"""

from __future__ import annotations

import json
import random
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py beside this script, however it is run
from harness import Outcome, Task, main_for  # noqa: E402

MAX_CALLS = 3  # search (and perhaps lookup), then the answer
MAX_TOKENS = 48  # a tool call is ~30 tokens; a final answer is a word or two
# Partial credit for looking something up. With the right answer alone as reward, the base model's episodes on 61 of
# the 96 training questions all earn the same (measured: 8 episodes each), so 3 in 4 groups carry no signal and the
# trainer drops them (zero reward variance); with the credit, 4 in 5 groups carry one, and the tool call it pays for
# is the first thing the agent has to learn.
LOOKUP_CREDIT = 0.1

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Find people in the directory whose name matches the query; returns their records.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "The directory record of the person with this id: city and phone extension.",
            "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]},
        },
    },
]

# Short on purpose: every token of the prompt is in every call and every training row (the long version, with the
# tools' signatures and the markup spelled out, cost 84 more tokens a call and did no better: 14.6% vs 12.5% right).
SYSTEM = "Answer questions about people in the company directory: search for the name, then reply with the answer only."

_SYLLABLES = ["ka", "lo", "mi", "ven", "dor", "sa", "ri", "tul", "bre", "qua", "zen", "mor", "fi", "el", "nax",
              "pri", "gol", "ush", "ta", "wen", "cor", "yl", "dra", "bo"]  # fmt: skip
FIELDS = {"extension": "What is {name}'s phone extension?", "city": "In which city does {name} work?"}


@dataclass(frozen=True)
class Person:
    id: str
    name: str
    city: str
    extension: str

    def record(self) -> dict[str, str]:
        return {"id": self.id, "name": self.name, "city": self.city, "extension": self.extension}


@dataclass(frozen=True)
class Question:
    text: str
    answer: str
    person_id: str


class MalformedCall(ValueError):
    """A tool call the tools cannot run: an unknown tool, arguments that are not a JSON object of the right keys."""


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(syllables)).capitalize()


@dataclass
class Directory:
    """The made-up fact base: people, and the questions about them split into train and held-out by person (a
    held-out question is about someone no training question mentions). `examples` are the people of the worked
    episodes in the prompt; no question asks about them."""

    people: list[Person]
    examples: tuple[Person, Person]
    train: list[Question] = field(default_factory=list)
    held_out: list[Question] = field(default_factory=list)

    @classmethod
    def generate(cls, seed: int = 0, size: int = 64) -> Directory:
        """Deterministic by seed. Every name, city and extension is distinct, so an answer names one person."""
        rng = random.Random(seed)
        names: set[str] = set()
        cities: set[str] = set()
        total = size + 2
        while len(names) < total:
            names.add(f"{_word(rng, 2)} {_word(rng, 2)}")
        while len(cities) < total:
            cities.add(_word(rng, 3))
        ids = rng.sample(range(100, 1000), total)
        extensions = rng.sample(range(1000, 10000), total)
        # Sets iterate in an order that varies between processes: sort, then shuffle each list on its own (sorted
        # names beside sorted cities would let a name's first letters give its city away).
        name_list, city_list = sorted(names), sorted(cities)
        rng.shuffle(name_list)
        rng.shuffle(city_list)
        people = [Person(f"P{i}", n, c, str(e))
                  for i, n, c, e in zip(ids, name_list, city_list, extensions, strict=True)]  # fmt: skip
        directory = cls(people=people[2:], examples=(people[0], people[1]))
        for index, person in enumerate(directory.people):
            questions = [Question(template.format(name=person.name), getattr(person, key), person.id)
                         for key, template in FIELDS.items()]  # fmt: skip
            (directory.held_out if index % 4 == 3 else directory.train).extend(questions)
        return directory

    def everyone(self) -> list[Person]:
        return [*self.examples, *self.people]

    def search(self, query: str) -> list[dict[str, str]]:
        """The records of the people sharing a word with the query, most shared words first (at most 3): a full name
        finds its person first."""
        wanted = set(words(query))
        scored = [(len(wanted & set(words(p.name))), p) for p in self.everyone()]
        found = sorted((s for s in scored if s[0]), key=lambda s: -s[0])[:3]
        return [p.record() for _, p in found]

    def lookup(self, person_id: str) -> dict[str, str]:
        for person in self.everyone():
            if person.id.lower() == person_id.strip().lower():
                return person.record()
        return {"error": f"no person with id {person_id!r}"}

    def call(self, name: str, arguments: str) -> str:
        """Run a tool call as the model wrote it; the result is what the model reads next, as JSON."""
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            raise MalformedCall(f"arguments are not JSON: {exc}") from None
        if not isinstance(args, dict):
            raise MalformedCall("arguments are not an object")
        if name == "search" and isinstance(args.get("query"), str):
            return json.dumps(self.search(args["query"]))
        if name == "lookup" and isinstance(args.get("id"), str):
            return json.dumps(self.lookup(args["id"]))
        raise MalformedCall(f"no tool {name!r} taking {sorted(args)}")


_PUNCTUATION = str.maketrans("", "", string.punctuation)


def words(text: str) -> list[str]:
    return [w for w in (raw.translate(_PUNCTUATION) for raw in text.lower().split()) if w]


def example_messages(directory: Directory) -> list[dict[str, Any]]:
    """Two worked episodes, one per kind of question, written as the model should write them (measured: two
    examples make twice the right answers of one on the base model)."""
    messages: list[dict[str, Any]] = []
    for person, key in zip(directory.examples, FIELDS, strict=True):
        call = json.dumps({"name": "search", "arguments": {"query": person.name}})
        messages += [
            {"role": "user", "content": FIELDS[key].format(name=person.name)},
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": json.dumps(directory.search(person.name))},
            {"role": "assistant", "content": getattr(person, key)},
        ]
    return messages


def right(final: str | None, answer: str) -> bool:
    """The final answer contains the right value as a word."""
    return final is not None and answer.lower() in words(final)


def reward(final: str | None, answer: str, looked_up: bool) -> float:
    """1 for the right answer; LOOKUP_CREDIT for an episode that ran a tool call but got no right answer; else 0.
    A caller scores an episode with a call the tools could not run 0 without asking."""
    if right(final, answer):
        return 1.0
    return LOOKUP_CREDIT if looked_up else 0.0


@dataclass
class Episode:
    """How an episode went. `outcome`: right, wrong, malformed (a tool call the tools cannot run, or markup the
    parser could not read), no_answer (still calling tools after MAX_CALLS calls)."""

    outcome: str
    reward: float
    final: str | None
    calls: int
    tool_calls: int  # valid ones: the tools ran them
    policy_version: int
    transcript: list[dict[str, Any]]  # from the question on

    def scored(self) -> Outcome:
        """What the harness records and averages: the tool-use numbers a user watches besides the reward."""
        stats = {"tool_call": float(self.tool_calls > 0), "calls": float(self.calls),
                 "malformed": float(self.outcome == "malformed")}  # fmt: skip
        text = self.final if self.final is not None else f"({self.outcome})"
        return Outcome(self.reward, self.outcome == "right", text, self.policy_version, stats)


def run_episode(client: openai.OpenAI, model: str, directory: Directory, question: Question,
                temperature: float | None = None) -> Episode:
    """The agent: the usual tool loop, at most MAX_CALLS model calls."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        *example_messages(directory),
        {"role": "user", "content": question.text},
    ]
    start = len(messages) - 1
    extra = {} if temperature is None else {"temperature": temperature}
    tool_calls = 0
    version = -1
    for calls in range(1, MAX_CALLS + 1):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS, **extra
        )
        version = int(raw.headers.get("x-policy-version", -1))
        message = raw.parse().choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            final = message.content or ""
            if "<tool_call>" in final:  # markup the parser could not read
                return Episode("malformed", 0.0, None, calls, tool_calls, version, messages[start:])
            outcome = "right" if right(final, question.answer) else "wrong"
            score = reward(final, question.answer, tool_calls > 0)
            return Episode(outcome, score, final, calls, tool_calls, version, messages[start:])
        for call in message.tool_calls:
            try:
                result = directory.call(call.function.name, call.function.arguments)
            except MalformedCall:
                return Episode("malformed", 0.0, None, calls, tool_calls + 1, version, messages[start:])
            tool_calls += 1
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return Episode("no_answer", reward(None, question.answer, tool_calls > 0), None, MAX_CALLS, tool_calls, version,
                   messages[start:])


DIRECTORY = Directory.generate(0)


def describe(question: Question) -> dict[str, Any]:
    return {"question": question.text, "accepted": [question.answer]}


TASK = Task(
    train=DIRECTORY.train,
    held_out=DIRECTORY.held_out,
    episode=lambda client, model, question: run_episode(client, model, DIRECTORY, question).scored(),
    describe=describe,
)


if __name__ == "__main__":
    sys.exit(main_for(TASK, __doc__ or ""))
