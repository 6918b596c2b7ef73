"""The other ways to learn, on real vLLM CPU with the tiny model (SmolLM2's tokenizer and chat template): a warm start
from a file of conversations (`trajgate train --sft-data`) and an on-policy distillation step whose teacher is the
base model served by the same vLLM, each committed as a step of the run and published (vLLM serves RUN@1).

The warm start's masks are checked on the real template against what vLLM itself renders (`/tokenize` of the same
messages): the tokens before each trained span are exactly the prompt vLLM would send the model. Only recorded
metrics (finite), the committed steps and the published adapters are asserted, never what the model generates."""

from __future__ import annotations

import json
import math
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.cli import main
from gateway.runs.settings import load_settings
from gateway.store import db
from gateway.store.runs import steps_after, upsert_run
from tests.support.gateway_harness import RunningGateway, running_gateway
from trainer.demo.vllm_cpu import ensure_tiny_model
from trainer.sft_data import SftDataError, conversation_rows, parse_line, sft_data_rows
from trainer.teacher import TeacherStore
from trainer.worker.loop import Trainer, TrainerOptions

LOOKUP = {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
TOOLS = [{"type": "function", "function": LOOKUP}]
CONVERSATIONS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]},
    {
        "messages": [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"},
            {"role": "assistant", "content": "Rome."},
        ]
    },
]
# SmolLM2's template renders no tool calls (nor does vLLM with it): the warm start refuses to train such a turn.
TOOL_CALLING: dict[str, Any] = {
    "messages": [
        {"role": "user", "content": "How tall is the Eiffel tower?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "Eiffel tower"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "330 m"},
        {"role": "assistant", "content": "330 metres."},
    ],
    "tools": TOOLS,
}


def served(upstream: str) -> set[str]:
    return {m["id"] for m in httpx.get(upstream + "/models", timeout=30).json()["data"]}


def vllm_render(root: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """What vLLM sends the model for a chat request with these messages (its /tokenize, generation prompt added)."""
    body: dict[str, Any] = {"model": "tiny", "messages": messages, "add_generation_prompt": True}
    if tools:
        body["tools"] = tools
    response = httpx.post(root + "/tokenize", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return list(response.json()["tokens"])


def test_the_masks_on_smollm2s_template_follow_vllms_own_rendering(vllm_tiny_base_url: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    root = vllm_tiny_base_url.removesuffix("/v1")
    for line, data in enumerate(CONVERSATIONS, start=1):
        conversation = parse_line(json.dumps(data), line)
        (row,) = conversation_rows(tokenizer, conversation, 0)  # SmolLM2's template keeps history: one row
        starts = [t for t in range(1, len(row)) if row.loss_mask[t] and not row.loss_mask[t - 1]]
        assistant = [i for i, m in enumerate(data["messages"]) if m["role"] == "assistant"]
        assert len(starts) == len(assistant)
        for start, index in zip(starts, assistant, strict=True):
            # the ids before the span are vLLM's prompt for that turn, token for token
            prompt = vllm_render(root, data["messages"][:index], data.get("tools"))
            assert row.input_ids[:start] == prompt, (line, index)
            end = start + row.loss_mask[start:].index(0) if 0 in row.loss_mask[start:] else len(row)
            text = tokenizer.decode(row.input_ids[start:end])
            assert text.endswith("<|im_end|>\n"), text
            assert text == data["messages"][index]["content"] + "<|im_end|>\n"
    with pytest.raises(SftDataError, match=r"line 9: .*does not render the tool calls of messages\[1\]"):
        sft_data_rows(tokenizer, [parse_line(json.dumps(TOOL_CALLING), 9)], 1000)


@pytest.fixture
def workdir(tmp_path: Path, pg_url: str) -> Iterator[tuple[Path, str]]:
    db.upgrade(pg_url)
    yield tmp_path, pg_url


def test_an_sft_data_warm_start_commits_and_publishes_a_step(
    workdir: tuple[Path, str],
    vllm_tiny_base_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tmp_path, url = workdir
    engine = db.make_engine(url)
    try:
        upsert_run(engine, "warm", {"learning_rate": 5e-3}, base_model="tiny", base_weights=str(ensure_tiny_model()))
    finally:
        engine.dispose()
    data = tmp_path / "good.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    for key, value in {"DATABASE_URL": url, "UPSTREAM_URL": vllm_tiny_base_url, "BASE_MODEL": "tiny",
                       "CHECKPOINT_DIR": str(tmp_path / "ckpt")}.items():  # fmt: skip
        monkeypatch.setenv(f"TRAJGATE_{key}", value)
    code = main(["train", "--run", "warm", "--sft-data", str(data), "--steps", "1", "--sft-batch", "3",
                 "--backend", "hf", "--device", "cpu"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "2 conversations -> 2 rows" in out.out and "1 sft-data step(s) done; run 'warm' is at step 1" in out.out

    engine = db.make_engine(url)
    try:
        (step,) = steps_after(engine, "warm")
    finally:
        engine.dispose()
    metrics = step["metrics"]
    assert step["step"] == 1 and metrics["objective"] == "sft_data" and metrics["rows"] == 2
    for key in ("loss", "sft_loss", "token_accuracy", "grad_norm"):
        assert math.isfinite(metrics[key]), (key, metrics)
    assert metrics["loss"] > 0 and metrics["grad_norm"] > 0 and metrics["trainable_tokens"] > 0
    assert "warm@1" in served(vllm_tiny_base_url)


@pytest.fixture
def distill_stack(vllm_tiny_base_url: str, pg_url: str, tmp_path: Path) -> Iterator[RunningGateway]:
    with running_gateway(
        database_url=pg_url, upstream_url=vllm_tiny_base_url, base_model="tiny", spool_dir=tmp_path / "spool"
    ) as gw:
        response = httpx.post(gw.base_url + "/runs", json={
            "name": "student", "base_model": "tiny", "base_weights": str(ensure_tiny_model()),
            # The teacher is the base model, the very weights that sample: its logprobs are the behaviour ones, the
            # distillation advantage ~0, and the reward term (weight 1) is what moves the adapter.
            "config": {"groups_per_step": 1, "learning_rate": 5e-3, "loss": "distill", "teacher": "tiny",
                       "distill_reward_weight": 1.0, "sampling": {"temperature": 1.0, "max_tokens": 8}},
        }, timeout=30)  # fmt: skip
        assert response.status_code == 201, response.text
        yield gw


def test_a_distillation_step_from_the_base_model_commits_and_publishes(
    distill_stack: RunningGateway, pg_url: str, vllm_tiny_base_url: str, tmp_path: Path
) -> None:
    gw, rng = distill_stack, random.Random(0)
    for t in range(4):
        client = openai.OpenAI(base_url=f"{gw.url}/g/d-g0/n/4/t/d-g0-t{t}/v1", api_key="k", max_retries=0)
        client.chat.completions.create(model="student", messages=[{"role": "user", "content": "Name an animal."}])
        reward = httpx.post(f"{gw.base_url}/trajectories/d-g0-t{t}/reward", json={"reward": rng.random()}, timeout=30)
        assert reward.status_code == 200, reward.text
    settings = load_settings(_env_file=None, database_url=pg_url, checkpoint_dir=tmp_path / "ckpt",
                             upstream_url=vllm_tiny_base_url)  # fmt: skip
    options = TrainerOptions(run="student", backend="hf", device="cpu", poll_s=0.2, max_steps=1)
    with Trainer(settings, options) as trainer:
        assert trainer.run() == 1
        assert trainer.finish_publishing(threading.Event(), 120)
    engine = db.make_engine(pg_url)
    try:
        (step,) = steps_after(engine, "student")
    finally:
        engine.dispose()
    metrics = step["metrics"]
    assert step["step"] == 1 and metrics["groups_used"] == 1
    for key in ("loss", "reverse_kl", "teacher_agreement", "ratio_mean", "grad_norm"):
        assert math.isfinite(metrics[key]), (key, metrics)
    assert 0 <= metrics["teacher_agreement"] <= 1 and metrics["grad_norm"] > 0
    # Teacher and sampler are one vLLM's same weights: the per-token reverse KL is numerics only (bound as
    # test_objectives_e2e's |log ratio|, about twice what was measured there).
    assert abs(metrics["reverse_kl"]) < 0.08
    assert (tmp_path / "ckpt" / "student" / "teacher").is_dir()  # the teacher's logprobs, kept with the step
    assert TeacherStore(tmp_path / "ckpt" / "student" / "teacher").path(1).is_file()
    assert "student@1" in served(vllm_tiny_base_url)
