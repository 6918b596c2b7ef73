"""The Anthropic Messages API through the gateway, with the official `anthropic` SDK as the client and the chat
exchanges the gateway sent real vLLM CPU + SmolLM2 replayed behind it.

The recordings (tests/fixtures/vllm/messages_*_tool_loop*.json) were made by this gateway driving
tests/support/messages_agent.py's tool loop through a recording proxy (scripts/record_fixtures.py --only messages), so
replay answers only the exact chat requests the gateway sent then: a different translation gets no answer and the
test fails. What is checked: the client gets Anthropic's shapes (blocks, stop reasons, stream events, errors), and
the record holds vLLM's exact ids and logprobs under the `messages` endpoint, in both token modes.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from gateway.edge import api_messages
from gateway.edge.api_messages import MessagesRequest, StreamTranslator, to_chat
from gateway.http.errors import GatewayError
from gateway.proxy import token_in
from gateway.upstream.failures import body_message
from scripts.record_fixtures import TOOL_SYSTEM, WEATHER_RESULT
from tests.support.fake_upstream import FIXTURES, FakeUpstream
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.messages_agent import COUNT_TOKENS, FIRST, HISTORY, RUN, STOP_CALL, TOOL, tool_loop, tool_uses
from tests.support.pgcluster import free_port
from tests.support.stored import stored_calls

CHAT = "/v1/chat/completions"


def exchanges(name: str) -> list[dict[str, Any]]:
    return json.loads((FIXTURES / f"{name}.json").read_text())["exchanges"]


def chat_answers(name: str) -> list[dict[str, Any]]:
    """The recorded chat answers of the tool loop's three turns, streams assembled: (prompt ids, completion ids,
    logprobs, finish_reason, message)."""
    out = []
    for exchange in exchanges(name):
        if exchange["path"] != CHAT or exchange["request"]["messages"][-1].get("content") == STOP_CALL_TEXT:
            continue
        out.append(_assembled(exchange))
    return out


STOP_CALL_TEXT = STOP_CALL["messages"][0]["content"]


def _assembled(exchange: dict[str, Any]) -> dict[str, Any]:
    if not exchange.get("stream"):
        response = exchange["response"]
        choice = response["choices"][0]
        return {
            "prompt": response["prompt_token_ids"],
            "ids": choice["token_ids"],
            "logprobs": [e["logprob"] for e in choice["logprobs"]["content"]],
            "finish_reason": choice["finish_reason"],
            "stop_reason": choice.get("stop_reason"),
            "usage": response["usage"],
        }
    prompt: list[int] = []
    ids: list[int] = []
    logprobs: list[float] = []
    finish = stop = usage = None
    for raw in exchange["chunks"]:
        if raw == "[DONE]":
            continue
        chunk = json.loads(raw)
        prompt = chunk.get("prompt_token_ids") or prompt
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            ids += choice.get("token_ids") or []
            logprobs += [e["logprob"] for e in (choice.get("logprobs") or {}).get("content") or []]
            finish = choice.get("finish_reason") or finish
            stop = choice.get("stop_reason") or stop
    return {
        "prompt": prompt,
        "ids": ids,
        "logprobs": logprobs,
        "finish_reason": finish,
        "stop_reason": stop,
        "usage": usage,
    }


def client(gateway: RunningGateway, base: str = "", **kwargs: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=gateway.url + base, api_key=kwargs.pop("api_key", "sk-test"), max_retries=0, **kwargs
    )


# -- the translation, on its own -----------------------------------------------------------------------------------


def test_request_translates_as_vllms_own_endpoint_does() -> None:
    request = MessagesRequest.model_validate(
        {
            "model": "agent",
            "max_tokens": 100,
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: abc"},
                {"type": "text", "text": "Be brief."},
            ],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                        {"type": "text", "text": "And now?"},
                    ],
                },
                {"role": "assistant", "content": "It is"},
            ],
            "tools": [TOOL],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            "stop_sequences": ["\n\n"],
            "temperature": 0.5,
            "top_k": 5,
            "metadata": {"user_id": "u-1"},
            "thinking": {"type": "enabled", "budget_tokens": 2048},
        }
    )
    chat = to_chat(request)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "reasoning": "hmm",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "user", "content": "And now?"},
        {"role": "assistant", "content": "It is"},
    ]
    assert chat["add_generation_prompt"] is False and chat["continue_final_message"] is True  # a prefill
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": TOOL["name"], "description": TOOL["description"], "parameters": TOOL["input_schema"]},
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    assert (chat["max_tokens"], chat["stop"], chat["temperature"], chat["top_k"]) == (100, ["\n\n"], 0.5, 5)
    assert chat["user"] == "u-1" and chat["thinking_token_budget"] == 2048
    assert "stream" not in chat


def test_claude_codes_inline_system_and_unknown_fields_pass_as_in_vllm() -> None:
    """A system message mid-conversation stays where it is (billing header stripped, an empty one dropped), and
    fields vLLM's endpoint ignores (context_management) are ignored and named for the record, not refused."""
    data = {
        "model": "agent",
        "max_tokens": 16,
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "messages": [
            {"role": "user", "content": "Hi", "extra": 1},
            {"role": "system", "content": [{"type": "text", "text": "Remember: be brief."}]},
            {"role": "system", "content": "x-anthropic-billing-header: cc_version=1"},
            {
                "role": "user",
                "content": [{"type": "tool_reference", "tool_name": "Read"}, {"type": "text", "text": "Go"}],
            },
        ],
        "tool_choice": {"type": "auto", "future_flag": True},
        "output_config": {"effort": "high", "task_budget": 1},
    }
    chat = to_chat(api_messages.parse_request(data, MessagesRequest))
    assert chat["messages"] == [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Remember: be brief."},
        {"role": "user", "content": "Go"},
    ]
    assert api_messages.ignored_fields(data) == ["context_management"]


WEATHER = {"name": "get_weather", "description": "Weather.", "input_schema": {"properties": {"city": {"type": "str"}}}}


def test_blocks_and_fields_vllm_takes_loosely_are_taken_as_it_takes_them() -> None:
    """vLLM 0.32's endpoint has one content-block model with every field optional, reads only the text of the
    top-level system, takes max_tokens as pydantic reads an int, any tool type with an input_schema, and any
    metadata; what a block lacks is skipped or defaulted as there (each checked against a running vLLM: same
    status, same prompt length)."""
    data = {
        "model": "agent", "max_tokens": 8.0, "metadata": {"user_id": 5}, "top_k": -1, "speed": 1,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "image", "source": {"type": "url", "url": "u"}},
                   {"type": "thinking", "thinking": "t"}, {"type": "text"}],
        "tools": [{**WEATHER, "type": "bash_20250124"}],
        "messages": [
            {"role": "user", "content": [{"type": "text"}, {"type": "text", "text": None}, {"type": "image"},
                                         {"type": "text", "text": "Hi"}]},
            {"role": "assistant",
             "content": [{"type": "thinking"}, {"type": "redacted_thinking"}, {"type": "tool_use"}]},
            {"role": "user", "content": [{"type": "tool_result"}]},
            {"role": "assistant", "content": [{"type": "tool_result", "content": [{"type": "text", "text": "a"}]}]},
        ],
    }  # fmt: skip
    request = api_messages.parse_request(data, MessagesRequest)
    chat = to_chat(request)
    assert chat["max_tokens"] == 8 and chat["top_k"] == -1 and "user" not in chat
    assert chat["tools"][0]["function"]["parameters"]["type"] == "object"
    [call] = chat["messages"][2]["tool_calls"]
    assert call["id"].startswith("call_") and call["function"] == {"name": "", "arguments": "{}"}
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "", "content": ""},
        {"role": "assistant", "content": "Tool result: [{'type': 'text', 'text': 'a'}]"},  # as vLLM prints it
    ]
    for max_tokens in ("8", True):
        assert api_messages.parse_request({**data, "max_tokens": max_tokens}, MessagesRequest).max_tokens in (8, 1)


def test_tool_additions_and_removals_in_system_messages_change_the_tools_as_in_vllm() -> None:
    """vLLM's `_resolve_tools`: the tools at the end of the conversation, after each system message's
    tool_addition (by value, or by reference to a deferred tool, which is then no longer deferred) and
    tool_removal; the blocks add no text."""
    search = {"name": "search", "input_schema": {"type": "object"}, "defer_loading": True}

    def change(kind: str, tool: dict[str, Any]) -> dict[str, Any]:
        return {"role": "system", "content": [{"type": kind, "tool": tool}]}

    data = {
        "model": "agent", "max_tokens": 8, "tools": [WEATHER, search],
        "messages": [
            {"role": "user", "content": "Hi"},
            change("tool_addition", {"type": "tool_definition", "definition": {"name": "add", "input_schema": {}}}),
            change("tool_addition", {"type": "tool_reference", "name": "search"}),
            change("tool_removal", {"type": "tool_reference", "name": "get_weather"}),
            {"role": "user", "content": "Go"},
        ],
    }  # fmt: skip
    chat = to_chat(api_messages.parse_request(data, MessagesRequest))
    assert [(t["function"]["name"], t["function"].get("defer_loading")) for t in chat["tools"]] == [
        ("search", None), ("add", None)]  # fmt: skip
    assert chat["messages"] == [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Go"}]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # vLLM's own refusals, each a 400 there too
        ({"messages": [{"role": "user", "content": [{"type": "tool_addition", "tool": {
            "type": "tool_reference", "name": "get_weather"}}]}]}, 'only allowed in messages with role "system"'),
        ({"system": [{"type": "tool_removal", "tool": {"type": "tool_reference", "name": "get_weather"}}]},
         'only allowed in messages with role "system"'),
        ({"messages": [{"role": "system", "content": [{"type": "tool_addition"}]}]}, "tool is required"),
        ({"messages": [{"role": "system", "content": [{"type": "tool_removal", "tool": {
            "type": "tool_definition", "definition": WEATHER}}]}]}, "only accepts a tool_reference"),
        ({"messages": [{"role": "system", "content": [{"type": "tool_addition", "tool": {
            "type": "tool_reference", "name": "nope"}}]}]}, "not declared in tools"),
        ({"max_tokens": 8.5}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages.0.content"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "input_schema"),
    ],
)  # fmt: skip
def test_what_vllm_refuses_is_a_400(change: dict[str, Any], message: str) -> None:
    data = {"model": "agent", "max_tokens": 8, "tools": [WEATHER], "messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(GatewayError) as refused:
        to_chat(api_messages.parse_request({**data, **change}, MessagesRequest))
    assert refused.value.status == 400 and message in refused.value.message, refused.value.message


def test_inline_system_messages_join_the_system_prompt_where_the_template_wants_one() -> None:
    """vLLM's endpoint asks the template to render [system, user, system, user] and, where it refuses (Qwen's
    loop.first guard), merges later system messages into the first; it asks the template it uses with tools too,
    which may be another. The gateway asks vLLM's render endpoint the same once per served model, the tools variant
    with a stand-in tool (vLLM refuses an empty list), which must render with one system message for a refusal with
    two to count. A vLLM without a render endpoint keeps them in place; an unclear answer is asked again."""
    from types import SimpleNamespace

    from gateway.http.errors import GatewayError, UpstreamFailure

    answers: list[int] = []
    rendered: list[dict[str, Any]] = []

    async def render(body: dict[str, Any]) -> list[int]:
        rendered.append(body)
        status = answers.pop(0)
        if status != 200:
            raise UpstreamFailure(GatewayError(status, "refused"))
        return [1, 2]

    async def base_model() -> str:
        return "smollm2"

    route = SimpleNamespace(served_name="smollm2")
    proxy: Any = SimpleNamespace(
        router=SimpleNamespace(resolve=lambda run, base: route), base_model=base_model,
        token_in=SimpleNamespace(render=render),
    )  # fmt: skip
    data = {
        "model": "agent", "max_tokens": 8, "system": "Be brief.",
        "messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": " Really."},
                     {"role": "user", "content": "Go"}],
    }  # fmt: skip
    request = api_messages.parse_request(data, MessagesRequest)

    async def decisions(statuses: list[int], calls: int = 1) -> list[bool]:
        api = api_messages.MessagesApi(proxy)
        answers[:] = statuses
        rendered.clear()
        return [await api._merge_inline_system("agent", request) for _ in range(calls)]

    assert asyncio.run(decisions([400])) == [True] and not answers
    assert [m["role"] for m in rendered[0]["messages"]] == ["system", "user", "system", "user"]
    assert "tools" not in rendered[0]
    # a template that refuses only in its tools variant (the stand-in tool rendering with one system message)
    assert asyncio.run(decisions([200, 200, 400])) == [True] and not answers
    assert [(len(body["messages"]), len(body.get("tools") or ())) for body in rendered] == [(4, 0), (2, 1), (4, 1)]
    assert asyncio.run(decisions([200, 200, 200])) == [False] and not answers
    assert asyncio.run(decisions([200, 400])) == [False] and not answers  # the stand-in tool itself is refused
    assert asyncio.run(decisions([503, 200, 200, 200], calls=2)) == [False, False] and not answers  # asked again
    assert asyncio.run(decisions([200, 200, 503, 200, 200, 200], calls=2)) == [False, False] and not answers
    assert asyncio.run(decisions([403])) == [False]
    assert to_chat(request, merge_inline_system=True)["messages"] == [
        {"role": "system", "content": "Be brief. Really."},
        {"role": "user", "content": "Hi"},
        {"role": "user", "content": "Go"},
    ]
    assert [m["role"] for m in to_chat(request)["messages"]] == ["system", "user", "system", "user"]


def test_a_tool_searchs_result_and_deferred_tools_translate_as_in_vllm() -> None:
    """A tool_result may name deferred tools it found (tool_reference) and carry item kinds vLLM skips; vLLM passes
    the names on as a tool message of their own, and a deferred tool's flag and a typeless schema as it reads them."""
    data = {
        "model": "agent",
        "max_tokens": 16,
        "tools": [{"name": "Read", "input_schema": {"properties": {}}, "defer_loading": True}],
        "messages": [
            {"role": "user", "content": "Find a reader"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "found"}, {"type": "tool_reference", "tool_name": "Read"},
                {"type": "document", "source": {}},
            ]}]},  # fmt: skip
        ],
    }
    chat = to_chat(api_messages.parse_request(data, MessagesRequest))
    assert chat["messages"][2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "found"},
        {"role": "tool", "tool_call_id": "t1", "content": [{"type": "tool_reference", "name": "Read"}]},
    ]
    function = chat["tools"][0]["function"]
    assert function["parameters"] == {"properties": {}, "type": "object"} and function["defer_loading"] is True


def test_stream_translator_closes_each_block_and_reports_the_stop() -> None:
    translator = StreamTranslator()
    chunks = [
        {
            "id": "chatcmpl-1",
            "model": "m",
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        },
        {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "Hi"}}]},
        {
            "id": "chatcmpl-1",
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": ""}}]},
                }
            ],
        },
        {
            "id": "chatcmpl-1",
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]},
                    "finish_reason": "tool_calls",
                }
            ],
        },
        {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}},
    ]
    events = [e for chunk in chunks for e in translator.feed(chunk)] + translator.finish()
    parsed = [(e.split(b"\n")[0].decode(), json.loads(e.split(b"\n")[1][6:])) for e in events]
    assert [name.removeprefix("event: ") for name, _ in parsed] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert parsed[0][1]["message"]["usage"] == {"input_tokens": 3, "output_tokens": 0}
    assert parsed[5][1]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    assert parsed[6][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 1}'}
    assert parsed[8][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert parsed[8][1]["usage"] == {"input_tokens": 3, "output_tokens": 7}


def test_answer_blocks_thinking_and_a_cut_tool_call() -> None:
    response = {
        "id": "chatcmpl-9",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "stop_reason": None,
                "message": {
                    "role": "assistant",
                    "reasoning": "Paris, so...",
                    "content": "Checking.",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Pa'}}
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 9},
    }
    message = api_messages.to_message(response)
    assert message["id"] == "msg_9" and message["usage"] == {"input_tokens": 5, "output_tokens": 9}
    assert message["content"] == [
        {"type": "thinking", "thinking": "Paris, so...", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "c1", "name": "f", "input": {}},  # cut short: not an object yet
    ]
    assert message["stop_reason"] == "max_tokens" and "stop_sequence" not in message  # vLLM leaves out nulls
    assert api_messages.stop_reason("stop", "END", False, False) == ("stop_sequence", "END")
    assert api_messages.stop_reason("stop", 2, False, False) == ("end_turn", None)  # a stop token id is no sequence
    assert body_message(b'{"detail": "Forbidden"}') == "Forbidden"
    assert body_message(b"upstream said no") == "upstream said no"
    assert body_message(b'{"error": {"message": "bad n"}}') == body_message(b'{"error": "bad n"}') == "bad n"


@pytest.mark.parametrize("arguments", ['"infinity"', "[144, 5]", "2"], ids=["string", "array", "number"])
def test_tool_arguments_that_are_not_an_object_are_answered_as_vllm_streams_them(arguments: str) -> None:
    # vLLM 0.32's stream sends the arguments as partial_json and says tool_use (they are JSON); its non-stream answer
    # is json.loads(arguments) (its model then refuses anything but an object: a 400 for an answer already made).
    # The gateway answers the same value both ways, and a client echoing it back continues the recorded turn.
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    recorded = {"role": "assistant", "content": None, "tool_calls": [call]}
    response = {
        "id": "chatcmpl-3",
        "model": "m",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "stop_reason": None, "message": recorded}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 9},
    }
    message = api_messages.to_message(response)
    tool_use = {"type": "tool_use", "id": "c1", "name": "calculator", "input": json.loads(arguments)}
    assert message["content"] == [tool_use]
    assert message["stop_reason"] == "tool_use"
    translator = StreamTranslator()
    chunks = [
        {"id": "chatcmpl-3", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {
            "id": "chatcmpl-3",
            "choices": [{"index": 0, "delta": {"tool_calls": [{**call, "index": 0}]}, "finish_reason": "tool_calls"}],
        },
    ]
    events = [e for chunk in chunks for e in translator.feed(chunk)] + translator.finish()
    parsed = [json.loads(e.split(b"\n")[1][6:]) for e in events]
    streamed = "".join(e["delta"]["partial_json"] for e in parsed if e["type"] == "content_block_delta")
    assert json.loads(streamed) == message["content"][0]["input"]
    assert [e["delta"]["stop_reason"] for e in parsed if e["type"] == "message_delta"] == ["tool_use"]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": message["content"]}]
    sent = to_chat(MessagesRequest.model_validate({"model": "m", "max_tokens": 9, "messages": history}))["messages"]
    assert token_in.history_keys(sent) == token_in.history_keys([{"role": "user", "content": "hi"}, recorded])


@pytest.mark.parametrize("arguments", ["infinity", '{"city": "Pa'], ids=["not-json", "cut"])
def test_a_client_echoing_the_empty_input_of_arguments_that_are_not_json_continues_the_recorded_turn(
    arguments: str,
) -> None:
    # Such arguments are answered as input {} (vLLM's non-stream answer fails on them); the echo sends "{}" back,
    # and the call's id still names the recorded turn.
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    recorded = {"role": "assistant", "content": None, "tool_calls": [call]}
    choice = {"index": 0, "finish_reason": "length", "message": recorded}
    response = {"id": "chatcmpl-4", "model": "m", "choices": [choice]}
    content = api_messages.to_message(response)["content"]
    assert content == [{"type": "tool_use", "id": "c1", "name": "calculator", "input": {}}]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]
    sent = to_chat(MessagesRequest.model_validate({"model": "m", "max_tokens": 9, "messages": history}))["messages"]
    assert token_in.history_keys(sent) == token_in.history_keys([{"role": "user", "content": "hi"}, recorded])


# -- through the gateway ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_tool_loop_is_answered_in_anthropic_shape_and_recorded_exactly(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str, stream: bool
) -> None:
    name = "messages_chat_tool_loop" + ("_stream" if stream else "")
    recorded = chat_answers(name)
    trajectory = f"loop-{uuid.uuid4().hex[:8]}"
    turns = tool_loop(client(gateway, f"/g/grp-{trajectory}/t/{trajectory}"), stream)
    # what the model answered, as Anthropic blocks: a tool_use in turn 1 (its input as an object), text after
    first = turns[0]["answer"]
    assert first.stop_reason == "tool_use" and recorded[0]["finish_reason"] == "tool_calls"
    assert [(c.name, c.input) for c in tool_uses(first)] == [("get_weather", {"city": "Paris"})]
    assert first.content[-1].id.startswith("chatcmpl-tool-")
    for turn, answer in zip(turns, recorded):
        message = turn["answer"]
        assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
        assert message.usage.input_tokens == len(answer["prompt"])
        assert message.usage.output_tokens == len(answer["ids"])
    assert turns[1]["answer"].content[0].type == "text" and turns[1]["answer"].content[0].text
    expected_stop = {"stop": "end_turn", "length": "max_tokens"}
    assert [t["answer"].stop_reason for t in turns[1:]] == [expected_stop[a["finish_reason"]] for a in recorded[1:]]
    # the tool result went to vLLM as a `tool` message answering the call's id
    sent = upstream.received[-2]["messages"]
    call_id = first.content[-1].id
    function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert sent[-2:] == [
        {"role": "assistant", "tool_calls": [{"id": call_id, "type": "function", "function": function}]},
        {"role": "tool", "tool_call_id": call_id, "content": WEATHER_RESULT},
    ]
    gateway.flush()
    calls = stored_calls(db_url, trajectory)
    assert len(calls) == 3
    for call, answer in zip(calls, recorded):
        assert call["endpoint"] == "messages" and call["stream"] is stream
        assert call["prompt_token_ids"] == answer["prompt"]
        assert call["completion_token_ids"] == answer["ids"]
        assert call["completion_logprobs"] == answer["logprobs"]  # exact, as vLLM sent them
        assert call["trainable"] is True and call["run"] == RUN and call["group"]["group_id"] == f"grp-{trajectory}"
        assert call["request"]["messages"][0] == {"role": "system", "content": TOOL_SYSTEM}  # the chat request vLLM saw


def test_async_client_stream_and_not(gateway: RunningGateway, db_url: str) -> None:
    recorded = chat_answers("messages_chat_tool_loop")[0]
    trajectory = f"async-{uuid.uuid4().hex[:8]}"

    async def run() -> list[Any]:
        async with anthropic.AsyncAnthropic(
            base_url=f"{gateway.url}/t/{trajectory}", api_key="x", max_retries=0
        ) as sdk:
            whole = await sdk.messages.create(**FIRST)
            async with sdk.messages.stream(**FIRST) as events:
                kinds = [event.type async for event in events]
                streamed = await events.get_final_message()
            return [whole, streamed, kinds]

    whole, streamed, kinds = asyncio.run(run())
    # each replays its own recording, whose tool call ids vLLM drew afresh
    assert [(b.name, b.input) for b in tool_uses(whole)] == [(b.name, b.input) for b in tool_uses(streamed)]
    assert whole.stop_reason == streamed.stop_reason == "tool_use"
    assert whole.usage.output_tokens == streamed.usage.output_tokens == len(recorded["ids"])
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_stop" in kinds
    gateway.flush()
    calls = stored_calls(db_url, trajectory)
    assert [c["stream"] for c in calls] == [False, True]
    assert all(c["completion_token_ids"] == recorded["ids"] for c in calls)


def test_stop_sequence_and_count_tokens(gateway: RunningGateway) -> None:
    recorded = exchanges("messages_chat_tool_loop")
    stop = next(e for e in recorded if e["path"] == CHAT and e["request"].get("stop"))["response"]["choices"][0]
    render = next(e for e in recorded if e["path"].endswith("/render"))
    sdk = client(gateway)
    answer = sdk.messages.create(**STOP_CALL)
    if isinstance(stop["stop_reason"], str):
        assert (answer.stop_reason, answer.stop_sequence) == ("stop_sequence", stop["stop_reason"])
    else:
        assert answer.stop_sequence is None
    assert answer.content[0].text == stop["message"]["content"]
    assert sdk.messages.count_tokens(**COUNT_TOKENS).input_tokens == len(render["response"]["token_ids"])


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_token_in_mode_continues_the_exact_tokens(
    gateway_settings: dict[str, object], db_url: str, stream: bool
) -> None:
    with running_gateway(**{**gateway_settings, "token_state_wait_s": 0.3}) as gw:
        response = httpx.post(gw.url + "/v1/runs", json={"name": RUN, "config": {"token_mode": "token_in"}}, timeout=30)
        assert response.status_code in (200, 201), response.text
        trajectory = f"tokin-{uuid.uuid4().hex[:8]}"
        # eval mode: the client's greedy sampling reaches vLLM, as when the exchanges were recorded
        turns = tool_loop(client(gw, f"/eval/t/{trajectory}"), stream)
        gw.flush()
    assert [(c.name, c.input) for c in tool_uses(turns[0]["answer"])] == [("get_weather", {"city": "Paris"})]
    assert turns[0]["answer"].stop_reason == "tool_use"
    calls = stored_calls(db_url, trajectory)
    assert len(calls) == 3 and all(c["trainable"] and c["endpoint"] == "messages" for c in calls)
    assert [c["segment_reason"] for c in calls] == ["first_call", None, None]
    for before, after in zip(calls, calls[1:]):
        assert after["prompt_token_ids"][: len(before["prompt_token_ids"]) + len(before["completion_token_ids"])] == (
            before["prompt_token_ids"] + before["completion_token_ids"]
        )
    for turn, call in zip(turns, calls):
        assert turn["answer"].usage.output_tokens == len(call["completion_token_ids"])


@pytest.mark.parametrize("form", ["headers", "api_key", "path"])
def test_every_attribution_form_and_the_key_check(gateway_settings: dict[str, object], db_url: str, form: str) -> None:
    trajectory = f"attr-{form}-{uuid.uuid4().hex[:6]}"
    with running_gateway(**{**gateway_settings, "agent_keys": "agent-1"}) as gw:
        if form == "headers":
            sdk = client(gw, api_key="agent-1", default_headers={"X-Trajectory-Id": trajectory, "X-Group-Id": "g-attr"})
        elif form == "api_key":
            sdk = client(gw, api_key=f"agent-1#g-attr/{trajectory}")
        else:
            sdk = client(gw, f"/g/g-attr/n/4/t/{trajectory}", api_key="agent-1")
        answer = sdk.messages.with_raw_response.create(**FIRST)
        assert answer.headers["x-trajectory-id"] == trajectory and answer.headers["request-id"].startswith("req-")
        assert answer.parse().stop_reason == "tool_use"
        with pytest.raises(anthropic.AuthenticationError) as refused:
            client(gw, api_key=f"wrong#g-attr/{trajectory}").messages.create(model=RUN, max_tokens=8, messages=HISTORY)
        assert refused.value.body == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "missing or invalid API key"},
        }
        gw.flush()
    calls = stored_calls(db_url, trajectory)
    assert len(calls) == 1 and calls[0]["group"]["group_id"] == "g-attr"


def test_a_retry_reaches_the_record(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    trajectory = f"retry-{uuid.uuid4().hex[:8]}"
    upstream.mode = "fail_once"
    sdk = anthropic.Anthropic(base_url=f"{gateway.url}/t/{trajectory}", api_key="x", max_retries=1)
    answer = sdk.messages.create(**FIRST)
    assert answer.stop_reason == "tool_use"
    gateway.flush()
    calls = stored_calls(db_url, trajectory)
    # the SDK's x-stainless-retry-count marks the second attempt, which replaces the failed one
    assert [(c["retry_count"], c["status_code"]) for c in calls] == [(1, 200)]


def _error(response: httpx.Response) -> tuple[int, str, str]:
    body = response.json()
    assert set(body) <= {"type", "error", "request_id"} and body["type"] == "error"
    return response.status_code, body["error"]["type"], body["error"]["message"]


def test_bad_requests_get_anthropic_errors(gateway: RunningGateway) -> None:
    url = gateway.url + "/v1/messages"
    good = {"model": RUN, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (json.dumps({k: v for k, v in good.items() if k != "max_tokens"}).encode(), "max_tokens: Field required"),
        (json.dumps({**good, "messages": [{"role": "tool", "content": "x"}]}).encode(), "messages.0.role"),
        (json.dumps({**good, "temperature": -1}).encode(), "temperature"),
        (json.dumps({**good, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}).encode(), "tools.0"),
        (
            json.dumps({**good, "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 4000}}).encode(),
            "less than max_tokens",
        ),
        (json.dumps({**good, "model": "bad name!"}).encode(), "`model` must name a run"),
    ]
    for body, message in cases:
        status, kind, text = _error(httpx.post(url, content=body, headers={"content-type": "application/json"}))
        assert (status, kind) == (400, "invalid_request_error") and message in text, (body, text)
    with pytest.raises(anthropic.BadRequestError) as bad:
        robot: Any = [{"role": "robot", "content": "x"}]
        client(gateway).messages.create(model=RUN, max_tokens=8, messages=robot)
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert _error(httpx.get(url))[:2] == (405, "invalid_request_error")
    huge = b'{"model": "a", "pad": "' + b"x" * (gateway.app.state.settings.max_body_bytes + 1) + b'"}'
    assert _error(httpx.post(url, content=huge))[:2] == (413, "request_too_large")


def test_a_chat_request_grown_past_the_body_limit_is_a_413(gateway_settings: dict[str, object]) -> None:
    """The chat request is what the chat path forwards and records, so it is held to the body limit too: tool uses
    grow in translation (their input becomes escaped JSON arguments), and a body within the limit whose chat request
    is not gets the 413 the chat path answers, in Anthropic's shape and with the call's request id."""
    calls = [{"type": "tool_use", "id": f"t{i}", "name": "f", "input": {"k": "v"}} for i in range(40)]
    body = {"model": RUN, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": calls}]}  # fmt: skip
    raw = json.dumps(body, separators=(",", ":")).encode()
    with running_gateway(**{**gateway_settings, "max_body_bytes": len(raw) + 64}) as gw:
        response = httpx.post(gw.url + "/v1/messages", content=raw, headers={"content-type": "application/json"})
    assert _error(response)[:2] == (413, "request_too_large")
    assert response.json()["request_id"] == response.headers["request-id"] == response.headers["x-request-id"]


def test_upstream_failures_get_anthropic_errors(
    gateway: RunningGateway, upstream: FakeUpstream, gateway_settings: dict[str, object], tmp_path: Path
) -> None:
    sdk = client(gateway)
    kwargs = FIRST
    upstream.mode = "error500"
    with pytest.raises(anthropic.InternalServerError) as failed:
        sdk.messages.create(**kwargs)
    assert failed.value.status_code == 500 and failed.value.body["error"] == {
        "type": "api_error",
        "message": "EngineCore died",
    }  # type: ignore[index]
    assert failed.value.body["request_id"].startswith("req-")  # type: ignore[index]
    upstream.mode = "cut_stream"
    with pytest.raises(anthropic.APIStatusError) as cut, sdk.messages.stream(**kwargs) as events:
        for _ in events:
            pass
    assert "vLLM stream ended unexpectedly" in str(cut.value)
    upstream.mode = "forbidden"  # vLLM without --enable-scale-out: no render endpoint for count_tokens
    with pytest.raises(anthropic.InternalServerError) as no_render:
        sdk.messages.count_tokens(**COUNT_TOKENS)
    assert no_render.value.status_code == 502 and "--enable-scale-out" in no_render.value.message
    upstream.mode = "replay"
    down = {**gateway_settings, "upstream_url": f"http://127.0.0.1:{free_port()}/v1", "spool_dir": tmp_path / "down"}
    with running_gateway(**down) as gw, pytest.raises(anthropic.InternalServerError) as unreachable:
        client(gw).messages.create(**kwargs)
    body: Any = unreachable.value.body
    assert unreachable.value.status_code == 502 and body["error"]["type"] == "api_error"


def test_metrics_read_api_and_export_show_the_endpoint(gateway: RunningGateway) -> None:
    trajectory = f"read-{uuid.uuid4().hex[:8]}"
    client(gateway, f"/t/{trajectory}").messages.create(**FIRST)
    gateway.flush()
    metrics = httpx.get(gateway.url + "/metrics").text
    assert 'trajgate_requests_total{endpoint="messages",status="200"}' in metrics
    view = httpx.get(f"{gateway.url}/v1/trajectories/{trajectory}").json()
    call = view["calls"][0]
    assert call["endpoint"] == "messages" and call["tool_calls"][0]["function"]["name"] == "get_weather"
    assert call["messages"][-1] == HISTORY[-1]
    export = httpx.get(f"{gateway.url}/v1/runs/{RUN}/export").text
    exported = [json.loads(line) for line in export.splitlines() if line.strip()]
    mine = next(t for t in exported if t["trajectory_id"] == trajectory)
    assert mine["calls"][0]["endpoint"] == "messages" and mine["calls"][0]["tool_calls"]
    assert len(mine["calls"][0]["completion_token_ids"]) == len(mine["calls"][0]["completion_logprobs"]) > 0


def test_paths_are_routed_under_prefixes(gateway: RunningGateway) -> None:
    assert api_messages.PATHS == ("/v1/messages", "/v1/messages/count_tokens")
    response = httpx.post(gateway.url + "/eval/t/x/v1/messages/count_tokens", json={"model": RUN})
    assert _error(response)[:2] == (400, "invalid_request_error")  # reached count_tokens: `messages` is missing
    assert _error(httpx.post(gateway.url + "/t/x/v1/messages/batches", json={}))[:2] == (404, "not_found_error")


def test_a_stream_says_its_headers_once(gateway: RunningGateway) -> None:
    """HTTP lets a proxy or client join repeated headers (`no-cache, no-cache`) or take either: each is sent once."""
    with httpx.stream("POST", gateway.url + "/v1/messages", json={**FIRST, "stream": True}, timeout=30) as response:
        response.read()
    assert response.status_code == 200
    names = [name.lower() for name, _ in response.headers.multi_items()]
    assert response.headers.get_list("cache-control") == ["no-cache"]
    assert sorted(names) == sorted(set(names)), names


def test_count_tokens_names_its_run_as_messages_does(gateway: RunningGateway) -> None:
    """An agent whose `model` is not a run name (a CLI sending its own model id) names the run with X-Run; counting
    its tokens takes the same header, not a 400 for the model id."""
    render = next(e for e in exchanges("messages_chat_tool_loop") if e["path"].endswith("/render"))
    odd = {**COUNT_TOKENS, "model": "claude model, not a run name!"}
    refused = httpx.post(gateway.url + "/v1/messages/count_tokens", json=odd, timeout=30)
    assert _error(refused)[:2] == (400, "invalid_request_error")
    counted = httpx.post(gateway.url + "/v1/messages/count_tokens", json=odd, headers={"x-run": RUN}, timeout=30)
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] == len(render["response"]["token_ids"])
