"""The example agents' shared harness: `collect` plays exactly the rounds asked, whatever the run's steps (the demo's
warm start records the base model's episodes with no trainer behind them), over every training question before any
repeats, and never a held-out one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tests.support.examples import load_example

harness = load_example("harness")


class Recorder(harness.Agent):  # type: ignore[misc,name-defined]
    """Plays no model: each episode's reward is its question, so the summary shows what was played."""

    def __init__(self, task: Any) -> None:
        super().__init__(task, "http://127.0.0.1:9", "demo")
        self.rounds: list[tuple[str, list[int], int]] = []

    def play(self, questions: Sequence[int], size: int, label: str, mode: str = "train") -> list[list[Any]]:
        self.rounds.append((label, list(questions), size))
        return [[harness.Played(f"{label}-q{q}-{i}", harness.Outcome(float(q), q % 2 == 0, "", 0)) for i in range(size)]
                for q in questions]  # fmt: skip

    def progress(self) -> dict[str, Any]:
        raise AssertionError("collect must not wait for the run's steps")


def test_collect_plays_exactly_the_rounds_asked_over_the_training_questions() -> None:
    task = harness.Task(train=list(range(10)), held_out=[100, 101], episode=None, describe=None)
    agent = Recorder(task)
    summary = harness.collect(agent, rounds=4, groups_per_round=3, size=2, seed=7)
    agent.pool.shutdown()
    assert [label for label, _, _ in agent.rounds] == ["c0", "c1", "c2", "c3"]
    assert all(len(questions) == 3 and size == 2 for _, questions, size in agent.rounds)
    played = [q for _, questions, _ in agent.rounds for q in questions]
    assert played[:10] != list(range(10))  # shuffled, not in order
    assert len(set(played[:10])) == 10  # every training question once before any comes again
    assert not set(played) & set(task.held_out)
    assert summary.reward == sum(played) / len(played)
    assert summary.right == sum(q % 2 == 0 for q in played) / len(played)
