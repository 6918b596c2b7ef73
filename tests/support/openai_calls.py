"""What a test's client sends and checks on OpenAI-shaped calls through the gateway: the body an agent sends for a
recording, the SDK client, and the OpenAI error shape. Shared by the tests of every part and by the benches, so it lives
here rather than in one test module."""

from __future__ import annotations

import copy
from typing import Any

import httpx
import openai

from gateway.proxy.sampling import NEUTRAL
from tests.support.gateway_harness import RunningGateway

INJECTED = ("logprobs", "return_token_ids")


def client_body(fixture: dict[str, Any], keep: tuple[str, ...] = ()) -> dict[str, Any]:
    """What an agent sends to get this recording: the request minus what the gateway injects, under a run name."""
    body = {k: v for k, v in fixture["request"].items() if k not in INJECTED or k in keep}
    body["model"] = "my-agent"
    return body


def on_policy(request: dict[str, Any], **pinned: Any) -> dict[str, Any]:
    """The body a train-mode call reaches vLLM with: the recorded one, every sampling parameter neutral."""
    return {**request, **NEUTRAL, **pinned}


def sdk_kwargs(fixture: dict[str, Any], keep: tuple[str, ...] = ()) -> dict[str, Any]:
    """client_body as OpenAI SDK keyword arguments: vLLM-only fields travel in extra_body."""
    body = client_body(fixture, keep)
    extra = {k: body.pop(k) for k in ("return_token_ids",) if k in body}
    return {**body, "extra_body": extra} if extra else body


def without_injected(response: dict[str, Any]) -> dict[str, Any]:
    """vLLM's response had the client not asked: it sends these fields as null (seen on vLLM 0.32.0)."""
    expected = copy.deepcopy(response)
    if "prompt_token_ids" in expected:
        expected["prompt_token_ids"] = None
    for choice in expected.get("choices") or ():
        for key in ("logprobs", "token_ids", "prompt_token_ids"):
            if key in choice:
                choice[key] = None
    return expected


def sdk(gw: RunningGateway, **headers: str) -> openai.OpenAI:
    """No SDK retries: a test sees each answer as the gateway gave it."""
    return openai.OpenAI(base_url=gw.base_url, api_key="sk-test", default_headers=headers, max_retries=0)


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error shape every refusal must have, with no traceback in it; the error, for further checks."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "code"}
    assert "Traceback" not in response.text
    return body["error"]
