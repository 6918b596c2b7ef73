"""The upstream contract the gateway's capture relies on, checked against a real vLLM.

If a vLLM upgrade stops returning token ids or changes the logprob shapes, these fail before the
gateway silently records untrainable calls.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def _post(base_url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{base_url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        result: dict[str, Any] = json.load(response)
        return result


def _is_token_id_list(value: object) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def test_chat_returns_token_ids_and_one_logprob_per_token(
    vllm_base_url: str, vllm_model_name: str
) -> None:
    body = {
        "model": vllm_model_name,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16,
        "temperature": 0,
        "logprobs": True,
        "return_token_ids": True,
    }
    result = _post(vllm_base_url, "/chat/completions", body)

    assert _is_token_id_list(result["prompt_token_ids"])
    choice = result["choices"][0]
    assert _is_token_id_list(choice["token_ids"])
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"])
    assert all(isinstance(entry["logprob"], float) and entry["logprob"] <= 0 for entry in content)


def test_tiny_model_completion_returns_token_ids_and_logprobs(vllm_tiny_base_url: str) -> None:
    body = {
        "model": "tiny",
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 0,
        "return_token_ids": True,
    }
    result = _post(vllm_tiny_base_url, "/completions", body)

    choice = result["choices"][0]
    assert _is_token_id_list(choice["prompt_token_ids"])
    assert _is_token_id_list(choice["token_ids"])
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
