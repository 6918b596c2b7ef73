"""Hostile input (issue 11): every answered call is stored, and bad input is a 4xx before anything is forwarded,
never a 500 and never a 200 whose record the database then refuses."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.fake_upstream import FakeUpstream
from tests.gateway_harness import RunningGateway
from tests.stored import count_calls, stored_calls
from tests.test_gateway_capture import client_body
from tests.test_gateway_faults import assert_openai_error


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
        ({}, {"metadata": _nested(300)}, "invalid_json"),
    ],
    ids=["long-idempotency-key", "huge-retry-count", "negative-retry-count", "nested-300"],
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
    response = httpx.post(gateway.base_url + "/chat/completions", json=client_body(upstream.fixture("chat")), headers=headers)
    assert response.status_code == 200
    gateway.flush()
    (call,) = stored_calls(db_url, "t-edge")
    assert call["idempotency_key"] == "k" * 256 and call["retry_count"] == 2**31 - 1


def test_a_nul_in_the_request_is_answered_and_stored(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
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
    """vLLM's pydantic model coerces "true", 1, "yes" to True and streams; the gateway must relay and record a stream."""
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
