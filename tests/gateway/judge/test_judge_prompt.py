"""The judge's prompt and answer parsing, as pure functions: shared context once, turns labelled by id, truncation
within the budget with a marker, and every way an answer can be malformed."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from gateway.judge.answer import InvalidAnswer, parse_scores
from gateway.judge.prompt import (
    DEFAULT_RUBRIC,
    MIN_KEEP,
    RETRY_RESERVE,
    PromptTooLong,
    build_prompt,
    conversation,
    cut_middle,
    shared_prefix,
)

SYSTEM = {"role": "system", "content": "You are a careful assistant."}
TASK = {"role": "user", "content": "What is the capital of Australia? Answer in one word."}


def call(seq: int, messages: list[Any], completion: str | None = None, tool_calls: Any = None, **extra: Any) -> dict:
    return {
        "seq": seq, "choice_index": 0, "endpoint": "chat", "messages": messages, "completion": completion,
        "tool_calls": tool_calls, "status_code": 200, "error": None, **extra,
    }  # fmt: skip


def trajectory(trajectory_id: str, *calls: dict) -> dict:
    return {"trajectory_id": trajectory_id, "calls": list(calls)}


def tool_call(name: str, arguments: dict, call_id: str = "call_1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def search_trajectory(trajectory_id: str, result: str, answer: str) -> dict:
    """search tool call -> tool result -> final answer, the history kept and echoed the way SDK agents do."""
    asked = [SYSTEM, TASK]
    reply = {"role": "assistant", "content": None, "tool_calls": [tool_call("search", {"q": "capital of Australia"})]}
    second = [*asked, reply, {"role": "tool", "tool_call_id": "call_1", "content": result}]
    return trajectory(
        trajectory_id,
        call(1, asked, None, reply["tool_calls"]),
        call(2, second, answer),
    )


def group() -> list[dict]:
    return [
        search_trajectory("t-a", "Canberra is the capital city of Australia.", "Canberra"),
        trajectory("t-b", call(1, [SYSTEM, TASK], "Sydney")),
        trajectory("t-c", call(1, [SYSTEM, TASK], "Canberra.")),
    ]


def test_prompt_has_shared_context_once_and_each_trajectory_labelled() -> None:
    prompt = build_prompt(group())
    assert prompt.trajectory_ids == ["t-a", "t-b", "t-c"]
    assert prompt.user.count(TASK["content"]) == 1 and prompt.user.count(SYSTEM["content"]) == 1
    assert prompt.user.index("# Shared context") < prompt.user.index('# Trajectory "t-a"')
    assert '# Trajectory "t-a" (2 model calls)' in prompt.user and '# Trajectory "t-b" (1 model call)' in prompt.user
    section_a = prompt.user.split('# Trajectory "t-a"')[1].split('# Trajectory "t-b"')[0]
    assert '[assistant calls tool search]\n{"q": "capital of Australia"}' in section_a
    assert "[tool result (call_1)]\nCanberra is the capital city of Australia." in section_a
    assert "[assistant, final answer]\nCanberra" in section_a
    assert section_a.count("[assistant") == 2  # the echoed tool-call message is not shown twice
    assert '"t-a", "t-b", "t-c"' in prompt.system and DEFAULT_RUBRIC.splitlines()[0] in prompt.system
    assert prompt.messages == [{"role": "system", "content": prompt.system}, {"role": "user", "content": prompt.user}]
    assert not prompt.truncation.truncated and prompt.truncation.prompt_chars == prompt.chars
    # The schema a guided decoder follows: every id once, in order; scores in [0, 1].
    items = prompt.schema["properties"]["scores"]["prefixItems"]
    assert [item["properties"]["trajectory_id"]["const"] for item in items] == ["t-a", "t-b", "t-c"]
    assert items[0]["properties"]["score"] == {"type": "number", "minimum": 0, "maximum": 1}


def test_custom_rubric_replaces_the_default() -> None:
    prompt = build_prompt(group(), rubric="Score 1 if the answer is Canberra, else 0.")
    assert "Score 1 if the answer is Canberra, else 0." in prompt.system
    assert DEFAULT_RUBRIC.splitlines()[0] not in prompt.system


def test_shared_prefix_stops_at_the_first_difference() -> None:
    other_task = {"role": "user", "content": "What is the capital of Austria?"}
    trajectories = [trajectory("a", call(1, [SYSTEM, TASK], "x")), trajectory("b", call(1, [SYSTEM, other_task], "y"))]
    assert shared_prefix(trajectories) == [SYSTEM]
    prompt = build_prompt(trajectories)
    assert prompt.user.count(SYSTEM["content"]) == 1 and TASK["content"] in prompt.user and "Austria" in prompt.user


def test_conversation_follows_new_context_and_failed_calls() -> None:
    first = [SYSTEM, TASK]
    restarted = [{"role": "user", "content": "Summary so far: the user wants a capital city."}]
    turns = trajectory(
        "t",
        call(1, first, "Let me think."),
        call(2, restarted, None, None, status_code=500, error="EngineCore died"),
        call(3, [*restarted, {"role": "user", "content": "again"}], "Canberra"),
    )
    messages = conversation(turns)
    roles = [m["role"] for m in messages]
    assert roles == ["system", "user", "assistant", "note", "user", "call failed", "user", "assistant"]
    assert messages[5]["content"] == "status 500: EngineCore died"


def test_completions_calls_render_prompt_and_completion() -> None:
    trajectories = [
        trajectory("p-1", call(1, "Q: 2+2=\nA:", " 4", endpoint="completions")),
        trajectory("p-2", call(1, "Q: 2+2=\nA:", " 5", endpoint="completions")),
    ]
    prompt = build_prompt(trajectories)
    assert prompt.user.count("Q: 2+2=") == 1 and "[completion, final answer]\n 5" in prompt.user


def test_cut_middle_keeps_head_and_tail_and_says_how_much() -> None:
    text = "HEAD" + "x" * 10_000 + "TAIL"
    cut, removed = cut_middle(text, 200)
    assert len(cut) <= 200 and cut.startswith("HEAD") and cut.endswith("TAIL")
    assert f"…[truncated {removed} chars]…" in cut
    assert len(cut) - len(f"…[truncated {removed} chars]…") == len(text) - removed
    assert cut_middle("short", 200) == ("short", 0)


def long_tool_group(tool_chars: int, answer_chars: int = 0) -> list[dict]:
    answer = "Canberra" + (" because" * (answer_chars // 8))
    return [
        search_trajectory("t-a", "Canberra. " + "lorem ipsum " * (tool_chars // 12), answer),
        trajectory("t-b", call(1, [SYSTEM, TASK], "Sydney")),
    ]


def test_tool_outputs_are_truncated_first() -> None:
    prompt = build_prompt(long_tool_group(20_000), max_context_chars=8_000)
    report = prompt.truncation
    assert report.truncated and report.tool_outputs_truncated == 1 and report.messages_truncated == 0
    assert prompt.chars <= 8_000 - RETRY_RESERVE and report.prompt_chars == prompt.chars
    assert f"…[truncated {report.chars_removed} chars]…" in prompt.user
    assert "[tool result (call_1)]\nCanberra. lorem" in prompt.user  # the head of the output survives
    assert "[assistant, final answer]\nCanberra" in prompt.user and "Sydney" in prompt.user


def test_long_messages_are_truncated_when_tool_outputs_are_not_enough() -> None:
    prompt = build_prompt(long_tool_group(20_000, answer_chars=20_000), max_context_chars=8_000)
    report = prompt.truncation
    assert report.tool_outputs_truncated == 1 and report.messages_truncated == 1
    assert prompt.chars <= 8_000 - RETRY_RESERVE
    assert prompt.user.count("…[truncated ") == 2
    # Short messages are never cut: only what is longer than the level everything was cut to.
    assert "[assistant, final answer]\nSydney" in prompt.user


def test_prompt_too_long_even_when_everything_is_cut() -> None:
    many = [trajectory(f"t-{i}", call(1, [SYSTEM, TASK], "x" * 1_000)) for i in range(40)]
    with pytest.raises(PromptTooLong, match="raise max_context_chars"):
        build_prompt(many, max_context_chars=4_000)
    assert build_prompt(many, max_context_chars=40 * (MIN_KEEP + 60) + 6_000).truncation.messages_truncated == 40


IDS = ["t-a", "t-b", "t-c"]


def answer(**scores: Any) -> str:
    return json.dumps({"scores": [{"trajectory_id": t.replace("_", "-"), "score": s, "explanation": "because"}
                                  for t, s in scores.items()]})  # fmt: skip


def test_parse_valid_answers_in_any_accepted_shape() -> None:
    parsed = parse_scores(answer(t_b=0.0, t_a=1, t_c=0.25), IDS)
    assert [(s.trajectory_id, s.score) for s in parsed] == [("t-a", 1.0), ("t-b", 0.0), ("t-c", 0.25)]
    fenced = "Here are my scores:\n```json\n" + answer(t_a=0.5, t_b=0.5, t_c=0.5) + "\n```\nHope this helps."
    assert [s.score for s in parse_scores(fenced, IDS)] == [0.5, 0.5, 0.5]
    prose = "Sure! " + answer(t_a=0.1, t_b=0.2, t_c=0.3) + " Done."
    assert [s.score for s in parse_scores(prose, IDS)] == [0.1, 0.2, 0.3]
    mapping = json.dumps({"scores": {"t-a": 0.9, "t-b": {"score": "0.4", "reason": "meh\nsecond line"}, "t-c": 0}})
    parsed = parse_scores(mapping, IDS)
    assert [s.score for s in parsed] == [0.9, 0.4, 0.0] and parsed[1].explanation == "meh second line"
    bare = json.dumps([{"id": t, "reward": 1} for t in IDS])
    assert [s.score for s in parse_scores(bare, IDS)] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "empty"),
        ("I think t-a is best, then t-c.", "not a JSON object"),
        ('{"scores": [{"trajectory_id": "t-a", "score": 0.5', "not a JSON object"),
        (answer(t_a=0.5, t_b=0.5), "no score for 't-c'"),
        (answer(t_a=0.5, t_b=0.5, t_c=0.5, t_d=0.5), "unknown trajectory id 't-d'"),
        (answer(t_a=0.5, t_b=1.5, t_c=0.5), "outside [0, 1]"),
        (answer(t_a=0.5, t_b=-0.1, t_c=0.5), "outside [0, 1]"),
        (answer(t_a=0.5, t_b=8, t_c=0.5), "outside [0, 1]"),
        (answer(t_a=0.5, t_b=math.nan, t_c=0.5), "not a number"),
        (answer(t_a=0.5, t_b=True, t_c=0.5), "not a number"),
        (answer(t_a=0.5, t_b="high", t_c=0.5), "not a number"),
        (answer(t_a=0.5, t_b=None, t_c=0.5), "not a number"),
    ],
)
def test_malformed_answers_are_refused(text: str, problem: str) -> None:
    with pytest.raises(InvalidAnswer, match=problem.replace("[", r"\[").replace("]", r"\]")):
        parse_scores(text, IDS)


def test_duplicate_id_is_refused() -> None:
    twice = json.dumps({"scores": [{"trajectory_id": t, "score": 0.5} for t in ["t-a", "t-a", "t-b", "t-c"]]})
    with pytest.raises(InvalidAnswer, match="more than once"):
        parse_scores(twice, IDS)
