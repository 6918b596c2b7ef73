"""The gateway with the official OpenAI SDK as the client and recorded vLLM responses behind it.

Checks the two promises of capture: the client sees exactly what vLLM sent minus what the gateway injected,
and the database holds exactly vLLM's token ids and logprobs.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import RunningGateway
from tests.support.openai_calls import INJECTED, client_body, on_policy, sdk, sdk_kwargs, without_injected
from tests.support.stored import stored_calls


def fixture_ids(fixture: dict[str, Any], endpoint: str = "chat") -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, completion ids, logprobs) per choice, straight from the recording."""
    if fixture["stream"]:
        prompt: list[int] = []
        ids: dict[int, list[int]] = {}
        lps: dict[int, list[float]] = {}
        for raw in fixture["chunks"]:
            if raw == "[DONE]":
                continue
            chunk = json.loads(raw)
            prompt = chunk.get("prompt_token_ids") or prompt
            for choice in chunk["choices"]:
                prompt = choice.get("prompt_token_ids") or prompt
                ids.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
                if choice.get("logprobs"):
                    key = "content" if endpoint == "chat" else "token_logprobs"
                    entries = choice["logprobs"][key]
                    values = [e["logprob"] for e in entries] if endpoint == "chat" else entries
                    lps.setdefault(choice["index"], []).extend(values)
        return [(prompt, ids[i], lps[i]) for i in sorted(ids)]
    response = fixture["response"]
    out = []
    for choice in response["choices"]:
        prompt = response.get("prompt_token_ids") or choice.get("prompt_token_ids")
        if endpoint == "chat":
            logprobs = [e["logprob"] for e in choice["logprobs"]["content"]]
        else:
            logprobs = choice["logprobs"]["token_logprobs"]
        out.append((prompt, choice["token_ids"], logprobs))
    return out


def assert_stored(db_url: str, trajectory_id: str, fixture: dict[str, Any], endpoint: str = "chat") -> None:
    calls = stored_calls(db_url, trajectory_id)
    expected = fixture_ids(fixture, endpoint)
    assert len(calls) == len(expected)
    for call, (prompt, ids, logprobs) in zip(calls, expected):
        assert call["prompt_token_ids"] == prompt
        assert call["completion_token_ids"] == ids
        assert call["completion_logprobs"] == logprobs  # exact: vLLM's float32 values survive storage
        assert call["trainable"] is True
        assert call["run"] == "my-agent"
        assert call["policy_version"] == 0


@pytest.mark.parametrize("name", ["chat", "chat_tools", "conversation_turn2_tool_call"])
def test_chat_non_stream(gateway: RunningGateway, upstream: FakeUpstream, db_url: str, name: str) -> None:
    fixture = upstream.fixture(name)
    raw = sdk(gateway, **{"X-Trajectory-Id": f"t-{name}", "X-Group-Id": "g1"}).chat.completions.with_raw_response
    response = raw.create(**client_body(fixture))
    assert response.http_response.json() == without_injected(fixture["response"])
    # The body reached vLLM unchanged, plus injections and the neutral sampling of train mode.
    assert upstream.received[-1] == on_policy(fixture["request"])
    parsed = response.parse()
    assert parsed.choices[0].message == openai.types.chat.ChatCompletionMessage.model_validate(
        fixture["response"]["choices"][0]["message"]
    )
    headers = response.headers
    assert headers["x-trajectory-id"] == f"t-{name}"
    assert headers["x-group-id"] == "g1"
    assert headers["x-policy-version"] == "0"
    assert headers["x-request-id"].startswith("req-")
    gateway.flush()
    assert_stored(db_url, f"t-{name}", fixture)


def test_client_that_asks_for_logprobs_and_ids_gets_them_untouched(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    fixture = upstream.fixture("chat_top_logprobs")
    body = sdk_kwargs(fixture, keep=INJECTED)
    response = sdk(gateway, **{"X-Trajectory-Id": "t-top"}).chat.completions.with_raw_response.create(**body)
    assert response.http_response.json() == fixture["response"]
    gateway.flush()
    assert_stored(db_url, "t-top", fixture)


def test_client_asking_only_logprobs_gets_no_token_ids(gateway: RunningGateway, upstream: FakeUpstream) -> None:
    fixture = upstream.fixture("chat_top_logprobs")
    body = client_body(fixture, keep=("logprobs",))
    seen = sdk(gateway).chat.completions.with_raw_response.create(**body).http_response.json()
    assert seen["prompt_token_ids"] is None and seen["choices"][0]["token_ids"] is None
    assert seen["choices"][0]["logprobs"] == fixture["response"]["choices"][0]["logprobs"]


def _stream_events(fixture: dict[str, Any]) -> list[Any]:
    return [raw if raw == "[DONE]" else without_injected(json.loads(raw)) for raw in fixture["chunks"]]


@pytest.mark.parametrize("name", ["chat_stream", "chat_tools_stream"])
def test_chat_stream(gateway: RunningGateway, upstream: FakeUpstream, db_url: str, name: str) -> None:
    fixture = upstream.fixture(name)
    client = sdk(gateway, **{"X-Trajectory-Id": f"t-{name}", "X-Group-Id": "gs"})
    with client.chat.completions.with_streaming_response.create(**client_body(fixture)) as response:
        assert response.headers["x-trajectory-id"] == f"t-{name}"
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    seen = [raw if raw == "[DONE]" else json.loads(raw) for raw in events]
    assert seen == _stream_events(fixture)
    gateway.flush()
    assert_stored(db_url, f"t-{name}", fixture)
    stored = stored_calls(db_url, f"t-{name}")[0]
    assembled = stored["response"]["choices"][0]
    if name == "chat_tools_stream":
        expected_call = json.loads(
            json.dumps(upstream.fixture("chat_tools")["response"]["choices"][0]["message"]["tool_calls"][0])
        )
        assert assembled["message"]["tool_calls"][0]["function"] == expected_call["function"]
        assert assembled["finish_reason"] == "tool_calls"
    else:
        assert assembled["message"]["content"] == upstream.fixture("chat")["response"]["choices"][0]["message"][
            "content"
        ]
    assert stored["usage"]["completion_tokens"] == len(stored["completion_token_ids"])
    assert stored["stream"] is True and stored["ttft_ms"] is not None


async def test_async_sdk_stream_and_non_stream(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="sk", max_retries=0)
    plain = await client.chat.completions.create(
        **client_body(upstream.fixture("chat")), extra_headers={"X-Trajectory-Id": "t-async", "X-Group-Id": "ga"}
    )
    assert plain.choices[0].message.content == "The capital of France is Paris."
    stream = await client.chat.completions.create(
        **client_body(upstream.fixture("chat_stream")),
        extra_headers={"X-Trajectory-Id": "t-async", "X-Group-Id": "ga"},
    )
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    assert text == plain.choices[0].message.content
    await client.close()
    gateway.flush()
    calls = stored_calls(db_url, "t-async")
    assert [c["stream"] for c in calls] == [False, True]  # in the order they were made
    assert calls[0]["completion_token_ids"] == calls[1]["completion_token_ids"]


@pytest.mark.parametrize("name", ["completions", "completions_stream"])
def test_completions(gateway: RunningGateway, upstream: FakeUpstream, db_url: str, name: str) -> None:
    fixture = upstream.fixture(name)
    client = sdk(gateway, **{"X-Trajectory-Id": f"t-{name}"})
    if fixture["stream"]:
        text = "".join(chunk.choices[0].text for chunk in client.completions.create(**client_body(fixture)) if chunk.choices)
        assert text == upstream.fixture("completions")["response"]["choices"][0]["text"]
    else:
        seen = client.completions.with_raw_response.create(**client_body(fixture)).http_response.json()
        assert seen == without_injected(fixture["response"])
    gateway.flush()
    assert_stored(db_url, f"t-{name}", fixture, endpoint="completions")


def test_n2_records_one_row_per_choice(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    fixture = upstream.fixture("chat_n2_seeded")
    result = sdk(gateway, **{"X-Trajectory-Id": "t-n2"}).chat.completions.create(**client_body(fixture))
    assert len(result.choices) == 2
    gateway.flush()
    assert_stored(db_url, "t-n2", fixture)
    calls = stored_calls(db_url, "t-n2")
    assert [c["choice_index"] for c in calls] == [0, 1] and calls[0]["seq"] == calls[1]["seq"]


def test_attribution_by_path_prefix(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/g/grp-p/n/2/t/traj-p/v1", api_key="sk", max_retries=0)
    response = client.chat.completions.with_raw_response.create(**client_body(upstream.fixture("chat")))
    assert (response.headers["x-trajectory-id"], response.headers["x-group-id"]) == ("traj-p", "grp-p")
    assert [m.id for m in client.models.list().data][0] == "smollm2"  # other /v1 paths work under the prefix
    gateway.flush()
    assert_stored(db_url, "traj-p", upstream.fixture("chat"))
    assert stored_calls(db_url, "traj-p")[0]["group"] == {"group_id": "grp-p", "expected_size": 2, "mode": "train"}


def test_attribution_by_api_key_suffix(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="sk-real#grp-k/traj-k", max_retries=0)
    response = client.chat.completions.with_raw_response.create(**client_body(upstream.fixture("chat")))
    assert (response.headers["x-trajectory-id"], response.headers["x-group-id"]) == ("traj-k", "grp-k")
    gateway.flush()
    assert_stored(db_url, "traj-k", upstream.fixture("chat"))


def test_eval_mode_and_generated_ids(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/eval/g/ge/t/te/v1", api_key="sk", max_retries=0)
    client.chat.completions.create(**client_body(upstream.fixture("chat")))
    anonymous = sdk(gateway).chat.completions.with_raw_response.create(**client_body(upstream.fixture("chat")))
    fresh = anonymous.headers["x-trajectory-id"]
    assert fresh.startswith("tg-") and anonymous.headers["x-group-id"] == fresh
    gateway.flush()
    assert stored_calls(db_url, "te")[0]["group"]["mode"] == "eval"
    assert stored_calls(db_url, fresh)[0]["group"]["expected_size"] == 1
    # No later call is expected in a generated trajectory: the writer's lineage cache keeps nothing of it.
    assert "te" in gateway.app.state.writer.lineage and fresh not in gateway.app.state.writer.lineage


def test_conversation_turns_are_ordered(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    client = sdk(gateway, **{"X-Trajectory-Id": "t-conv", "X-Group-Id": "gc"})
    names = ["conversation_turn1", "conversation_turn2_tool_call", "conversation_turn2_tool_result", "conversation_turn3"]
    for name in names:
        client.chat.completions.create(**client_body(upstream.fixture(name)))
    gateway.flush()
    calls = stored_calls(db_url, "t-conv")
    assert [c["prompt_token_ids"] for c in calls] == [fixture_ids(upstream.fixture(n))[0][0] for n in names]


def test_run_sampling_overrides_reach_vllm(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    """A run that pins temperature gets it on every call, whatever the agent sends; greedy calls can't train."""
    import httpx

    created = httpx.post(
        gateway.base_url + "/runs", json={"name": "my-agent", "config": {"sampling": {"temperature": 0.0}}}
    )
    assert created.status_code in (200, 201), created.text
    fixture = upstream.fixture("chat")
    body = {**client_body(fixture), "temperature": 0.9}
    response = sdk(gateway, **{"X-Trajectory-Id": "t-pinned"}).chat.completions.with_raw_response.create(**body)
    assert response.http_response.status_code == 200
    assert upstream.received[-1] == on_policy(fixture["request"], temperature=0.0)
    gateway.flush()
    (call,) = stored_calls(db_url, "t-pinned")
    assert call["request"]["temperature"] == 0.9  # what the agent sent is kept
    assert call["trainable"] is False and call["untrainable_reason"].startswith("sampled with temperature=0.0: ")
