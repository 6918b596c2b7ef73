"""One upstream failure reads alike on every API (gateway/upstream/failures.py): chat, token_in, Messages and
Responses give the same status for a vLLM that times out or cannot be reached, each in its own API's error shape."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.upstream.client import ConnectFailed, UpstreamError
from gateway.upstream.failures import exchange_error, not_json, stream_error
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import running_gateway
from tests.support.pgcluster import free_port

HI = [{"role": "user", "content": "hi"}]


def test_a_timeout_and_a_broken_exchange_map_alike_for_every_path() -> None:
    """chat names no step (it has one); token_in names the scale-out step that failed."""
    chat, step = exchange_error(TimeoutError()), exchange_error(TimeoutError(), "/inference/v1/generate")
    assert (chat.status, chat.type, chat.code, chat.message) == (504, "upstream_error", "timeout", "vLLM timed out")
    assert (step.status, step.code, step.message) == (504, "timeout", "vLLM timed out on /inference/v1/generate")
    down = exchange_error(ConnectFailed("cannot connect to h:1: refused"))
    assert (down.status, down.type, down.code) == (502, "upstream_error", "upstream_error")
    assert down.message == "vLLM unreachable: ConnectFailed: cannot connect to h:1: refused"
    broke = exchange_error(UpstreamError("vLLM closed the connection"), "/v1/chat/completions/render")
    assert broke.status == 502 and broke.message.startswith("vLLM unreachable on /v1/chat/completions/render: ")


def test_what_vllm_sends_that_cannot_be_used_is_a_502() -> None:
    told = [not_json("/v1/chat/completions/derender"), stream_error({"message": "EngineCore died"}), stream_error("x")]
    assert [(error.status, error.type) for error in told] == [(502, "upstream_error")] * 3
    assert told[0].message == "vLLM sent a body that is not a JSON object on /v1/chat/completions/derender"
    assert told[1].message == "vLLM generate stream failed: EngineCore died"
    assert told[2].message == "vLLM generate stream failed: x"


@pytest.mark.parametrize(
    ("failure", "status", "code", "told"),
    [("hang", 504, "timeout", "vLLM timed out"), ("down", 502, "upstream_error", "vLLM unreachable")],
)
def test_every_api_tells_the_same_upstream_failure_with_the_same_status(
    gateway_settings: dict[str, Any], upstream: FakeUpstream, failure: str, status: int, code: str, told: str
) -> None:
    settings = {**gateway_settings, "upstream_timeout_s": 0.5}
    if failure == "down":
        settings["upstream_url"] = f"http://127.0.0.1:{free_port()}/v1"
    with running_gateway(**settings) as gw:

        def post(trajectory: str, path: str, body: dict[str, Any]) -> httpx.Response:
            return httpx.post(f"{gw.url}/eval/t/{trajectory}/v1{path}", json=body, timeout=10)

        upstream.mode = failure if failure == "hang" else "replay"
        try:
            chat = post("chat", "/chat/completions", {"model": "r", "messages": HI})
            streamed = post("stream", "/chat/completions", {"model": "r", "messages": HI, "stream": True})
            responses = post("responses", "/responses", {"model": "r", "input": "hi"})
            messages = post("messages", "/messages", {"model": "r", "max_tokens": 8, "messages": HI})
            run = httpx.post(gw.url + "/v1/runs", json={"name": "tok", "config": {"token_mode": "token_in"}})
            assert run.status_code in (200, 201), run.text
            token_in = post("token-in", "/chat/completions", {"model": "tok", "messages": HI})
        finally:
            upstream.mode = "replay"
    for answer in (chat, streamed, responses, token_in):  # OpenAI's shape (Responses errors are OpenAI's too)
        error = answer.json()["error"]
        assert answer.status_code == status and error["type"] == "upstream_error" and error["code"] == code, answer.text
        assert error["message"].startswith(told)
    assert " on /v1/chat/completions/render" in token_in.json()["error"]["message"]  # token_in names the step
    assert messages.status_code == status, messages.text
    anthropic = messages.json()
    assert anthropic["type"] == "error" and anthropic["error"]["type"] == "api_error"
    assert anthropic["error"]["message"] == chat.json()["error"]["message"]
    assert anthropic["request_id"].startswith("req-")
