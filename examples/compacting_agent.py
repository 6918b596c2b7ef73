"""A chat agent that answers several questions in one conversation and compacts its history when it grows past a
budget, trained by trajgate as one trajectory.

It is an ordinary OpenAI SDK program: the only trajgate-specific things are its `base_url` (harness.py names the group
and trajectory) and the reward POST. Each episode asks QUESTIONS_PER_EPISODE questions in a row; once the history
holds more than KEEP_TURNS answered questions, the agent asks the model to summarise the conversation and carries on
from [system, summary, next question], the way agents with a context budget do. The gateway records the episode as a
tree of calls: each question extends the previous answer, the summarising call extends the last answer too, and the
first call after a compaction is a new root with reason `compacted`, which the calls after it extend; the trainer
trains one row per path, every sampled token once.

    python examples/compacting_agent.py train --gateway http://127.0.0.1:8000 --run demo --steps 10
    python examples/compacting_agent.py eval --gateway http://127.0.0.1:8000 --run demo --out eval.json

Reward: the fraction of the episode's questions answered right (short_answers.py's questions and check).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py and short_answers.py beside this script
from harness import Outcome, Task, main_for  # noqa: E402
from short_answers import INSTRUCTION, QUESTIONS, Question, is_correct  # noqa: E402

SYSTEM = "You are a helpful assistant. Keep answers short."
SUMMARISE = "Summarise our conversation so far in one short sentence."
QUESTIONS_PER_EPISODE = 3
KEEP_TURNS = 2  # answered questions kept verbatim before the history is compacted
MAX_TOKENS = 24

Episode = Sequence[Question]
# Episodes of consecutive questions; every fourth held out, as in short_answers.py.
EPISODES: list[Episode] = [
    QUESTIONS[i : i + QUESTIONS_PER_EPISODE] for i in range(0, len(QUESTIONS) - QUESTIONS_PER_EPISODE + 1, 2)
]
TRAIN = [e for i, e in enumerate(EPISODES) if i % 4 != 3]
HELD_OUT = [e for i, e in enumerate(EPISODES) if i % 4 == 3]


def ask(client: openai.OpenAI, model: str, messages: list[dict[str, Any]]) -> tuple[str, int]:
    """One model call: the reply's text and the policy version that served it."""
    raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=MAX_TOKENS)
    return raw.parse().choices[0].message.content or "", int(raw.headers.get("x-policy-version", -1))


def episode(client: openai.OpenAI, model: str, questions: Episode) -> Outcome:
    """Answer the questions in one conversation, compacting it when it holds more than KEEP_TURNS answers."""
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    right = 0
    answers = []
    version = -1
    for text, accepted in questions:
        if (len(history) - 1) // 2 >= KEEP_TURNS:
            summary, _ = ask(client, model, [*history, {"role": "user", "content": SUMMARISE}])
            history = [history[0], {"role": "user", "content": f"Summary of our conversation so far: {summary}"}]
        history.append({"role": "user", "content": f"{text} {INSTRUCTION}"})
        answer, version = ask(client, model, history)
        history.append({"role": "assistant", "content": answer})
        right += is_correct(answer, accepted)
        answers.append(answer)
    return Outcome(right / len(questions), right == len(questions), " | ".join(answers), version)


def describe(questions: Episode) -> dict[str, Any]:
    return {"questions": [q for q, _ in questions], "accepted": [list(a) for _, a in questions]}


TASK = Task(train=TRAIN, held_out=HELD_OUT, episode=episode, describe=describe)


if __name__ == "__main__":
    sys.exit(main_for(TASK, __doc__ or ""))
