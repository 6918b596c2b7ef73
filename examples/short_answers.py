"""An agent that answers trivia questions, trained by trajgate without changing it.

It is an ordinary OpenAI SDK program: the only trajgate-specific thing is its `base_url`, which names the group and
the trajectory of each call (`/g/{group}/n/{size}/t/{trajectory}/v1`), and the reward it POSTs when an answer is in.
The task: answer a factual question with one word. The reward (0 to 1) is 0 for a wrong answer and 0.5 + 0.5 / (number
of words) for a right one: "Paris" earns 1, "The capital of France is Paris." 0.58, and an invented word nothing.

    python examples/short_answers.py eval  --gateway http://127.0.0.1:8000 --run demo --out before.json
    python examples/short_answers.py train --gateway http://127.0.0.1:8000 --run demo --steps 10

`train` plays rounds of groups (each question answered `--group-size` times) back to back until the run has trained
`--steps` steps; the gateway's admission holds a round's first calls until the trainer can take its groups before
they are more than the run's `max_staleness` versions old. `eval` answers the held-out questions in evaluation mode (recorded and
rewarded, never trained) and writes the rewards per question as JSON. Both come from harness.py, which every example
agent shares; this file is the task.
"""

from __future__ import annotations

import string
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py beside this script, however it is run
from harness import Outcome, Task, main_for  # noqa: E402

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


Question = tuple[str, Sequence[str]]


def answer(client: openai.OpenAI, model: str, question: Question) -> Outcome:
    """One episode: a single call, its answer scored."""
    text_in, accepted = question
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": f"{text_in} {INSTRUCTION}"}],
    )
    text = raw.parse().choices[0].message.content or ""
    return Outcome(reward(text, accepted), is_correct(text, accepted), text,
                   int(raw.headers.get("x-policy-version", -1)))  # fmt: skip


def describe(question: Question) -> dict[str, Any]:
    return {"question": question[0], "accepted": list(question[1])}


TASK = Task(train=TRAIN, held_out=HELD_OUT, episode=answer, describe=describe)


if __name__ == "__main__":
    sys.exit(main_for(TASK, __doc__ or ""))
