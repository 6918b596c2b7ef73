"""The demo's supervised warm start: exported episodes -> `--sft-data` conversations. Each assistant turn is the text
the model produced, which renders back into exactly the sampled tokens (the end token is the template's); only
episodes at or above the reward threshold, only trajectories whose calls extend one another."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.chat_tokenizers import CHATML_TOOLS, chat_tokenizer
from trainer.demo.warm_start import conversation_of, select_conversations, write_conversations
from trainer.sft_data import conversation_rows, read_conversations

SYSTEM = {"role": "system", "content": "You look things up."}
# A worked example the agent puts in its prompt.
EXAMPLE = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "It snows."}]
USER = {"role": "user", "content": "What is the weather in Paris?"}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PARSED = {"role": "assistant", "content": None,
          "tool_calls": [{"id": "c1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}  # fmt: skip
TOOL = {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 21}'}
ANSWER_TEXT = "It is sunny in Paris."


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return chat_tokenizer(CHATML_TOOLS)


def decoder(tokenizer: Any) -> Any:
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode([i for i in ids if i != end], skip_special_tokens=False))

    return decode


def exported(tokenizer: Any, reward: float | None = 1.0) -> dict[str, Any]:
    """A two-call tool episode as `trajgate export` writes it: what the agent sent each call (the parsed tool call
    in the history) and the ids the model sampled, ending on its end token."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def call(seq: int, messages: list[dict[str, Any]], text: str) -> dict[str, Any]:
        return {"seq": seq, "choice_index": 0, "messages": messages, "completion": None,
                "completion_token_ids": [*tokenizer.encode(text, add_special_tokens=False), end]}  # fmt: skip

    first = [SYSTEM, *EXAMPLE, USER]
    return {"trajectory_id": "t1", "reward": reward,
            "calls": [call(20, [*first, PARSED, TOOL], ANSWER_TEXT), call(10, first, CALL_TEXT)]}  # fmt: skip


def test_each_turn_is_the_text_the_model_wrote_and_renders_back_into_its_sampled_tokens(
    tokenizer: Any, tmp_path: Path
) -> None:
    trajectory = exported(tokenizer)
    conversation = conversation_of(trajectory, decoder(tokenizer))
    example = [EXAMPLE[0], {**EXAMPLE[1], "weight": 0}]  # the agent's worked example: context, not trained
    assert conversation == {"messages": [SYSTEM, *example, USER, {"role": "assistant", "content": CALL_TEXT}, TOOL,
                                         {"role": "assistant", "content": ANSWER_TEXT}]}  # fmt: skip

    # Through the file `trajgate train --sft-data` reads: the trained tokens are the sampled ones, each turn closed
    # by the template's end (the sampled end token is that same token), and nothing of the worked example.
    (parsed,) = read_conversations(write_conversations([conversation], tmp_path / "sft.jsonl"))
    (row,) = conversation_rows(tokenizer, parsed, 0)
    trained = [i for i, m in zip(row.input_ids, row.loss_mask) if m]
    newline = tokenizer.encode("\n", add_special_tokens=False)
    by_seq = sorted(trajectory["calls"], key=lambda c: c["seq"])
    assert trained == [*by_seq[0]["completion_token_ids"], *newline, *by_seq[1]["completion_token_ids"], *newline]


def test_only_episodes_at_or_above_the_threshold_are_kept(tokenizer: Any) -> None:
    episodes = [exported(tokenizer, r) for r in (1.0, 0.1, None, 0.0, 1.0)]
    selection = select_conversations(episodes, 1.0, decoder(tokenizer))
    assert (selection.episodes, selection.selected, selection.skipped) == (4, 2, 0)
    assert len(selection.conversations) == 2
    assert select_conversations(episodes, 0.1, decoder(tokenizer)).selected == 3


def test_calls_that_do_not_extend_one_another_are_skipped_not_guessed(tokenizer: Any) -> None:
    rewritten = exported(tokenizer)
    rewritten["calls"][0]["messages"] = [SYSTEM, {"role": "user", "content": "a new question"}]  # history replaced
    unanswered = exported(tokenizer)
    unanswered["calls"][0]["messages"] = [SYSTEM, *EXAMPLE, USER, TOOL, TOOL]  # no assistant turn where its answer was
    branch = copy.deepcopy(exported(tokenizer))
    branch["calls"][1]["completion_token_ids"] = None  # a call with no recorded ids
    for bad in (rewritten, unanswered, branch):
        assert conversation_of(bad, decoder(tokenizer)) is None
    selection = select_conversations([rewritten, exported(tokenizer)], 1.0, decoder(tokenizer))
    assert (selection.selected, selection.skipped, len(selection.conversations)) == (2, 1, 1)


def test_the_file_is_one_conversation_per_line(tokenizer: Any, tmp_path: Path) -> None:
    conversation = conversation_of(exported(tokenizer), decoder(tokenizer))
    assert conversation is not None
    path = write_conversations([conversation, conversation], tmp_path / "sft.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == [conversation, conversation]
