"""Malformed Messages and Responses bodies: wrong types at every level, huge and deeply nested values, NULs, lone
surrogates, numbers JSON cannot hold. Each must get a 4xx in the API's own error shape (Anthropic's for /v1/messages,
OpenAI's for /v1/responses), never a 5xx, from the gateway in front of a fake upstream. A body the gateway passes on
gets the fake upstream's 418 (it has no answer recorded for it), which must come back in the API's shape too.

Sent to vLLM 0.32's own endpoints, every one of these is a 4xx there too but `m-deep-schema`, which vLLM answers:
the gateway refuses a body nested past the 254 levels its JSON writer (orjson) can write. Where vLLM's pydantic
models refuse a Responses field the gateway never reads (`include: 5`, `stream: "sometimes"`, a tool of type 5...),
the gateway passes the body on, which is never stricter than vLLM; so too a `tool_use` input that is not an object
(`m-tool-use-input-list`), which the gateway takes so a client can send back the input it answered.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import RunningGateway, running_gateway

MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
GOOD_MESSAGES: dict[str, Any] = {"model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
GOOD_RESPONSES: dict[str, Any] = {"model": "smollm2", "input": "Hi", "max_output_tokens": 8}
DEEP = 300  # levels: past orjson's writing limit (254), within its reading limit (1024)


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = {"a": [value]}
    return value


def _messages(**changes: Any) -> bytes:
    return json.dumps({**GOOD_MESSAGES, **changes}).encode()


def _responses(**changes: Any) -> bytes:
    return json.dumps({**GOOD_RESPONSES, **changes}).encode()


def _user(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


HUGE_INT = b"1180591620717411303424"  # 2**70: orjson reads it as a float; as an int it is past 64 bits
CASES: list[tuple[str, str, bytes]] = [
    # -- /v1/messages --------------------------------------------------------------------------------------------
    ("m-null-body", MESSAGES, b"null"),
    ("m-list-body", MESSAGES, b"[1, 2]"),
    ("m-string-body", MESSAGES, b'"hi"'),
    ("m-not-json", MESSAGES, b"{\"model\": "),
    ("m-nan", MESSAGES, _messages(max_tokens=8)[:-1] + b', "temperature": NaN}'),
    ("m-infinity", MESSAGES, _messages()[:-1] + b', "temperature": 1e400}'),
    ("m-lone-surrogate", MESSAGES, _messages(messages=_user("PLACEHOLDER")).replace(b"PLACEHOLDER", b"\\ud800")),
    ("m-model-int", MESSAGES, _messages(model=5)),
    ("m-model-empty", MESSAGES, _messages(model="")),
    ("m-model-nul", MESSAGES, _messages(model="smol\u0000lm2")),
    ("m-model-huge", MESSAGES, _messages(model="m" * 100_000)),
    ("m-messages-object", MESSAGES, _messages(messages={"role": "user"})),
    ("m-messages-null-item", MESSAGES, _messages(messages=[None])),
    ("m-message-no-content", MESSAGES, _messages(messages=[{"role": "user"}])),
    ("m-content-int", MESSAGES, _messages(messages=_user(5))),
    ("m-content-nested-list", MESSAGES, _messages(messages=_user([[{"type": "text", "text": "x"}]]))),
    ("m-block-type-int", MESSAGES, _messages(messages=_user([{"type": 5}]))),
    ("m-block-text-int", MESSAGES, _messages(messages=_user([{"type": "text", "text": 5}]))),
    ("m-tool-use-input-list", MESSAGES, _messages(messages=_user([{"type": "tool_use", "input": [1]}]))),
    ("m-tool-result-items-ints", MESSAGES, _messages(messages=_user([{"type": "tool_result", "content": [1, 2]}]))),
    ("m-max-tokens-negative", MESSAGES, _messages(max_tokens=-1)),
    ("m-max-tokens-word", MESSAGES, _messages(max_tokens="lots")),
    ("m-max-tokens-past-64-bits", MESSAGES, _messages()[:-1] + b', "max_tokens": ' + HUGE_INT + b"}"),
    ("m-system-object", MESSAGES, _messages(system={"text": "x"})),
    ("m-system-ints", MESSAGES, _messages(system=[5])),
    ("m-tools-object", MESSAGES, _messages(tools={"name": "x"})),
    ("m-tool-name-int", MESSAGES, _messages(tools=[{"name": 5, "input_schema": {}}])),
    ("m-tool-schema-list", MESSAGES, _messages(tools=[{"name": "x", "input_schema": []}])),
    ("m-tool-choice-string", MESSAGES, _messages(tool_choice="auto")),
    ("m-tool-choice-bogus", MESSAGES, _messages(tool_choice={"type": "bogus"})),
    ("m-thinking-budget-word", MESSAGES, _messages(thinking={"type": "enabled", "budget_tokens": "lots"})),
    ("m-stop-sequences-string", MESSAGES, _messages(stop_sequences="\n")),
    ("m-stop-sequences-ints", MESSAGES, _messages(stop_sequences=[1, 2])),
    ("m-nul-and-unicode-text", MESSAGES, _messages(messages=_user("\u0000\U0001f600\u202e\ufeff" * 1000))),
    ("m-deep-schema", MESSAGES, _messages(tools=[{"name": "x", "input_schema": nested(DEEP)}])),
    ("m-count-tokens-null", MESSAGES + "/count_tokens", b"null"),
    ("m-count-tokens-no-messages", MESSAGES + "/count_tokens", json.dumps({"model": "smollm2"}).encode()),
    # -- /v1/responses -------------------------------------------------------------------------------------------
    ("r-null-body", RESPONSES, b"null"),
    ("r-list-body", RESPONSES, b"[1]"),
    ("r-not-json", RESPONSES, b"{\"input\": "),
    ("r-nan", RESPONSES, _responses()[:-1] + b', "temperature": NaN}'),
    ("r-lone-surrogate", RESPONSES, _responses(input="PLACEHOLDER").replace(b"PLACEHOLDER", b"\\udc00")),
    ("r-model-int", RESPONSES, _responses(model=5)),
    ("r-input-int", RESPONSES, _responses(input=5)),
    ("r-input-object", RESPONSES, _responses(input={"role": "user", "content": "hi"})),
    ("r-input-null-item", RESPONSES, _responses(input=[None])),
    ("r-item-type-int", RESPONSES, _responses(input=[{"type": 5}])),
    ("r-item-role-int", RESPONSES, _responses(input=[{"role": 5, "content": "hi"}])),
    ("r-content-int", RESPONSES, _responses(input=_user(5))),
    ("r-content-part-int", RESPONSES, _responses(input=_user([5]))),
    ("r-content-part-no-text", RESPONSES, _responses(input=_user([{"type": "input_text"}]))),
    ("r-image-without-url", RESPONSES, _responses(input=_user([{"type": "input_image"}]))),
    ("r-assistant-content-ints", RESPONSES, _responses(input=[{"role": "assistant", "content": [1]}])),
    ("r-call-arguments-object", RESPONSES, _responses(
        input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}])),
    ("r-call-output-int", RESPONSES, _responses(input=[{"type": "function_call_output", "call_id": "c", "output": 5}])),
    ("r-custom-call-input-int", RESPONSES, _responses(
        input=[{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": 5}])),
    ("r-only-an-unfinished-reasoning", RESPONSES, _responses(input=[{"type": "reasoning", "status": "incomplete"}])),
    ("r-reasoning-content-int", RESPONSES, _responses(input=[{"type": "reasoning", "content": 5}, *_user("hi")])),
    ("r-tools-object", RESPONSES, _responses(tools={"type": "function"})),
    ("r-tool-int", RESPONSES, _responses(tools=[5])),
    ("r-function-no-name", RESPONSES, _responses(tools=[{"type": "function", "parameters": {}}])),
    ("r-function-parameters-list", RESPONSES, _responses(tools=[{"type": "function", "name": "f", "parameters": []}])),
    ("r-namespace-tools-int", RESPONSES, _responses(tools=[{"type": "namespace", "name": "n", "tools": 5}])),
    ("r-custom-no-name", RESPONSES, _responses(tools=[{"type": "custom"}])),
    ("r-custom-name-int", RESPONSES, _responses(tools=[{"type": "custom", "name": 5}])),
    ("r-tool-choice-int", RESPONSES, _responses(tool_choice=5)),
    ("r-tool-choice-function-no-name", RESPONSES, _responses(tool_choice={"type": "function"})),
    ("r-max-output-tokens-word", RESPONSES, _responses(max_output_tokens="lots")),
    ("r-max-output-tokens-negative", RESPONSES, _responses(max_output_tokens=-1)),
    ("r-max-output-tokens-past-64-bits", RESPONSES, _responses()[:-1] + b', "max_output_tokens": ' + HUGE_INT + b"}"),
    ("r-temperature-word", RESPONSES, _responses(temperature="hot")),
    ("r-text-int", RESPONSES, _responses(text=5)),
    ("r-text-format-schema-int", RESPONSES, _responses(text={"format": {"type": "json_schema", "schema": 5}})),
    ("r-include-int", RESPONSES, _responses(include=5)),
    ("r-top-logprobs-word", RESPONSES, _responses(top_logprobs="many")),
    ("r-previous-id-int", RESPONSES, _responses(previous_response_id=5)),
    ("r-previous-id-unknown", RESPONSES, _responses(previous_response_id="resp_" + "0" * 32)),
    ("r-previous-id-nul", RESPONSES, _responses(previous_response_id="resp_\u0000")),
    ("r-metadata-int", RESPONSES, _responses(metadata=5)),
    ("r-instructions-list", RESPONSES, _responses(instructions=["be brief"])),
    ("r-stream-word", RESPONSES, _responses(stream="sometimes")),
    ("r-deep-parameters", RESPONSES, _responses(tools=[{"type": "function", "name": "f", "parameters": nested(DEEP)}])),
    ("r-deep-metadata", RESPONSES, _responses(metadata=nested(DEEP))),
    ("r-nul-and-unicode-text", RESPONSES, _responses(input="\u0000\U0001f600\u202e\ufeff" * 1000, max_output_tokens=0)),
]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    upstream = FakeUpstream(fixtures={}).start()
    tmp: Path = tmp_path_factory.mktemp("hostile")
    try:
        with running_gateway(
            database_url=f"sqlite:///{tmp}/trajgate.db", upstream_url=upstream.base_url, base_model="smollm2",
            spool_dir=tmp / "spool", token_state_wait_s=0.1,  # an unknown previous response: not waited for long
        ) as running:  # fmt: skip
            yield running
    finally:
        upstream.stop()


def error_shape(path: str, body: Any) -> bool:
    """Anthropic's `{"type": "error", "error": {"type", "message"}}` or OpenAI's `{"error": {"message", "type",
    "code"...}}`, as the path's API writes it."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return False
    error = body["error"]
    if path.startswith(MESSAGES):
        return body.get("type") == "error" and all(isinstance(error.get(key), str) for key in ("type", "message"))
    return isinstance(error.get("message"), str) and isinstance(error.get("type"), str) and "code" in error


@pytest.mark.parametrize(("path", "body"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_a_malformed_body_is_a_4xx_in_the_apis_shape(gateway: RunningGateway, path: str, body: bytes) -> None:
    response = httpx.post(gateway.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert error_shape(path, response.json()), response.text[:300]


def test_the_shape_check_can_fail() -> None:
    assert not error_shape(MESSAGES, {"error": {"message": "x", "type": "invalid_request_error", "code": 400}})
    assert not error_shape(RESPONSES, {"type": "error", "error": {"type": "invalid_request_error", "message": "x"}})
    assert not error_shape(RESPONSES, {"detail": "x"})
