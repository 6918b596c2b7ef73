"""The OpenAI Responses API through the gateway: the OpenAI SDK's `responses.create` against chat exchanges recorded
from real vLLM CPU + SmolLM2 (tests/fixtures/vllm/responses_*.json, recorded by driving tests/support/responses_agent.py through
this gateway). Replay answers only a chat request equal to the recorded one, so every passing call also proves the
translation sends vLLM what it sent then."""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import httpx
import openai
import pytest

from gateway.edge import api_responses
from gateway.http.errors import GatewayError
from gateway.proxy.capture import StreamAssembler
from gateway.recorder import writer as gateway_writer
from gateway.store.db import make_engine
from gateway.store.lineage import EXTENDS
from gateway.store.models import CHAT
from scripts.record_fixtures import TOOL_SYSTEM, WEATHER_RESULT
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.responses_agent import FUNCTION_TOOL, QUESTION, RUN, TOKEN_IN_RUN, TOOL_ITEMS, ask, tool_loop
from tests.support.stored import stored_calls

# responses_chat.json's exchanges, in the order the recorder made them
ASK, TOOL_CALL, TOOL_RESULT, ASK_STREAM, TOOL_CALL_STREAM, TOOL_RESULT_STREAM, ASK_NOT_STORED = range(7)
ASK_LOGPROBS, ASK_LOGPROBS_STREAM = 7, 8


def recorded(upstream: FakeUpstream, index: int) -> dict[str, Any]:
    """The recorded chat answer (assembled when it was streamed)."""
    exchange = upstream.fixture(f"responses_chat#{index}")
    if not exchange.get("stream"):
        return exchange["response"]
    assembler = StreamAssembler(CHAT)
    for payload in exchange["chunks"]:
        if payload != "[DONE]":
            assembler.feed(json.loads(payload))
    return assembler.response()


def client(gw: RunningGateway, trajectory: str, mode: str = "eval", **kwargs: Any) -> openai.OpenAI:
    # eval mode: the client's greedy sampling reaches vLLM, as when the exchanges were recorded
    base = f"{gw.url}/eval/t/{trajectory}/v1" if mode == "eval" else gw.base_url
    return openai.OpenAI(base_url=base, api_key=kwargs.pop("api_key", "x"), max_retries=0, **kwargs)


def assert_recorded(call: dict[str, Any], answer: dict[str, Any]) -> None:
    """The record holds exactly the ids and logprobs vLLM produced, under the Responses endpoint, trainable."""
    choice = answer["choices"][0]
    assert call["endpoint"] == "responses"
    assert call["prompt_token_ids"] == answer["prompt_token_ids"]
    assert call["completion_token_ids"] == choice["token_ids"]
    assert call["completion_logprobs"] == pytest.approx([e["logprob"] for e in choice["logprobs"]["content"]])
    assert call["trainable"] is True, call["untrainable_reason"]


# -- translation (pure) ----------------------------------------------------------------------------------------------


def test_items_become_the_chat_messages_the_model_answered() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        call,
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    tool_call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert api_responses.input_messages(items) == [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    # a function call with no assistant text before it is an assistant message of its own
    assert api_responses.input_messages([call]) == [{"role": "assistant", "content": None, "tool_calls": [tool_call]}]


def test_output_items_sent_back_as_input_give_the_answer_back() -> None:
    message = {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}},
    ]}  # fmt: skip
    items = api_responses.output_items({"message": message, "finish_reason": "tool_calls"}, "ab" * 16, {})
    assert [i["type"] for i in items] == ["message", "function_call", "function_call"]
    assert api_responses.input_messages(items) == [message]


def test_tools_and_fields_vllm_cannot_use_are_dropped_and_named_in_the_record() -> None:
    """As vLLM's own endpoint: a namespace's functions are shown flat, built-in tools and unknown fields are
    dropped, vLLM's sampling extras pass on; the chat request names what was dropped."""
    function = {"type": "function", "name": "run", "parameters": {"type": "object"}}
    spawn = {"type": "function", "name": "spawn", "description": "Start one.", "parameters": {"type": "object"}}
    body = {
        "model": "m", "input": "hi", "client_metadata": {"session_id": "s"}, "top_k": 5,
        "tools": [function, {"type": "namespace", "name": "agents", "tools": [spawn]}, {"type": "web_search"},
                  {"type": "mcp", "server_label": "x"}],
    }  # fmt: skip
    chat = api_responses.chat_request(body, None)
    assert [tool["function"]["name"] for tool in chat["tools"]] == ["run", "agents__spawn"]
    assert chat["tools"][1]["function"]["description"] == "Start one." and chat["top_k"] == 5
    assert chat[api_responses.EXTRA] == {
        "namespaces": ["agents"], "dropped_tools": ["web_search", "mcp"], "ignored": ["client_metadata"]
    }
    # a call of the namespaced function comes back named as the request named it, and goes back in the same way
    message = {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "agents__spawn", "arguments": "{}"}}
    ]}  # fmt: skip
    response = api_responses.response_object("resp_" + "ab" * 16, chat, {"choices": [{"message": message}]})
    [call] = response["output"]
    assert (call["name"], call["namespace"]) == ("spawn", "agents")
    assert api_responses.input_messages([call])[0]["tool_calls"] == message["tool_calls"]
    # with every tool dropped, no tool_choice "auto" is sent without tools (vLLM's chat refuses that)
    only_search = api_responses.chat_request({**body, "tools": [{"type": "web_search"}], "tool_choice": "auto"}, None)
    assert "tools" not in only_search and "tool_choice" not in only_search


PATCH = "*** Begin Patch\n*** Add File: a.txt\n+\u00e9t\u00e9 \"quoted\"\n*** End Patch\n"
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files."}


def test_a_free_form_custom_tool_is_a_function_of_one_string_as_vllm_shows_it() -> None:
    """vLLM 0.32's `get_function_tools`: a custom tool is shown as a function taking {"input": str}, a call of it
    comes back as a `custom_tool_call` with the decoded input, and such an item sent back is that function call
    again (with vLLM's encoding of it); its output is the tool message. A named custom tool_choice names the shim."""
    body = {"model": "m", "input": "fix it", "tools": [APPLY_PATCH],
            "tool_choice": {"type": "custom", "name": "apply_patch"}}  # fmt: skip
    chat = api_responses.chat_request(body, None)
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "apply_patch", "description": "Edit files.", "parameters": api_responses.CUSTOM_PARAMETERS}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "apply_patch"}}
    assert chat[api_responses.EXTRA]["custom_tools"] == ["apply_patch"]
    arguments = json.dumps({"input": PATCH}, ensure_ascii=False)
    message = {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "apply_patch", "arguments": arguments}}]}  # fmt: skip
    [call] = api_responses.response_object("resp_" + "ab" * 16, chat, {"choices": [{"message": message}]})["output"]
    assert call == {"type": "custom_tool_call", "id": "ctc_" + "ab" * 16 + "_0", "call_id": "c1",
                    "name": "apply_patch", "input": PATCH}  # fmt: skip
    output = {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done"}
    assert api_responses.input_messages([call, output]) == [
        {**message, "content": None}, {"role": "tool", "tool_call_id": "c1", "content": "Done"}]
    # a model that writes the payload bare (not the shim's JSON) has that text taken as the input, as vLLM takes it
    bare = {"role": "assistant", "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "apply_patch", "arguments": "*** Begin"}}]}  # fmt: skip
    [call] = api_responses.response_object("resp_" + "ab" * 16, chat, {"choices": [{"message": bare}]})["output"]
    assert call["input"] == "*** Begin"


def test_a_grammar_custom_tool_is_dropped_and_named_in_the_record() -> None:
    """Codex's own apply_patch carries a lark grammar, which vLLM 0.32 refuses (a 400 for the whole request); the
    gateway drops that tool as it drops built-in ones, so the session goes on, and the record says so."""
    grammar = {**APPLY_PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
    chat = api_responses.chat_request({"model": "m", "input": "hi", "tools": [grammar]}, None)
    assert "tools" not in chat and chat[api_responses.EXTRA]["dropped_tools"] == ["custom:apply_patch"]


def test_a_cut_off_answer_has_completed_items_in_an_incomplete_response() -> None:
    """vLLM's endpoint: every output item says `completed`, and the cut shows in the Response's status."""
    message = {"role": "assistant", "content": "Hal", "reasoning": "Think", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "run", "arguments": "{"}}]}  # fmt: skip
    chat = api_responses.chat_request({"model": "m", "input": "hi", "max_output_tokens": 3}, None)
    answer = {"choices": [{"message": message, "finish_reason": "length"}]}
    response = api_responses.response_object("resp_" + "ab" * 16, chat, answer)
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["status"] for item in response["output"]] == ["completed"] * 3


def test_an_unfinished_answer_sent_back_last_is_continued_as_vllm_does() -> None:
    """vLLM's `should_continue_final_message`: a last message (or reasoning) item marked in_progress or incomplete
    is continued, with no new assistant turn opened."""
    partial = {"type": "message", "role": "assistant", "status": "incomplete",
               "content": [{"type": "output_text", "text": "Hel", "annotations": []}]}  # fmt: skip
    body = {"model": "m", "input": [{"role": "user", "content": "Hi"}, partial]}
    chat = api_responses.chat_request(body, None)
    assert chat["messages"][-1] == {"role": "assistant", "content": "Hel"}
    assert (chat["add_generation_prompt"], chat["continue_final_message"]) == (False, True)
    for done in ({**partial, "status": "completed"}, {**partial, "status": None}):
        chat = api_responses.chat_request({**body, "input": [body["input"][0], done]}, None)
        assert "continue_final_message" not in chat and "add_generation_prompt" not in chat


def test_conversation_is_ignored_and_a_namespaced_tool_choice_found_as_vllm_does() -> None:
    """vLLM's endpoint reads no `conversation` (the record names it as ignored), and a named tool choice may name a
    namespace's function without its namespace where only one namespace has it."""
    spawn = {"type": "function", "name": "spawn", "parameters": {"type": "object"}}
    body = {"model": "m", "input": "hi", "conversation": "conv_1",
            "tools": [{"type": "namespace", "name": "agents", "tools": [spawn]}],
            "tool_choice": {"type": "function", "name": "spawn"}}  # fmt: skip
    chat = api_responses.chat_request(body, None)
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "agents__spawn"}}
    assert chat[api_responses.EXTRA]["ignored"] == ["conversation"]
    both = [*body["tools"], {"type": "namespace", "name": "tasks", "tools": [spawn]}]
    with pytest.raises(GatewayError, match="more than one namespace"):
        api_responses.chat_request({**body, "tools": both}, None)
    unknown = api_responses.chat_request({**body, "tool_choice": {"type": "function", "name": "nope"}}, None)
    assert unknown["tool_choice"]["function"]["name"] == "nope"  # vLLM's chat endpoint refuses it, as its own does


async def test_a_streamed_custom_tool_call_sends_its_input_as_vllm_does() -> None:
    chat = api_responses.chat_request({"model": "m", "input": "fix", "tools": [APPLY_PATCH], "stream": True}, None)
    arguments = json.dumps({"input": PATCH}, ensure_ascii=False)
    pieces = [arguments[:9], arguments[9:30], arguments[30:]]
    chunks = [{"id": "c", "created": 1, "choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "apply_patch", "arguments": ""}}]}}]}]
    chunks += [{"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": piece}}]}}]} for piece in pieces]  # fmt: skip
    chunks.append({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message.get("body", b""))

    class Kept:
        def remember(self, chat: dict[str, Any], response: dict[str, Any]) -> None:
            pass

    stream = api_responses._EventStream(Kept(), chat, "resp_" + "ab" * 16, None, send)  # type: ignore[arg-type]
    for chunk in chunks:
        stream.chunk(chunk)
    stream.done()
    await stream.flush()
    await stream.end()
    events = [json.loads(block.split(b"data: ", 1)[1]) for block in b"".join(sent).split(b"\n\n") if block]
    kinds = [event["type"] for event in events]
    assert "response.function_call_arguments.delta" not in kinds
    added = events[kinds.index("response.output_item.added")]["item"]
    assert added == {"type": "custom_tool_call", "id": "ctc_" + "ab" * 16 + "_0", "call_id": "call_1",
                     "name": "apply_patch", "input": ""}  # fmt: skip
    deltas = [event["delta"] for event in events if event["type"] == "response.custom_tool_call_input.delta"]
    assert "".join(deltas) == PATCH
    assert events[kinds.index("response.custom_tool_call_input.done")]["input"] == PATCH
    done = events[kinds.index("response.output_item.done")]["item"]
    assert done == {**added, "input": PATCH} and events[-1]["response"]["output"] == [done]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "unsupported_item"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "unsupported_item"),
        # vLLM's input item models want a custom tool call's call_id, name and input
        ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "apply_patch"}]}, "invalid_value"),
        ({"input": [{"type": "custom_tool_call", "name": "apply_patch", "input": "x"}]}, "invalid_value"),
        ({"input": 5}, "invalid_value"),
        ({"input": "hi", "background": True}, "invalid_value"),
        ({"input": "hi", "metadata": [1]}, "invalid_value"),
        ({"input": "hi", "tool_choice": {"type": "allowed_tools", "tools": []}}, "unsupported_tool"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "invalid_value"),
    ],
)
def test_what_cannot_be_served_is_a_400(body: dict[str, Any], code: str) -> None:
    with pytest.raises(GatewayError) as error:
        api_responses.chat_request({"model": "m", **body}, None)
    assert error.value.status == 400 and error.value.code == code


async def test_an_unreachable_database_is_a_503_not_a_404(tmp_path: Any) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/missing/dir/trajgate.db")
    try:
        api = api_responses.ResponsesAPI(proxy=None, engine=engine, wait_s=0, memory_bytes=0)  # type: ignore[arg-type]
        with pytest.raises(GatewayError) as error:
            await api.find("resp_" + "a" * 32, None, None)
        assert (error.value.status, error.value.code) == (503, "database_unavailable")
        assert await api.find("resp_not-one-of-ours", None, None) is None
    finally:
        engine.dispose()


# -- through the gateway ---------------------------------------------------------------------------------------------


def test_non_stream(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    answer = recorded(upstream, ASK)
    raw = client(gateway, "t-resp").responses.with_raw_response.create(
        model=RUN, input=QUESTION, instructions="Answer in one sentence.", max_output_tokens=24, temperature=0
    )
    response = raw.parse()
    assert response.id == "resp_" + raw.headers["x-request-id"].removeprefix("req-")
    assert response.status == "completed"
    assert response.output_text == answer["choices"][0]["message"]["content"]
    assert response.usage is not None and response.usage.output_tokens == len(answer["choices"][0]["token_ids"])
    assert response.instructions == "Answer in one sentence." and response.model == RUN
    assert raw.headers["x-trajectory-id"] == "t-resp"
    gateway.flush()
    [call] = stored_calls(db_url, "t-resp")
    assert call["id"] == raw.headers["x-request-id"]
    assert_recorded(call, answer)
    # GET gives the same object back, from memory and rebuilt from the record alike
    fetched = client(gateway, "t-resp").responses.retrieve(response.id)
    assert fetched.model_dump() == response.model_dump()
    gateway.app.state.responses._kept.clear()
    assert client(gateway, "t-resp").responses.retrieve(response.id).model_dump() == response.model_dump()


def test_stream_events(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    answer = recorded(upstream, ASK_STREAM)
    events = ask(client(gateway, "t-resp-stream"), True)
    types = [e.type for e in events]
    text_deltas = types.count("response.output_text.delta")
    assert text_deltas > 1
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * text_deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = answer["choices"][0]["message"]["content"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert final.output_text == text and events[-2].item == final.output[0]
    gateway.flush()
    [call] = stored_calls(db_url, "t-resp-stream")
    assert call["stream"] is True and call["id"] == "req-" + final.id.removeprefix("resp_")
    assert_recorded(call, answer)
    # a streamed answer can be fetched and continued like any other
    assert client(gateway, "t-resp-stream").responses.retrieve(final.id).output_text == text


@pytest.mark.parametrize("stream", [False, True])
def test_output_text_logprobs_when_asked(gateway: RunningGateway, upstream: FakeUpstream, stream: bool) -> None:
    entries = recorded(upstream, ASK_LOGPROBS_STREAM if stream else ASK_LOGPROBS)["choices"][0]["logprobs"]["content"]
    answer = ask(client(gateway, f"t-logprobs-{stream}"), stream, include=["message.output_text.logprobs"],
                 top_logprobs=2)  # fmt: skip
    if stream:
        deltas = [e for e in answer if e.type == "response.output_text.delta"]
        streamed = [lp.logprob for e in deltas for lp in e.logprobs]  # each token's with its text (not the EOS)
        assert streamed and streamed == [entry["logprob"] for entry in entries][: len(streamed)]
        answer = answer[-1].response
    [part] = answer.output[0].content
    assert part.logprobs is not None
    assert [(lp.token, lp.logprob) for lp in part.logprobs] == [(e["token"], e["logprob"]) for e in entries]
    assert [len(lp.top_logprobs) for lp in part.logprobs] == [2] * len(entries)
    plain = ask(client(gateway, "t-no-logprobs"), False)
    assert plain.output[0].content[0].logprobs is None  # not asked: not sent


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_loop_by_previous_response_id(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str, stream: bool
) -> None:
    trajectory = f"t-tools-{stream}"
    (first, events), (second, _) = tool_loop(client(gateway, trajectory), stream, by_previous_id=True)
    call_answer = recorded(upstream, TOOL_CALL_STREAM if stream else TOOL_CALL)
    [expected] = call_answer["choices"][0]["message"]["tool_calls"]
    [item] = first.output
    assert item.type == "function_call" and item.call_id == expected["id"]
    assert (item.name, item.arguments) == (expected["function"]["name"], expected["function"]["arguments"])
    if stream:
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert "".join(deltas) == item.arguments
        [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert (done.name, done.arguments) == (item.name, item.arguments)
    result_answer = recorded(upstream, TOOL_RESULT_STREAM if stream else TOOL_RESULT)
    assert second.output_text == result_answer["choices"][0]["message"]["content"]
    assert second.previous_response_id == first.id
    gateway.flush()
    calls = stored_calls(db_url, trajectory)
    assert len(calls) == 2
    assert_recorded(calls[0], call_answer)
    assert_recorded(calls[1], result_answer)
    # the continuation's request holds the earlier turn as the model answered it, and the instructions once
    messages = calls[1]["request"]["messages"]
    assert [m["role"] for m in messages].count("system") == 1
    assert messages[-2]["tool_calls"][0]["id"] == item.call_id
    assert messages[-1] == {"role": "tool", "tool_call_id": item.call_id, "content": WEATHER_RESULT}


def test_resending_every_item_equals_previous_response_id(gateway: RunningGateway, db_url: str) -> None:
    """The Agents SDK without previous_response_id resends the output items: the same chat request reaches vLLM
    (replay would not answer another), and one taken from the database after a restart does too."""
    (first, _), (second, _) = tool_loop(client(gateway, "t-items"), False, by_previous_id=False)
    gateway.flush()
    gateway.app.state.responses._kept.clear()
    output = {"type": "function_call_output", "call_id": first.output[0].call_id, "output": WEATHER_RESULT}
    again = client(gateway, "t-items").responses.create(
        model=RUN, input=[output], previous_response_id=first.id, instructions=TOOL_SYSTEM,
        tools=[FUNCTION_TOOL], max_output_tokens=48, temperature=0,
    )  # fmt: skip
    assert again.output_text == second.output_text
    gateway.flush()
    calls = stored_calls(db_url, "t-items")
    assert calls[1]["request"]["messages"] == calls[2]["request"]["messages"]


def test_previous_response_still_in_the_writers_queue_is_found(
    gateway: RunningGateway, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another gateway answered the first turn (this one holds nothing in memory) and its record has not reached the
    database yet: the continuation waits for it (the writer is held at a gate, not by a timing window)."""
    gate = threading.Event()
    real_write = gateway_writer.write_calls

    def held_write(engine: Any, records: Any, *rest: Any) -> None:
        gate.wait(60)
        real_write(engine, records, *rest)

    monkeypatch.setattr(gateway_writer, "write_calls", held_write)
    sdk = client(gateway, "t-queued")
    common: dict[str, Any] = {"model": RUN, "instructions": TOOL_SYSTEM, "tools": [FUNCTION_TOOL],
                              "max_output_tokens": 48, "temperature": 0}  # fmt: skip
    first = sdk.responses.create(input=TOOL_ITEMS, **common)
    gateway.app.state.responses._kept.clear()
    assert stored_calls(db_url, "t-queued") == []
    threading.Timer(0.3, gate.set).start()
    output = {"type": "function_call_output", "call_id": first.output[0].call_id, "output": WEATHER_RESULT}
    second = sdk.responses.create(input=[output], previous_response_id=first.id, **common)
    assert second.output_text
    gateway.flush()
    assert len(stored_calls(db_url, "t-queued")) == 2


def test_store_false_is_answered_recorded_but_not_kept(gateway: RunningGateway, db_url: str) -> None:
    sdk = client(gateway, "t-nostore")
    response = ask(sdk, False, store=False)
    assert response.store is False and response.output_text
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as error:
        sdk.responses.create(model=RUN, input="more", previous_response_id=response.id)
    assert error.value.code == "previous_response_not_found"
    gateway.flush()
    gateway.app.state.responses._kept.clear()
    with pytest.raises(openai.NotFoundError):  # nor from the record
        sdk.responses.retrieve(response.id)
    [call] = stored_calls(db_url, "t-nostore")
    assert call["trainable"] is True and call["endpoint"] == "responses"


def test_errors_are_openai_shaped(gateway: RunningGateway, upstream: FakeUpstream) -> None:
    sdk = client(gateway, "t-errors")
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.responses.retrieve("resp_" + "0" * 32)
    assert missing.value.body["message"].startswith("No response found")  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as previous:
        sdk.responses.create(model=RUN, input="hi", previous_response_id="resp_nope")
    assert previous.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as reference:
        sdk.responses.create(model=RUN, input=[{"type": "item_reference", "id": "msg_1"}])
    assert reference.value.code == "unsupported_item" and "item_reference" in reference.value.message
    with pytest.raises(openai.BadRequestError) as bad_run:
        sdk.responses.create(model="bad run!", input="hi")
    assert bad_run.value.code == "invalid_model"
    bad_json = httpx.post(gateway.base_url + "/responses", content=b"{nope", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    upstream.mode = "error500"
    with pytest.raises(openai.InternalServerError) as upstream_error:
        ask(sdk, False)
    assert "EngineCore died" in upstream_error.value.message


def test_upstream_failure_mid_stream_is_a_failed_response(gateway: RunningGateway, upstream: FakeUpstream) -> None:
    upstream.mode = "cut_stream"
    events = ask(client(gateway, "t-cut"), True)
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-1].response.status == "failed"


def test_retry_count_reaches_the_record(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    upstream.mode = "fail_once"  # a 500, then the recorded answer: the SDK retries with x-stainless-retry-count: 1
    sdk = client(gateway, "t-retry").with_options(max_retries=1)
    ask(sdk, False)
    gateway.flush()
    calls = stored_calls(db_url, "t-retry")
    # the retry is the same call, not a second turn: one row, the answered attempt, remembering the first
    assert [(c["status_code"], c["retry_count"], c["first_retry_count"]) for c in calls] == [(200, 1, 0)]
    assert calls[0]["endpoint"] == "responses" and calls[0]["trainable"] is True


def test_attribution_forms(gateway: RunningGateway, db_url: str) -> None:
    headers = {"X-Trajectory-Id": "t-h", "X-Group-Id": "g-h", "X-Mode": "eval"}
    ask(client(gateway, "ignored", mode="train", default_headers=headers), False)
    ask(client(gateway, "ignored", mode="train", api_key="sk#g-k/t-k", default_headers={"X-Mode": "eval"}), False)
    prefix = openai.OpenAI(base_url=f"{gateway.url}/eval/g/g-p/t/t-p/v1", api_key="x", max_retries=0)
    ask(prefix, False)
    gateway.flush()
    for trajectory, group in (("t-h", "g-h"), ("t-k", "g-k"), ("t-p", "g-p")):
        [call] = stored_calls(db_url, trajectory)
        assert call["group"]["group_id"] == group and call["endpoint"] == "responses"
    # and GET works under a path prefix
    response = ask(prefix, False)
    assert prefix.responses.retrieve(response.id).id == response.id


def test_metrics_and_read_api_show_the_endpoint(gateway: RunningGateway) -> None:
    ask(client(gateway, "t-read"), False)
    gateway.flush()
    metrics = httpx.get(gateway.url + "/metrics").text
    assert 'trajgate_requests_total{endpoint="responses",status="200"}' in metrics
    view = httpx.get(gateway.url + "/v1/trajectories/t-read").json()
    [call] = view["calls"]
    assert call["endpoint"] == "responses" and call["messages"][-1] == {"role": "user", "content": QUESTION}
    assert call["completion"] and call["completion_tokens"] > 0


@pytest.mark.parametrize("stream", [False, True])
def test_token_in_run(gateway_settings: dict[str, object], db_url: str, stream: bool) -> None:
    """A token_in run: the continuation by previous_response_id extends the first turn's exact ids."""
    with running_gateway(**{**gateway_settings, "token_state_wait_s": 0.3}) as gw:
        body = {"name": TOKEN_IN_RUN, "config": {"token_mode": "token_in"}}
        assert httpx.post(gw.url + "/v1/runs", json=body, timeout=30).status_code in (200, 201)
        trajectory = f"t-tokenin-{stream}-{uuid.uuid4().hex[:6]}"
        (first, _), (second, _) = tool_loop(client(gw, trajectory), stream, by_previous_id=True, run=TOKEN_IN_RUN)
        assert second.previous_response_id == first.id and second.output_text
        gw.flush()
    calls = stored_calls(db_url, trajectory)
    assert [c["endpoint"] for c in calls] == ["responses", "responses"]
    assert all(c["trainable"] for c in calls), [c["untrainable_reason"] for c in calls]
    assert calls[1]["merge_reason"] == EXTENDS
    head = calls[0]["prompt_token_ids"] + calls[0]["completion_token_ids"]
    assert calls[1]["prompt_token_ids"][: len(head)] == head
