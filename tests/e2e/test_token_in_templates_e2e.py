"""token_in on real vLLM CPU with the templates people train: a tiny random Llama with Qwen3's, Llama 3's and
DeepSeek V3's real tokenizer, chat template, end tokens and vLLM tool (and reasoning) parser.

A random model says nothing useful, so each turn is forced with vLLM's structured outputs (`choice`: the one text a
real model would write, in the parser's native format) and ends on the end token the grammar then allows: the test
depends on the template, vLLM and the gateway only. The same tool loop runs in both token modes; token_in must keep
one exact sequence (every call continues the previous prompt + completion), whatever chat mode does. DeepSeek V3's
tokenizer as vLLM 0.32 loads it is not qualified (docs/agents.md, Qualified templates): token_in refuses it, chat
serves it.
Gemma 3 is not served here: its vocabulary is larger than vLLM's LoRA allows.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from scripts.qualify_token_in import TEMPLATES, WEATHER_TOOL, Template, fetch
from tests.support.gateway_harness import running_gateway
from tests.support.stored import stored_calls
from trainer.demo.vllm_cpu import VllmServer, ensure_tiny_model_for

PARSERS = {
    "qwen3": ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"],
    "llama3": ["--tool-call-parser", "pythonic"],
    "deepseek_v3": ["--tool-call-parser", "deepseek_v3"],
}
BY_NAME = {t.name: t for t in TEMPLATES}


@pytest.fixture(scope="module", params=list(PARSERS))
def served(request: pytest.FixtureRequest) -> Iterator[tuple[Template, str]]:
    template = BY_NAME[request.param]
    model = ensure_tiny_model_for(template.name, fetch(template.package), template.generation_eos)
    args = ["--enable-auto-tool-choice", *PARSERS[template.name]]
    with VllmServer(model, template.name, extra_args=args, max_loras=1) as server:
        yield template, server.base_url


def forced(template: Template, text: str) -> dict[str, Any]:
    """The request fields that make vLLM generate exactly `text`. Qwen3 runs in non-thinking mode: with a reasoning
    parser vLLM applies the grammar only once reasoning has ended, which the non-thinking prompt already says."""
    body: dict[str, Any] = {"structured_outputs": {"choice": [text]}}
    if template.name == "qwen3":
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


def tool_loop(client: openai.OpenAI, template: Template, model: str) -> list[Any]:
    """Tool call, tool result, answer, new user turn, answer: three calls, each forced."""
    assert template.tool_call is not None
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer weather questions."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    texts = [template.tool_call("get_weather", {"city": "Paris"}), "Sunny, 18 C.", "A jacket."]
    answers = []
    for turn, text in enumerate(texts):
        answer = client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER_TOOL], max_tokens=64, extra_body=forced(template, text)
        )
        message = answer.choices[0].message
        answers.append(message)
        messages.append(message.model_dump(exclude_none=True))
        if turn == 0:
            assert message.tool_calls, message
            call = message.tool_calls[0]
            assert json.loads(call.function.arguments) == {"city": "Paris"}
            messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'})
        else:
            messages.append({"role": "user", "content": "What should I wear?"})
    return answers


def test_tool_loop_continues_exactly_in_token_in(served: tuple[Template, str], tmp_path: Path) -> None:
    template, base_url = served
    url = f"sqlite:///{tmp_path}/trajgate.db"
    extended: dict[str, list[bool]] = {}
    with running_gateway(
        database_url=url, upstream_url=base_url, base_model=template.name, spool_dir=tmp_path / "spool"
    ) as gateway:
        if template.name == "deepseek_v3":
            refused_by_token_in(gateway.url, template)
            return
        for mode in ("chat", "token_in"):
            run = f"{template.name}-{mode}"
            response = httpx.post(gateway.url + "/v1/runs", json={"name": run, "config": {"token_mode": mode}})
            assert response.status_code in (200, 201), response.text
            trajectory = f"{mode}-{uuid.uuid4().hex[:8]}"
            client = openai.OpenAI(base_url=f"{gateway.url}/eval/t/{trajectory}/v1", api_key="x", max_retries=0)
            tool_loop(client, template, run)
            gateway.flush()
            calls = stored_calls(url, trajectory)
            assert len(calls) == 3 and all(c["status_code"] == 200 for c in calls)
            assert all(c["completion_token_ids"][-1] in template.generation_eos for c in calls)
            extended[mode] = [
                after["prompt_token_ids"][: len(before["prompt_token_ids"] + before["completion_token_ids"])]
                == before["prompt_token_ids"] + before["completion_token_ids"]
                for before, after in zip(calls, calls[1:])
            ]
            if mode == "token_in":
                assert [c["segment_reason"] for c in calls] == ["first_call", None, None]
    print(f"{template.name}: chat extends {extended['chat']}, token_in {extended['token_in']}")
    assert extended["token_in"] == [True, True]


def refused_by_token_in(gateway_url: str, template: Template) -> None:
    """A template the suite did not qualify: token_in answers 400 naming it; chat mode still answers (its tool
    parser cannot read this tokenizer's mangled markup, so no tool loop)."""
    for mode in ("token_in", "chat"):
        response = httpx.post(gateway_url + "/v1/runs", json={"name": f"ds-{mode}", "config": {"token_mode": mode}})
        assert response.status_code in (200, 201), response.text
    base = f"{gateway_url}/eval/t/ds-{uuid.uuid4().hex[:8]}/v1"
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="not qualified"):
        tool_loop(client, template, "ds-token_in")
    messages = [{"role": "user", "content": "Hi"}]
    answer = client.chat.completions.create(model="ds-chat", messages=messages, max_tokens=8)
    assert answer.choices[0].message.role == "assistant"
