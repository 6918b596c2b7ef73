"""The token_in run mode against render/generate/derender exchanges recorded from real vLLM CPU + SmolLM2.

The recordings (tests/fixtures/vllm/token_in_tool_loop*.json) were made by this gateway driving the tool loop of
tests/support/token_in_agent.py through a recording proxy, so replay answers only the exact requests the gateway sent then:
a different prompt, bridge or derender body gets no answer and the test fails.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import uuid
from typing import Any

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from gateway.http.errors import UpstreamFailure
from gateway.http.metrics import GatewayMetrics
from gateway.proxy import token_in
from gateway.store.lineage import EXTENDS
from gateway.upstream.client import UpstreamPool
from gateway.upstream.replicas import Replicas
from scripts.record_fixtures import TOOL_EXAMPLE, WEATHER_QUESTION, WEATHER_RESULT, WEATHER_TOOL
from tests.support.fake_upstream import FIXTURES, FakeUpstream
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.stored import stored_calls
from tests.support.token_in_agent import RUN, client_for, start_token_in, tool_loop

RECORDED = json.loads((FIXTURES / "token_in_tool_loop.json").read_text())["exchanges"]
RENDER, DERENDER = "/v1/chat/completions/render", "/v1/chat/completions/derender"


def renders() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(full, prefix) render answers of the recorded turns 2 and 3, straight from vLLM."""
    calls = [e for e in RECORDED if e["path"] == RENDER]
    pairs = []
    for first, second in zip(calls[1::2], calls[2::2]):
        full, prefix = (first, second) if "add_generation_prompt" not in first["request"] else (second, first)
        pairs.append((full["response"], prefix["response"]))
    return pairs


@pytest.fixture
def token_gateway(gateway_settings: dict[str, object]) -> Any:
    with running_gateway(**{**gateway_settings, "token_state_wait_s": 0.3}) as gw:
        start_token_in(gw)
        yield gw


# -- the pure parts ----------------------------------------------------------------------------------------------


def test_history_key_ignores_what_sdks_vary() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    compact = '{"city":"Paris"}'  # arguments re-serialised by a client
    function = call["function"]
    forms = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "assistant", "tool_calls": [call], "refusal": None, "annotations": None, "audio": None},
        {"role": "assistant", "content": "", "tool_calls": [call], "function_call": None},
        {"role": "assistant", "content": [], "tool_calls": [{**call, "function": {**function, "arguments": compact}}]},
    ]
    keys = {token_in.extend_key("", form) for form in forms}
    assert len(keys) == 1
    text = {"role": "user", "content": "hi there"}
    one_part = {"role": "user", "content": [{"type": "text", "text": "hi there"}]}
    assert token_in.extend_key("", text) == token_in.extend_key("", one_part)
    # two parts render apart (vLLM joins them with a newline, or the template iterates them)
    parts = {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}
    assert token_in.extend_key("", text) != token_in.extend_key("", parts)
    # what the model said or did is never "harmless"
    other_city = {**call, "function": {**call["function"], "arguments": '{"city": "Lyon"}'}}
    assert token_in.extend_key("", {"role": "assistant", "tool_calls": [other_city]}) not in keys
    assert token_in.extend_key("", {"role": "user", "content": "hi  there"}) != token_in.extend_key("", text)
    assert token_in.history_keys([text, text])[1] == token_in.extend_key(token_in.extend_key("", text), text)


SMOLLM2_ENDS = frozenset({2})


def test_bridge_is_the_template_tokens_after_the_matched_assistant_message() -> None:
    for full, prefix in renders():
        completion_end = prefix["token_ids"][-2]  # ChatML: ... <|im_end|> \n
        assert completion_end == 2
        bridge = token_in.bridge_ids(prefix["token_ids"], full["token_ids"], [5, 2], SMOLLM2_ENDS, SMOLLM2_ENDS)
        assert bridge.ids == full["token_ids"][len(prefix["token_ids"]) - 1 :]
        assert bridge.ids[0] == 198  # the "\n" SmolLM2's template puts after <|im_end|>
        # a completion cut by max_tokens gets the template's closing token too
        cut = token_in.bridge_ids(prefix["token_ids"], full["token_ids"], [5], SMOLLM2_ENDS, SMOLLM2_ENDS)
        assert cut.ids == [2, *bridge.ids]
        # a full render where the assistant message's end is not followed by a turn end: no bridge, and where
        ids, end_at = full["token_ids"], len(prefix["token_ids"]) - 2
        unstable = [*ids[:end_at], 7, *ids[end_at + 1 :]]
        broken = token_in.bridge_ids(prefix["token_ids"], unstable, [2], SMOLLM2_ENDS, SMOLLM2_ENDS)
        assert broken.ids is None and broken.position == len(prefix["token_ids"]) - 2
        # a wrong end token (the tokenizer's is not one of the template's closing tokens): no bridge
        wrong = frozenset({0})
        assert token_in.bridge_ids(prefix["token_ids"], full["token_ids"], [2], wrong, wrong).ids is None


def test_coalesced_generate_chunks_and_the_end_token_left_out_of_derender() -> None:
    def chunk(ids: list[int], finish: str | None = None) -> dict[str, Any]:
        content = [{"token_id": t, "logprob": -0.5} for t in ids]
        choice = {"index": 0, "token_ids": ids, "logprobs": {"content": content}, "finish_reason": finish}
        return {"request_id": "g", "choices": [{**choice, "stop_reason": None}]}

    merged = token_in.merge_generate_chunks([chunk([1]), chunk([2, 3]), chunk([4], "stop")])[0]
    assert merged["choices"][0]["token_ids"] == [1, 2, 3, 4]
    assert [e["token_id"] for e in merged["choices"][0]["logprobs"]["content"]] == [1, 2, 3, 4]
    assert merged["choices"][0]["finish_reason"] == "stop"
    shown = token_in.for_derender(merged)["choices"][0]
    assert shown["token_ids"] == [1, 2, 3] and len(shown["logprobs"]["content"]) == 4
    assert token_in.for_derender(chunk([1, 2], "length"))["choices"][0]["token_ids"] == [1, 2]


def test_a_lone_end_token_stays_for_the_whole_answers_derender() -> None:
    """vLLM's non-stream derender refuses a choice without ids, so a reply that ended at once keeps its end token
    there; the streaming derender takes the empty chunk; a choice generate sent without ids is vLLM's fault, a 502."""
    def generated(ids: list[int], finish: str = "stop", stop_reason: Any = None) -> dict[str, Any]:
        return {"choices": [{"index": 0, "token_ids": ids, "finish_reason": finish, "stop_reason": stop_reason}]}

    assert token_in.for_derender(generated([2]), whole=True)["choices"][0]["token_ids"] == [2]
    assert token_in.for_derender(generated([5, 2]), whole=True)["choices"][0]["token_ids"] == [5]
    assert token_in.for_derender(generated([2]))["choices"][0]["token_ids"] == []
    assert token_in.ended_at_once(generated([2])["choices"][0])
    assert not token_in.ended_at_once(generated([7], "length")["choices"][0])
    assert not token_in.ended_at_once(generated([7], stop_reason="\n")["choices"][0])  # a stop string: text, not a token
    with pytest.raises(UpstreamFailure) as raised:
        token_in.for_derender(generated([]), whole=True)
    assert raised.value.error.status == 502 and "choice 0 without token ids" in raised.value.error.message


def test_a_vllm_client_error_keeps_its_param_and_code() -> None:
    # render's 400 for tool_choice "required" without tools, as vLLM 0.32 answers it (chat mode passes it verbatim)
    error = {
        "message": 'When using `tool_choice`, `tools` must be set.',
        "type": "BadRequestError",
        "param": "tool_choice",
        "code": 400,
    }
    told = token_in.upstream_error(RENDER, 400, json.dumps({"error": error}).encode())
    assert told.status == 400 and json.loads(told.body()) == {"error": error}


# -- through the gateway -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_tool_loop_turns_extend_and_clients_see_openai_shapes(
    token_gateway: RunningGateway, upstream: FakeUpstream, db_url: str, stream: bool
) -> None:
    trajectory = f"loop-{uuid.uuid4().hex[:8]}"
    turns = tool_loop(client_for(token_gateway, trajectory), stream)
    assert turns[0]["assistant"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(turns[0]["assistant"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert all("<|im_end|>" not in (t["assistant"].get("content") or "") for t in turns)
    assert turns[1]["assistant"]["content"]
    token_gateway.flush()
    calls = stored_calls(db_url, trajectory)
    assert len(calls) == 3 and all(c["trainable"] and c["status_code"] == 200 for c in calls)
    assert [c["segment_reason"] for c in calls] == ["first_call", None, None]
    assert [c["merge_reason"] for c in calls[1:]] == [EXTENDS, EXTENDS]
    for (full, prefix), before, after in zip(renders(), calls, calls[1:]):
        bridge = full["token_ids"][len(prefix["token_ids"]) - 1 :]
        assert after["prompt_token_ids"] == before["prompt_token_ids"] + before["completion_token_ids"] + bridge
        assert len(after["completion_logprobs"]) == len(after["completion_token_ids"])
    assert calls[0]["finish_reason"] == "tool_calls" and calls[0]["response"]["choices"][0]["message"]["tool_calls"]
    assert all(c["history_key"] for c in calls) and len({c["history_key"] for c in calls}) == 3


def test_read_api_and_export_show_why_a_segment_started(token_gateway: RunningGateway) -> None:
    # docs/agents.md sends users to segment_reason; the admin read API and the export are where they read calls
    trajectory = f"segment-{uuid.uuid4().hex[:8]}"
    tool_loop(client_for(token_gateway, trajectory), False)
    token_gateway.flush()
    view = httpx.get(f"{token_gateway.url}/v1/trajectories/{trajectory}", timeout=30).json()
    assert [c["segment_reason"] for c in view["calls"]] == ["first_call", None, None]
    export = httpx.get(f"{token_gateway.url}/v1/runs/{RUN}/export?include_eval=true", timeout=60).text
    exported = [json.loads(line) for line in export.splitlines() if line.strip()]
    mine = next(t for t in exported if t["trajectory_id"] == trajectory)
    assert [c["segment_reason"] for c in mine["calls"]] == ["first_call", None, None]


def test_stream_ends_with_usage_and_done_and_strips_ids(token_gateway: RunningGateway) -> None:
    trajectory = f"usage-{uuid.uuid4().hex[:8]}"
    body = {
        "model": RUN,
        "messages": [*TOOL_EXAMPLE, {"role": "user", "content": WEATHER_QUESTION}],
        "tools": TOOLS,
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    url = f"{token_gateway.url}/eval/t/{trajectory}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 87
    assert chunks[-1]["usage"]["completion_tokens"] == 31
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "tool_calls"
    assert all(c.get("prompt_token_ids") is None for c in chunks)
    assert all(ch.get("token_ids") is None and ch.get("logprobs") is None for c in chunks for ch in c["choices"])
    # derender answers every token; the client gets only the chunks that say something
    assert len(chunks) < 31


def cut_tool_call_exchanges(cut_at: int) -> list[dict[str, Any]]:
    """The recorded first streamed turn as vLLM answers it with `max_tokens` = cut_at, inside the tool call: the
    generate stream ends with that token and `length`, and streaming derender, having streamed a call, says
    `tool_calls` for it (vllm/renderers/online_derenderer.py rewrites any finish reason once tools_streamed)."""
    recorded = copy.deepcopy(json.loads((FIXTURES / "token_in_tool_loop_stream.json").read_text())["exchanges"])
    render, generate, derenders = recorded[0], recorded[1], recorded[2 : 2 + cut_at]
    render["request"]["max_tokens"] = cut_at
    render["response"]["sampling_params"]["max_tokens"] = cut_at
    generate["request"]["sampling_params"]["max_tokens"] = cut_at
    chunks = [json.loads(c) for c in generate["chunks"][:cut_at]]
    chunks[-1]["choices"][0]["finish_reason"] = "length"
    generate["chunks"] = [*(json.dumps(c) for c in chunks), "[DONE]"]
    for derender in derenders:
        derender["request"]["chat_request"]["max_tokens"] = cut_at
    derenders[-1]["request"]["generate_chunk"]["choices"][0]["finish_reason"] = "length"
    assert derenders[-1]["request"]["stream_state"]["tools_streamed"]
    derenders[-1]["response"]["chunk"]["choices"][0]["finish_reason"] = "tool_calls"
    return [render, generate, *derenders]


def test_stream_tool_call_cut_by_max_tokens_finishes_with_length(
    token_gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    # vLLM's chat path says `length` for a call cut short (only a stopped one is `tool_calls`), as token_in does
    # without stream; a streamed token_in call must not take derender's `tool_calls`.
    names = []
    for i, exchange in enumerate(cut_tool_call_exchanges(20)):
        names.append(f"cut_tool_call#{i}")
        upstream.fixtures[names[-1]] = {"stream": False, "headers": {"content-type": "application/json"}, **exchange}
    trajectory = f"cut-{uuid.uuid4().hex[:8]}"
    body = {
        "model": RUN,
        "messages": [*TOOL_EXAMPLE, {"role": "user", "content": WEATHER_QUESTION}],
        "tools": TOOLS,
        "max_tokens": 20,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        url = f"{token_gateway.url}/eval/t/{trajectory}/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    finally:
        for name in names:
            del upstream.fixtures[name]
    chunks = [json.loads(e) for e in events[:-1] if json.loads(e)["choices"]]
    assert any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    token_gateway.flush()
    (call,) = stored_calls(db_url, trajectory)
    assert call["finish_reason"] == "length" and len(call["completion_token_ids"]) == 20
    assert call["response"]["choices"][0]["finish_reason"] == "length"


def test_max_tokens_16_reaches_generate_though_render_leaves_it_out(
    token_gateway: RunningGateway, upstream: FakeUpstream
) -> None:
    """vLLM 0.32's render answers its sampling params without the fields at their defaults, and `max_tokens` 16 is
    SamplingParams' default, so render says nothing of it; generate then takes a missing `max_tokens` as "not asked"
    and runs to the end of the context (vllm/entrypoints/scale_out/token_in_token_out/serving.py). The gateway must
    send generate the 16 render computed."""
    exchanges = cut_tool_call_exchanges(16)
    del exchanges[0]["response"]["sampling_params"]["max_tokens"]  # as render answers a request for 16
    names = []
    for i, exchange in enumerate(exchanges):
        names.append(f"max_tokens_16#{i}")
        upstream.fixtures[names[-1]] = {"stream": False, "headers": {"content-type": "application/json"}, **exchange}
    body = {
        "model": RUN, "messages": [*TOOL_EXAMPLE, {"role": "user", "content": WEATHER_QUESTION}], "tools": TOOLS,
        "max_tokens": 16, "temperature": 0, "stream": True,
    }  # fmt: skip
    before = len(upstream.received)
    try:
        url = f"{token_gateway.url}/eval/t/max16-{uuid.uuid4().hex[:8]}/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            assert response.status_code == 200
            response.read()
    finally:
        for name in names:
            del upstream.fixtures[name]
    (generate,) = [r for r in upstream.received[before:] if "token_ids" in r and "sampling_params" in r]
    assert generate["sampling_params"]["max_tokens"] == 16


def test_retry_and_concurrent_turns_extend_the_same_predecessor(token_gateway: RunningGateway, db_url: str) -> None:
    trajectory = f"retry-{uuid.uuid4().hex[:8]}"
    client = client_for(token_gateway, trajectory)
    turns = tool_loop(client, False, turns=2)
    second = turns[1]["messages"]

    def again() -> None:
        client.chat.completions.create(model=RUN, messages=second, tools=TOOLS, max_tokens=48, temperature=0)

    threads = [threading.Thread(target=again) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    token_gateway.flush()
    calls = stored_calls(db_url, trajectory)
    assert len(calls) == 4
    first = calls[0]["prompt_token_ids"] + calls[0]["completion_token_ids"]
    assert [c["prompt_token_ids"][: len(first)] == first for c in calls[1:]] == [True, True, True]
    assert calls[1]["prompt_token_ids"] == calls[2]["prompt_token_ids"] == calls[3]["prompt_token_ids"]
    assert [c["segment_reason"] for c in calls[1:]] == [None, None, None]
    # Each repeat is built on turn 1, so it extends turn 1 (not a `retry` of the attempt at the previous seq) and
    # stores only the ids past turn 1's prompt + completion.
    assert [c["merge_reason"] for c in calls[1:]] == [EXTENDS, EXTENDS, EXTENDS]
    assert [(c["parent_seq"], c["prefix_len"]) for c in calls[1:]] == [(calls[0]["seq"], len(first))] * 3
    new_ids = len(calls[1]["prompt_token_ids"]) - len(first)
    assert [len(c["stored_prompt_token_ids"]) for c in calls[1:]] == [new_ids] * 3


def test_a_second_gateway_finds_the_state_in_the_database(gateway_settings: dict[str, object], db_url: str) -> None:
    trajectory = f"two-{uuid.uuid4().hex[:8]}"
    settings = {**gateway_settings, "token_state_wait_s": 2.0}
    with running_gateway(**settings) as first, running_gateway(**settings) as second:
        start_token_in(first)
        httpx.post(second.url + "/v1/runs", json={"name": RUN, "config": {}}, timeout=30)  # its router refreshes
        turn1 = tool_loop(client_for(first, trajectory), False, turns=1)[0]
        first.flush()
        messages = [*turn1["messages"], turn1["assistant"]]
        call_id = turn1["assistant"]["tool_calls"][0]["id"]
        messages.append({"role": "tool", "tool_call_id": call_id, "content": WEATHER_RESULT})
        client_for(second, trajectory).chat.completions.create(
            model=RUN, messages=messages, tools=TOOLS, max_tokens=48, temperature=0
        )
        second.flush()
    calls = stored_calls(db_url, trajectory)
    assert [c["merge_reason"] for c in calls] == ["first_call", EXTENDS]
    assert calls[1]["segment_reason"] is None


def test_history_that_matches_nothing_recorded_starts_a_new_segment(token_gateway: RunningGateway, db_url: str) -> None:
    trajectory = f"edit-{uuid.uuid4().hex[:8]}"
    client = client_for(token_gateway, trajectory)
    turn1 = tool_loop(client, False, turns=1)[0]
    # the same first request again: its only assistant message is the in-context example, which no call returned
    client.chat.completions.create(model=RUN, messages=turn1["messages"], tools=TOOLS, max_tokens=48, temperature=0)
    token_gateway.flush()
    calls = stored_calls(db_url, trajectory)
    assert [c["segment_reason"] for c in calls] == ["first_call", "no_recorded_history_matches"]
    assert calls[1]["prompt_token_ids"] == calls[0]["prompt_token_ids"]  # the full render, again


def test_predecessor_lookup_prefers_the_longest_recorded_history() -> None:
    # predecessor() reads the token states and the database (none here): nothing goes upstream or is recorded.
    pool = UpstreamPool({}, connect_timeout_s=1, read_timeout_s=1)
    outcome: Any = None
    owner = token_in.TokenIn(pool, Replicas(["http://vllm/v1"]), outcome, GatewayMetrics(), None, wait_s=0.05)
    user = {"role": "user", "content": "q"}
    reply1 = {"role": "assistant", "content": "a1"}
    reply2 = {"role": "assistant", "content": "a2"}
    messages = [user, reply1, user, reply2, user]
    keys = token_in.history_keys(messages)
    owner.states.put("t", keys[1], token_in.TurnState(1, 0, [1], [2]))
    owner.states.put("t", keys[3], token_in.TurnState(2, 0, [3], [4]))
    state, length, reason = asyncio.run(owner.predecessor("t", messages, keys))
    assert (state.seq, length, reason) == (2, 4, None)  # type: ignore[union-attr]
    edited = [user, reply1, user, {"role": "assistant", "content": "a2 (edited)"}, user]
    state, length, reason = asyncio.run(owner.predecessor("t", edited, token_in.history_keys(edited)))
    assert (state.seq, length, reason) == (1, 2, None)  # type: ignore[union-attr]
    state, length, reason = asyncio.run(owner.predecessor("other", messages, keys))
    assert (state, reason) == (None, "first_call")
    state, length, reason = asyncio.run(owner.predecessor("t", [user], token_in.history_keys([user])))
    assert (state, reason) == (None, "first_call")


def test_vllm_without_scale_out_gets_one_clear_error(gateway_settings: dict[str, object], db_url: str) -> None:
    forbidden = FakeUpstream(fixtures={}).start()
    forbidden.mode = "forbidden"
    trajectory = f"flag-{uuid.uuid4().hex[:8]}"
    try:
        with running_gateway(**{**gateway_settings, "upstream_url": forbidden.base_url}) as gw:
            start_token_in(gw)
            with pytest.raises(openai.APIStatusError) as raised:
                tool_loop(client_for(gw, trajectory), False, turns=1)
            gw.flush()
    finally:
        forbidden.stop()
    assert raised.value.status_code == 502
    assert "start vLLM with --enable-scale-out to use token_mode token_in" in raised.value.message
    calls = stored_calls(db_url, trajectory)
    assert len(calls) == 1 and calls[0]["status_code"] == 502 and not calls[0]["trainable"]
    assert "--enable-scale-out" in calls[0]["error"]


def test_chat_mode_is_unchanged(gateway: RunningGateway, upstream: FakeUpstream) -> None:
    fixture = json.loads((FIXTURES / "chat_tools.json").read_text())
    before = len(upstream.received)
    client = openai.OpenAI(base_url=f"{gateway.url}/eval/t/chat-{uuid.uuid4().hex[:8]}/v1", api_key="x", max_retries=0)
    body = {k: v for k, v in fixture["request"].items() if k not in ("logprobs", "return_token_ids", "model")}
    answer = client.chat.completions.create(model="chat-run", **body)
    assert answer.choices[0].message.tool_calls
    assert [set(r) >= {"messages"} for r in upstream.received[before:]] == [True]  # one plain chat request


TOOLS = [WEATHER_TOOL]


# -- logprobs and n, against recorded token_in calls and chat mode's answers -------------------------------------

LOGPROBS = json.loads((FIXTURES / "token_in_logprobs.json").read_text())
N_CALLS = json.loads((FIXTURES / "token_in_n.json").read_text())["exchanges"]


def generated_ids(exchanges: list[dict[str, Any]], stream: bool, n: int = 1) -> dict[int, list[int]]:
    """Per choice, the ids real vLLM generated in the first recorded call streamed (or not)."""
    generate = next(e for e in exchanges if e["path"].endswith("/generate") and bool(e["request"].get("stream")) == stream)
    chunks = [json.loads(c) for c in generate["chunks"] if c != "[DONE]"] if stream else [generate["response"]]
    ids: dict[int, list[int]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            ids.setdefault(choice["index"], []).extend(choice["token_ids"] or ())
    assert len(ids) == n
    return ids


def ask(gateway: RunningGateway, trajectory: str, stream: bool, **extra: Any) -> tuple[dict[int, list[Any]], int]:
    """The SDK's view of one call: per choice index, its logprob entries (as dicts); and how many choices answered."""
    client = client_for(gateway, trajectory)
    messages = [{"role": "user", "content": "Say hi in French."}]
    answer = client.chat.completions.create(model=RUN, messages=messages, stream=stream, **extra)  # type: ignore[call-overload]
    entries: dict[int, list[Any]] = {}
    if not stream:
        for choice in answer.choices:
            entries[choice.index] = [e.model_dump() for e in (choice.logprobs.content if choice.logprobs else None) or ()]
        return entries, len(answer.choices)
    indexes = set()
    for chunk in answer:
        for choice in chunk.choices:
            indexes.add(choice.index)
            content = choice.logprobs.content if choice.logprobs else None
            entries.setdefault(choice.index, []).extend(e.model_dump() for e in content or ())
    return entries, len(indexes)


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
@pytest.mark.parametrize("top", [2, None], ids=["top_logprobs-2", "logprobs-only"])
def test_logprobs_asked_are_chat_modes_and_the_recorded_ids(
    token_gateway: RunningGateway, db_url: str, stream: bool, top: int | None
) -> None:
    trajectory = f"lp-{uuid.uuid4().hex[:8]}"
    extra: dict[str, Any] = {"logprobs": True, "max_tokens": 24, "temperature": 0}
    if top is not None:
        extra["top_logprobs"] = top
    entries, choices = ask(token_gateway, trajectory, stream, **extra)
    reference = LOGPROBS["chat_reference"][0 if top else 1]["choices"][0]["logprobs"]["content"]
    assert choices == 1 and entries[0] == reference  # tokens, bytes, values and top_logprobs as chat mode sends them
    assert [len(e["top_logprobs"]) for e in entries[0]] == [top or 0] * len(reference)
    token_gateway.flush()
    [row] = stored_calls(db_url, trajectory)
    assert [e["logprob"] for e in entries[0]] == row["completion_logprobs"]
    assert len(row["completion_token_ids"]) == len(entries[0])


EMPTY = json.loads((FIXTURES / "token_in_empty.json").read_text())


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
@pytest.mark.parametrize("logprobs", [False, True], ids=["plain", "logprobs"])
def test_a_reply_that_ends_at_once_answers_as_chat_mode(
    token_gateway: RunningGateway, db_url: str, stream: bool, logprobs: bool
) -> None:
    """The model's first token ends its turn (recorded from vLLM with that token's logit raised): chat mode answers an
    empty message, so must token_in, and the end token is recorded for training."""
    trajectory = f"empty-{uuid.uuid4().hex[:8]}"
    extra: dict[str, Any] = {"max_tokens": 8, "temperature": 0, "logit_bias": {"2": 100}}
    if logprobs:
        extra["logprobs"] = True
    client = client_for(token_gateway, trajectory)
    messages = [{"role": "user", "content": "Say hi in French."}]
    answer = client.chat.completions.create(model=RUN, messages=messages, stream=stream, **extra)  # type: ignore[call-overload]
    reference = EMPTY["chat_reference"][1 if logprobs else 0]["choices"][0]
    if stream:
        chunks = list(answer)
        # The message the SDK assembles, as an agent reads it: chat mode's stream opens with the role and content "".
        state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
        for chunk in chunks:
            state.handle_chunk(chunk)
        [assembled] = state.get_final_completion().choices
        assert assembled.message.content == reference["message"]["content"] == ""
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == [reference["finish_reason"]]
        entries = [e.model_dump() for c in chunks if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content or ()]
    else:
        choice = answer.choices[0]
        assert choice.message.content == reference["message"]["content"] == ""
        assert choice.finish_reason == reference["finish_reason"] and not choice.message.tool_calls
        entries = [e.model_dump() for e in (choice.logprobs.content if choice.logprobs else None) or ()]
        assert answer.usage.completion_tokens == 1
    assert entries == (reference["logprobs"]["content"] if logprobs else [])
    token_gateway.flush()
    [row] = stored_calls(db_url, trajectory)
    assert row["status_code"] == 200 and row["completion_token_ids"] == reference["token_ids"] == [2]
    assert len(row["completion_logprobs"]) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_n_choices_answer_and_record_one_row_each(token_gateway: RunningGateway, db_url: str, stream: bool) -> None:
    trajectory = f"n-{uuid.uuid4().hex[:8]}"
    _, choices = ask(token_gateway, trajectory, stream, n=2, temperature=0.8, seed=1, max_tokens=8)
    assert choices == 2
    token_gateway.flush()
    rows = stored_calls(db_url, trajectory)
    ids = generated_ids(N_CALLS, stream, n=2)
    assert [r["choice_index"] for r in rows] == [0, 1]
    assert [r["completion_token_ids"] for r in rows] == [ids[0], ids[1]]
    assert rows[0]["seq"] == rows[1]["seq"] and rows[0]["prompt_token_ids"] == rows[1]["prompt_token_ids"]
    assert all(len(r["completion_logprobs"]) == len(r["completion_token_ids"]) for r in rows)
    assert len({r["history_key"] for r in rows}) == 2  # each choice continues on its own
