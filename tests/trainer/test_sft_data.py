"""`trajgate train --sft-data FILE`: the assistant masks on real chat templates and a real BPE tokenizer (tool calls,
several turns, a template that rewrites history, a merge across the prompt's boundary, weight 0), the loss against a
float64 cross-entropy of those tokens, the bad-file errors with their line numbers, the step plan, and the worker
committing the warm start as the run's steps, from which the run's own objective goes on."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.cli import main
from gateway.store import db
from gateway.store.runs import steps_after, upsert_run
from tests.support.chat_tokenizers import CHATML_TOOLS, DROPS_REASONING, chat_tokenizer
from tests.support.tiny_models import build_tiny_llama, make
from tests.support.trainer_runs import made, make_trainer, seed_groups
from trainer.checkpoint import latest_checkpoint
from trainer.loss import LossConfig
from trainer.sft_data import (
    SftDataError,
    conversation_rows,
    parse_line,
    plan_steps,
    read_conversations,
    render,
    sft_data_rows,
)
from trainer.step import train_step
from trainer.worker.loop import format_sft_data_step, warm_start

CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TOOL_LOOP: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 21}'},
        {"role": "assistant", "content": "It is sunny in Paris."},
    ],
    "tools": TOOLS,
}


def spans(tokenizer: Any, ids: list[int], mask: list[int]) -> list[str]:
    """The text of each run of trained tokens."""
    out, current = [], []
    for token, trained in zip(ids, mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            out.append(tokenizer.decode(current))
            current = []
    if current:
        out.append(tokenizer.decode(current))
    return out


# ------------------------------------------------------------------------------------ masks


def test_a_tool_loop_trains_exactly_the_assistant_turns_and_their_end_tokens() -> None:
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    conversation = parse_line(json.dumps(TOOL_LOOP), 1)
    (row,) = conversation_rows(tokenizer, conversation, 0)

    assert row.input_ids == render(tokenizer, conversation, 5, False)  # the whole conversation, as vLLM renders it
    assert spans(tokenizer, row.input_ids, row.loss_mask) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
        "It is sunny in Paris.<|im_end|>\n",
    ]
    # What precedes each trained span is the prompt vLLM would have sent for that turn, token for token.
    first = row.loss_mask.index(1)
    assert row.input_ids[:first] == render(tokenizer, conversation, 2, True)
    second = first + row.loss_mask[first:].index(0) + row.loss_mask[first:][row.loss_mask[first:].index(0):].index(1)
    assert row.input_ids[:second] == render(tokenizer, conversation, 4, True)
    assert row.behaviour_logprobs == [0.0] * len(row) and row.trajectory_id == "line-1"


def test_a_template_that_rewrites_history_gives_each_turn_its_own_row() -> None:
    tokenizer = chat_tokenizer(DROPS_REASONING)
    line = {
        "messages": [
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "The answer is 42.", "reasoning": "think"},
            {"role": "user", "content": "How are you today?"},
            {"role": "assistant", "content": "Hello!", "reasoning": "hmm"},
        ]
    }
    conversation = parse_line(json.dumps(line), 7)
    first, second = conversation_rows(tokenizer, conversation, 0)
    # Each turn is trained with its reasoning, after the context the template gives it when it is the last turn:
    # in one row the second turn would follow a first turn rendered without its reasoning.
    assert spans(tokenizer, first.input_ids, first.loss_mask) == ["<think>think</think>\nThe answer is 42.<|im_end|>\n"]
    assert spans(tokenizer, second.input_ids, second.loss_mask) == ["<think>hmm</think>\nHello!<|im_end|>\n"]
    assert "The answer is 42.<|im_end|>" in tokenizer.decode(second.input_ids)
    assert "think</think>" not in tokenizer.decode(second.input_ids)
    assert first.sequence_id != second.sequence_id


def test_a_token_merged_across_the_prompt_boundary_is_trained_from_the_merge() -> None:
    # A template whose generation prompt ends in a space: byte-level BPE merges that space with the answer's first
    # word, so the prompt's ids are not a prefix of the turn's. The span starts at the first differing token.
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
    )
    tokenizer = chat_tokenizer(template)
    line = {"messages": [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "in Paris."}]}
    conversation = parse_line(json.dumps(line), 1)
    prompt = render(tokenizer, conversation, 1, True)
    (row,) = conversation_rows(tokenizer, conversation, 0)
    assert row.input_ids[: len(prompt)] != prompt  # the merge happened
    assert spans(tokenizer, row.input_ids, row.loss_mask) == [" in Paris.<|im_end|>\n"]


def test_a_template_that_leaves_tool_calls_out_is_refused_for_a_tool_calling_turn() -> None:
    tokenizer = chat_tokenizer(DROPS_REASONING)  # renders content only, as SmolLM2's template does
    conversation = parse_line(json.dumps(TOOL_LOOP), 3)
    with pytest.raises(SftDataError, match=r"line 3: .*does not render the tool calls of messages\[2\]"):
        sft_data_rows(tokenizer, [conversation], 1000)
    line = json.loads(json.dumps(TOOL_LOOP))
    line["messages"][2]["weight"] = 0  # as context only it is what the template makes of it
    (row,) = sft_data_rows(tokenizer, [parse_line(json.dumps(line), 3)], 1000).rows
    assert spans(tokenizer, row.input_ids, row.loss_mask) == ["It is sunny in Paris.<|im_end|>\n"]


def test_turns_of_weight_zero_are_context_only() -> None:
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    line = json.loads(json.dumps(TOOL_LOOP))
    line["messages"][2]["weight"] = 0
    (row,) = conversation_rows(tokenizer, parse_line(json.dumps(line), 1), 0)
    assert spans(tokenizer, row.input_ids, row.loss_mask) == ["It is sunny in Paris.<|im_end|>\n"]
    assert "<tool_call>" in tokenizer.decode(row.input_ids)


def test_rows_are_cut_at_max_seq_len_and_a_conversation_without_a_trained_token_left_is_dropped() -> None:
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    conversations = [parse_line(json.dumps(TOOL_LOOP), 1)]
    (row,) = sft_data_rows(tokenizer, conversations, 10_000).rows
    first = row.loss_mask.index(1)
    cut = sft_data_rows(tokenizer, conversations, first + 3)
    assert cut.truncated == 1 and len(cut.rows[0]) == first + 3 and cut.rows[0].trainable_tokens == 3
    with pytest.raises(SftDataError, match="line 1: no assistant token within max_seq_len"):
        sft_data_rows(tokenizer, conversations, first)


# ------------------------------------------------------------------------------------ bad files


def test_bad_lines_are_all_reported_with_their_numbers_before_anything_trains(tmp_path: Path) -> None:
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    lines = [
        good,
        "",  # blank lines are skipped
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}),
        json.dumps({"messages": []}),
        json.dumps([1, 2]),
        json.dumps({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"function": {"name": "f", "arguments": "{oops"}}]}]}),
        json.dumps({"messages": [{"role": "assistant", "content": [{"type": "image_url"}]}]}),
        json.dumps({"messages": [{"role": "assistant", "content": "x", "weight": 0}]}),
        good,
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SftDataError) as raised:
        read_conversations(path)
    message = str(raised.value)
    assert message.startswith(f"8 bad line(s) in {path}:")
    expected = [
        "3: not JSON",
        "4: no assistant turn",
        "5: messages[0]: unknown role 'robot'",
        '6: expected an object {"messages": [...]}',
        '7: expected an object {"messages": [...]}',
        "8: messages[0]: tool_calls[0].function.arguments is not JSON",
        "9: messages[0]: content parts must be",
        "10: every assistant turn has weight 0",
    ]
    for fragment in expected:
        assert f"{path}:{fragment}" in message, (fragment, message)
    assert f"{path}:1:" not in message and f"{path}:11:" not in message

    path.write_text(lines[0] + "\n\n" + lines[0] + "\n")
    assert [c.line for c in read_conversations(path)] == [1, 3]


def test_a_template_that_refuses_a_conversation_is_reported_with_its_line() -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer = chat_tokenizer(template)
    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    refused = {"messages": [{"role": "system", "content": "s"}, *ok["messages"]]}
    with pytest.raises(SftDataError, match="1 conversation.*\nline 4: the chat template fails on it: .*no system role"):
        sft_data_rows(tokenizer, [parse_line(json.dumps(ok), 2), parse_line(json.dumps(refused), 4)], 1000)


def test_the_cli_refuses_a_bad_file_before_touching_the_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    monkeypatch.setenv("TRAJGATE_DATABASE_URL", f"sqlite:///{tmp_path / 'none.db'}")
    assert main(["train", "--run", "r", "--sft-data", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:1: no assistant turn" in err, err
    assert not (tmp_path / "none.db").exists()  # nor any weights: the file is checked first


# ------------------------------------------------------------------------------------ the steps


def test_the_plan_covers_each_epoch_in_a_seeded_order_and_steps_cap_it() -> None:
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    rows = sft_data_rows(tokenizer, [parse_line(json.dumps(TOOL_LOOP), n) for n in range(1, 6)], 1000).rows
    plan = plan_steps(rows, batch_rows=2, epochs=2)
    assert [(s.epoch, len(s.rows)) for s in plan] == [(1, 2), (1, 2), (1, 1), (2, 2), (2, 2), (2, 1)]
    for epoch in (1, 2):
        seen = sorted(r.trajectory_id for s in plan if s.epoch == epoch for r in s.rows)
        assert seen == sorted(r.trajectory_id for r in rows)  # every row once an epoch
    assert [len(s.rows) for s in plan_steps(rows, 2, steps=4)] == [2, 2, 1, 2]  # into the second epoch
    assert len(plan_steps(rows, 2, epochs=3, steps=2)) == 2 and len(plan_steps(rows, 2)) == 3
    assert plan_steps(rows, 2, epochs=1, seed=1) == plan_steps(rows, 2, epochs=1, seed=1)
    with pytest.raises(ValueError, match="batch_rows"):
        plan_steps(rows, 0)


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random Llama with the BPE chat tokenizer beside it, as a base model directory."""
    directory = build_tiny_llama(tmp_path_factory.mktemp("tiny-sft-data"))
    chat_tokenizer(CHATML_TOOLS).save_pretrained(directory)
    return str(directory)


def test_the_step_loss_is_the_float64_cross_entropy_of_the_assistant_tokens(tiny_chat_model: str) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = chat_tokenizer(CHATML_TOOLS)
    rows = sft_data_rows(tokenizer, [parse_line(json.dumps(TOOL_LOOP), 1), parse_line(json.dumps({
        "messages": [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "The answer is 42."}]
    }), 2)], 1000).rows
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float64)
    losses, hits = [], []
    with torch.no_grad():
        for row in rows:
            logprobs = torch.log_softmax(model(torch.tensor([row.input_ids])).logits[0].double(), dim=-1)
            for t, trained in enumerate(row.loss_mask):
                if trained:  # the token at t, predicted from the logits at t - 1
                    losses.append(-float(logprobs[t - 1, row.input_ids[t]]))
                    hits.append(int(logprobs[t - 1].argmax()) == row.input_ids[t])
    expected = sum(losses) / len(losses)

    policy = make(tiny_chat_model, lr=1e-2)  # a fresh LoRA adapter is the identity: the base model's logprobs
    metrics = train_step(policy, rows, LossConfig(kind="sft"), micro_batch_tokens=64)  # several micro-batches
    assert metrics["tokens"] == len(losses) == sum(r.trainable_tokens for r in rows)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["sft_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["token_accuracy"] == pytest.approx(sum(hits) / len(hits))


def test_the_worker_commits_the_warm_start_as_the_runs_steps_and_the_run_goes_on(
    db_url: str, tmp_path: Path, tiny_chat_model: str
) -> None:
    db.upgrade(db_url)
    seed_groups(db_url, tiny_chat_model, groups=2)
    engine = db.make_engine(db_url)
    try:
        upsert_run(engine, "loop", {"groups_per_step": 2, "learning_rate": 1e-2})
        lines: list[str] = []
        trainer = make_trainer(db_url, tmp_path, tiny_chat_model, echo=lines.append, max_steps=1)
        conversations = [parse_line(json.dumps(TOOL_LOOP), n) for n in range(1, 4)]
        assert warm_start(trainer, conversations, "data.jsonl", batch_rows=2, epochs=2, steps=None) == 4
        assert trainer.step == 4
        sft_steps = steps_after(engine, "loop")
        assert trainer.run() == 1  # the run's own objective (cispo) continues from the warm start
        latest = latest_checkpoint(tmp_path / "ckpt", "loop")
        steps = steps_after(engine, "loop")
    finally:
        engine.dispose()
        while made:
            made.pop().close()
    assert [s["step"] for s in sft_steps] == [1, 2, 3, 4]
    for step in sft_steps:
        m = step["metrics"]
        assert m["objective"] == "sft_data" and m["sft_data"] == "data.jsonl" and m["rows"] in (1, 2)
        assert math.isfinite(m["loss"]) and m["loss"] > 0 and 0 <= m["token_accuracy"] <= 1
        assert m["tokens"] > m["trainable_tokens"] > 0 and "ratio_mean" not in m
    assert [s["metrics"]["epoch"] for s in sft_steps] == [1, 1, 2, 2]
    assert sft_steps[-1]["metrics"]["loss"] < sft_steps[0]["metrics"]["loss"]  # the same rows, trained four times
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5] and "ratio_mean" in steps[-1]["metrics"]
    assert latest is not None and latest[0] == 5
    assert "sft data data.jsonl: 3 conversations -> 3 rows" in lines[0]
    assert lines[1] == format_sft_data_step(1, sft_steps[0]["metrics"]) and "token accuracy" in lines[1]
