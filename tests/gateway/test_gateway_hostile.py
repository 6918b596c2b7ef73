"""Hostile input (issue 11): every answered call is stored, and bad input is a 4xx before anything is forwarded,
never a 500 and never a 200 whose record the database then refuses."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.fake_upstream import FakeUpstream, load_fixtures
from tests.support.gateway_harness import RunningGateway
from tests.support.openai_calls import assert_openai_error, client_body
from tests.support.stored import count_calls, stored_calls


def _nested(depth: int) -> object:
    value: object = "leaf"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("headers", "body_extra", "code"),
    [
        ({"Idempotency-Key": "k" * 257}, {}, "invalid_header"),
        ({"x-stainless-retry-count": "1099511627776"}, {}, "invalid_header"),
        ({"x-stainless-retry-count": "-1"}, {}, "invalid_header"),
        ({"x-stainless-retry-count": "9" * 5000}, {}, "invalid_header"),
        ({}, {"metadata": _nested(300)}, "invalid_json"),
    ],
    ids=["long-idempotency-key", "huge-retry-count", "negative-retry-count", "5000-digit-retry-count", "nested-300"],
)
def test_bad_headers_and_deep_bodies_are_refused_before_forwarding(
    gateway: RunningGateway,
    upstream: FakeUpstream,
    db_url: str,
    headers: dict[str, str],
    body_extra: dict[str, object],
    code: str,
) -> None:
    before = len(upstream.received)
    body = {**client_body(upstream.fixture("chat")), **body_extra}
    response = httpx.post(gateway.base_url + "/chat/completions", content=json.dumps(body), headers=headers)
    assert assert_openai_error(response, 400)["code"] == code
    assert len(upstream.received) == before
    gateway.flush()
    assert count_calls(db_url) == 0


def test_the_longest_allowed_headers_are_stored(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    headers = {"Idempotency-Key": "k" * 256, "x-stainless-retry-count": str(2**31 - 1), "X-Trajectory-Id": "t-edge"}
    body = client_body(upstream.fixture("chat"))
    response = httpx.post(gateway.base_url + "/chat/completions", json=body, headers=headers)
    assert response.status_code == 200
    gateway.flush()
    (call,) = stored_calls(db_url, "t-edge")
    assert call["idempotency_key"] == "k" * 256 and call["retry_count"] == 2**31 - 1


def test_a_nul_in_the_request_is_answered_and_stored(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    body = client_body(upstream.fixture("chat"))
    body["messages"] = [{"role": "user", "content": "a\u0000b"}]
    response = httpx.post(gateway.base_url + "/chat/completions", json=body, headers={"X-Trajectory-Id": "t-nul"})
    assert response.status_code < 500  # the fake has no recording for this body (418): still an answered call
    gateway.flush()
    (call,) = stored_calls(db_url, "t-nul")
    # Postgres can hold neither a NUL in JSONB nor in text: it is stored as U+FFFD, on both backends alike.
    assert call["request"]["messages"][0]["content"] == "a\ufffdb"
    assert "\u0000" not in (call["error"] or "")


@pytest.mark.parametrize("flag", ["true", 1, "yes"])
def test_stream_is_read_the_way_vllm_reads_it(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str, flag: object
) -> None:
    """vLLM's pydantic model coerces "true", 1, "yes" to True and streams: the gateway must relay and record one."""
    body = {**client_body(upstream.fixture("chat_stream")), "stream": flag}
    trajectory = f"t-stream-{flag}"
    with httpx.stream(
        "POST", gateway.base_url + "/chat/completions", json=body, headers={"X-Trajectory-Id": trajectory}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    gateway.flush()
    (call,) = stored_calls(db_url, trajectory)
    assert call["stream"] and call["error"] is None and call["trainable"]


def _post_raw(gw: RunningGateway, path: str, raw: str) -> httpx.Response:
    return httpx.post(gw.url + path, content=raw.encode(), headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize(
    "config",
    ['{"sampling": {"seed": 18446744073709551616}}', '{"sampling": {"max_tokens": 9223372036854775808}}',
     '{"groups_per_step": 100000000000000000000}', '{"lora_rank": %s}' % ("9" * 5000)],
    ids=["seed", "max_tokens", "groups_per_step", "5000-digits"],
)
def test_integers_the_store_cannot_hold_are_422(gateway: RunningGateway, config: str) -> None:
    response = _post_raw(gateway, "/v1/runs", f'{{"name": "big-ints", "config": {config}}}')
    assert "out of range" in assert_openai_error(response, 422)["message"]


def test_reward_metadata_the_store_cannot_hold_is_refused_or_stored(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    response = httpx.post(
        gateway.base_url + "/chat/completions",
        json=client_body(upstream.fixture("chat")),
        headers={"X-Trajectory-Id": "t-meta"},
    )
    assert response.status_code == 200
    gateway.flush()
    path = "/v1/trajectories/t-meta/reward"
    deep = json.dumps({"reward": 1.0, "metadata": {"x": _nested(300)}})
    assert assert_openai_error(_post_raw(gateway, path, deep), 400)["code"] == "invalid_json"
    surrogate = '{"reward": 1.0, "metadata": {"x": "\\ud800"}}'
    assert assert_openai_error(_post_raw(gateway, path, surrogate), 400)["code"] == "invalid_json"
    response = _post_raw(gateway, path, '{"reward": 1.0, "metadata": {"x": "a\\u0000b"}}')
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("suffix", ["", "/steps", "/export", "/events"])
def test_a_run_name_that_cannot_exist_is_a_4xx(gateway: RunningGateway, suffix: str) -> None:
    response = httpx.get(gateway.url + "/v1/runs/bad%00name" + suffix, timeout=10)
    assert assert_openai_error(response, 400)["code"] == "invalid_run_name"


@pytest.mark.parametrize("after", ["1e30", "99999999999999999999", "x", "9" * 5000])
@pytest.mark.parametrize("route", ["steps", "events"])
def test_a_bad_after_is_a_400(gateway: RunningGateway, route: str, after: str) -> None:
    assert _post_raw(gateway, "/v1/runs", '{"name": "after-run"}').status_code in (200, 201)
    response = httpx.get(gateway.url + f"/v1/runs/after-run/{route}?after={after}", timeout=10)
    assert assert_openai_error(response, 400)["code"] == "invalid_value"


def _long_prompt_stream(prompt_tokens: int) -> dict[str, object]:
    """The recorded stream with a prompt of `prompt_tokens` ids: vLLM sends them all in the first SSE line."""
    fixture = load_fixtures()["chat_stream"]
    first = json.loads(fixture["chunks"][0])
    first["prompt_token_ids"] = [(i * 7919) % 49152 for i in range(prompt_tokens)]
    fixture["chunks"][0] = json.dumps(first, separators=(",", ":"))
    return fixture


def test_a_stream_with_a_100k_token_prompt_is_relayed_and_recorded(
    gateway_settings: dict[str, object], db_url: str
) -> None:
    """The first line is ~700 KB: past aiohttp's line-reader limit (128 KiB on 3.10, ~75k ids on 3.14)."""
    from openai import OpenAI

    from tests.support.gateway_harness import running_gateway
    from tests.support.openai_calls import sdk_kwargs

    fixture = _long_prompt_stream(100_000)
    upstream = FakeUpstream({"long": fixture}).start()
    try:
        with running_gateway(**{**gateway_settings, "upstream_url": upstream.base_url}) as gw:
            client = OpenAI(base_url=gw.base_url, api_key="k", max_retries=0)
            stream = client.chat.completions.create(
                **sdk_kwargs(fixture), extra_headers={"X-Trajectory-Id": "t-long"}
            )
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
            gw.flush()
    finally:
        upstream.stop()
    chunks = [json.loads(chunk) for chunk in fixture["chunks"] if chunk != "[DONE]"]
    assert text == "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text
    (call,) = stored_calls(db_url, "t-long")
    assert call["error"] is None and call["trainable"]
    assert call["prompt_token_ids"] == json.loads(fixture["chunks"][0])["prompt_token_ids"]
