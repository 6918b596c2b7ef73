"""Never stricter than vLLM: every request of the parity corpus, as a real client sent it, gets from the gateway the
status vLLM's own endpoint gave it, and an answer of the same shape (keys and JSON types, not the generated text).

The corpus (tests/fixtures/parity/, built and recorded by scripts/record_parity.py) holds requests captured from
the real Claude Code and Codex CLIs and from the OpenAI and Anthropic Python SDKs, each with vLLM's own answer to it
and the exchanges the gateway had with vLLM for it, which the fake upstream replays here. A shape is compared where
both answers have it: list items are matched by their `type` (the model may write text in one answer and call a
tool in the other), and a null matches any type (vLLM sends null for what is unset). The prompt's length, which
both answers report, must be the same: the gateway built the prompt vLLM's endpoint built.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from scripts.record_parity import answer
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.stored import stored_calls

CORPUS = Path(__file__).parents[1] / "fixtures" / "parity"
FIXTURES = {path.stem: json.loads(path.read_text()) for path in sorted(CORPUS.glob("*.json"))}

# Keys the gateway's answer may have beyond vLLM's: the Response fields of OpenAI's API that vLLM's Response lacks
# (`error`, `store`: the gateway honours store=false). Every other key must match.
EXTRA_KEYS = frozenset({"error", "store"})


def kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)


def differences(vllm: Any, ours: Any, where: str = "") -> list[str]:
    """Where the gateway's answer is shaped unlike vLLM's: a key missing or extra, or a value of another type."""
    if vllm is None or ours is None:
        return []
    if kind(vllm) != kind(ours):
        return [f"{where or 'body'}: vLLM sends {kind(vllm)}, the gateway {kind(ours)}"]
    if isinstance(vllm, dict):
        out = [f"{where}.{key}: missing" for key in sorted(set(vllm) - set(ours)) if vllm[key] is not None]
        out += [f"{where}.{key}: not in vLLM's answer" for key in sorted(set(ours) - set(vllm) - EXTRA_KEYS)]
        for key in sorted(set(vllm) & set(ours)):
            out += differences(vllm[key], ours[key], f"{where}.{key}")
        return out
    if isinstance(vllm, list):
        theirs, mine = _by_type(vllm), _by_type(ours)
        shared = theirs.keys() & mine.keys()
        return [d for key in sorted(shared) for d in differences(theirs[key], mine[key], f"{where}[{key}]")]
    return []


def _by_type(items: list[Any]) -> dict[str, Any]:
    """The first item of each `type` (or of each JSON type, for items without one)."""
    out: dict[str, Any] = {}
    for item in items:
        key = str(item.get("type")) if isinstance(item, dict) and "type" in item else kind(item)
        out.setdefault(key, item)
    return out


def event_differences(vllm: list[list[Any]], ours: list[list[Any]]) -> list[str]:
    """A stream's shape: the same first and last events, and each kind of event (by name, else by its `type` or
    `object`) shaped alike where both streams have it."""
    if not ours:
        return ["the gateway sent no events"]
    out = []
    for position in (0, -1):
        if _event_kind(vllm[position]) != _event_kind(ours[position]):
            out.append(f"event[{position}]: vLLM {_event_kind(vllm[position])}, gateway {_event_kind(ours[position])}")
    theirs = {_event_kind(event): event[1] for event in reversed(vllm)}
    mine = {_event_kind(event): event[1] for event in reversed(ours)}
    for name in sorted(theirs.keys() & mine.keys()):
        out += differences(theirs[name], mine[name], name)
    return out


def prompt_length(answer: Any) -> int | None:
    """The prompt's length an answer reports (`input_tokens`, or chat's `prompt_tokens`): the last an event stream
    reports, as the final usage is."""
    if isinstance(answer, dict):
        for key in ("input_tokens", "prompt_tokens"):
            if isinstance(answer.get(key), int):
                return int(answer[key])
        answer = list(answer.values())
    if isinstance(answer, list):
        return next((n for n in map(prompt_length, reversed(answer)) if n is not None), None)
    return None


def _event_kind(event: list[Any]) -> str:
    name, data = event
    if name:
        return str(name)
    if isinstance(data, dict):
        return str(data.get("type") or data.get("object") or "data")
    return str(data)


@pytest.fixture(scope="module")
def parity_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningGateway, str]]:
    exchanges = {
        f"{name}#{i}": {"stream": False, "headers": {"content-type": "application/json"}, **exchange}
        for name, fixture in FIXTURES.items()
        for i, exchange in enumerate(fixture["upstream"])
    }
    upstream = FakeUpstream(fixtures=exchanges).start()
    tmp = tmp_path_factory.mktemp("parity")
    db_url = f"sqlite:///{tmp}/trajgate.db"
    try:
        with running_gateway(
            database_url=db_url, upstream_url=upstream.base_url, base_model="smollm2", spool_dir=tmp / "spool"
        ) as gateway:
            yield gateway, db_url
    finally:
        upstream.stop()


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_the_gateway_answers_as_vllm_does(parity_gateway: tuple[RunningGateway, str], name: str) -> None:
    gateway, db_url = parity_gateway
    fixture = FIXTURES[name]
    url = gateway.url + fixture["endpoint"] + (f"?{fixture['query']}" if fixture.get("query") else "")
    trajectory = f"parity-{name.replace('_', '-')}"
    headers = {**fixture["headers"], "content-type": "application/json", "x-trajectory-id": trajectory}
    got = answer(httpx.post(url, json=fixture["request"], headers=headers, timeout=30))
    vllm = fixture["vllm"]
    assert got["status"] == vllm["status"], (fixture["client"], got["response"] or got["events"])
    if vllm["status"] != 200:
        return
    if vllm["events"] is not None:
        assert got["events"] is not None, "vLLM streams this answer; the gateway did not"
        assert event_differences(vllm["events"], got["events"]) == []
    else:
        assert got["response"] is not None and differences(vllm["response"], got["response"]) == []
    theirs = prompt_length(vllm["response"] if vllm["events"] is None else vllm["events"])
    assert theirs is not None and prompt_length(got["response"] or got["events"]) == theirs, "another prompt"
    if fixture["endpoint"] == "/v1/messages/count_tokens":
        return
    gateway.flush()
    [call] = stored_calls(db_url, trajectory)
    assert call["status_code"] == 200 and call["prompt_token_ids"] and call["completion_token_ids"]


def test_what_the_model_could_not_use_is_named_in_the_record(parity_gateway: tuple[RunningGateway, str]) -> None:
    """Claude Code's context_management and Codex's client_metadata and web_search tool are ignored, as vLLM
    ignores them, and the record says so."""
    gateway, db_url = parity_gateway
    gateway.flush()
    [claude] = stored_calls(db_url, "parity-claude-code-first-turn")
    assert "context_management" in claude["stored_request"]["trajgate_messages"]["ignored"]
    assert any(m["role"] == "system" for m in claude["request"]["messages"][1:])  # the reminder, where it was sent
    [codex] = stored_calls(db_url, "parity-codex-exec-first-turn")
    extra = codex["stored_request"]["trajgate_responses"]
    assert "client_metadata" in extra["ignored"] and "web_search" in extra["dropped_tools"]
    assert any(tool["function"]["name"].startswith("multi_agent_v1__") for tool in codex["request"]["tools"])


def test_the_shape_check_can_fail() -> None:
    vllm = {"id": "x", "content": [{"type": "text", "text": "hi"}], "usage": {"input_tokens": 1}}
    assert differences(vllm, {**vllm, "stop_sequence": None}) == [".stop_sequence: not in vLLM's answer"]
    assert differences(vllm, {"id": "x", "content": [{"type": "text", "text": 1}], "usage": {}}) == [
        ".content[text].text: vLLM sends string, the gateway number",
        ".usage.input_tokens: missing",
    ]
    assert differences(vllm, {**vllm, "content": [{"type": "tool_use", "id": "t"}]}) == []  # another block: unmatched
    assert prompt_length(vllm) == 1 and prompt_length([["e", {"usage": {"prompt_tokens": 2}}], ["f", {}]]) == 2
