"""token_in on the templates people train: what clients echo back, end tokens known up front, bridges on real
templates, qualification, and a trajectory that hops between gateways.

The bridge cases replay tests/fixtures/token_in_qualification.json: the render ids of every continuation the
qualification suite (scripts/qualify_token_in.py) planned with the real Qwen3, Llama 3, DeepSeek V3, Gemma 3 and
SmolLM2 tokenizers and templates, so they run without transformers.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.proxy import chat_templates, token_in
from gateway.store.lineage import EXTENDS
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import running_gateway
from tests.support.stored import stored_calls
from tests.support.token_in_agent import RUN, client_for, start_token_in, tool_loop

QUALIFICATION = json.loads((Path(__file__).parents[2] / "fixtures" / "token_in_qualification.json").read_text())
REGISTRY = json.loads(chat_templates.REGISTRY.read_text())
BY_NAME = {entry["name"]: chat_templates.template_info(entry) for entry in REGISTRY["templates"].values()}

# What the gateway answered (derender's message) and what clients sent back in its place.
ANSWERED = {
    "role": "assistant",
    "content": None,
    "reasoning": "I should look up Paris.",
    "tool_calls": [
        {
            "id": "chatcmpl-tool-1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
        }
    ],
}
CALL = ANSWERED["tool_calls"][0]
ECHOES = {
    # litellm's hosted_vllm/ tool loop: provider fields, a dict of nulls, nulls everywhere, the call's index
    "litellm": {
        "content": None,
        "role": "assistant",
        "tool_calls": [{**CALL, "index": 0}],
        "function_call": None,
        "provider_specific_fields": {"reasoning": None},
        "reasoning_content": "I should look up Paris.",
    },
    "key order": {"tool_calls": [CALL], "reasoning": "I should look up Paris.", "role": "assistant"},
    "argument whitespace and key order": {
        "role": "assistant",
        "tool_calls": [{**CALL, "function": {**CALL["function"], "arguments": '{"unit":"celsius",  "city":"Paris"} '}}],
    },
    "reasoning_content (older clients)": {**ANSWERED, "reasoning": None, "reasoning_content": ANSWERED["reasoning"]},
    "reasoning not sent back (LangChain ChatOpenAI)": {k: v for k, v in ANSWERED.items() if k != "reasoning"},
    "openai SDK, other fields": {"role": "assistant", "tool_calls": [CALL], "refusal": None, "annotations": []},
}


@pytest.mark.parametrize("client", list(ECHOES))
def test_an_echoed_answer_matches_the_recorded_turn(client: str) -> None:
    history = [{"role": "user", "content": "Weather in Paris?"}]
    key = token_in.history_keys(history)[-1]
    assert token_in.extend_key(key, ECHOES[client]) == token_in.extend_key(key, ANSWERED)


def test_what_reaches_the_template_still_counts() -> None:
    history_key = token_in.history_keys([{"role": "user", "content": "Weather in Paris?"}])[-1]
    recorded = token_in.extend_key(history_key, ANSWERED)
    lyon = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Lyon", "unit": "celsius"}'}}
    other_id = {**CALL, "id": "call-2"}
    changes = ({**ANSWERED, "tool_calls": [lyon]}, {**ANSWERED, "tool_calls": [other_id]}, {**ANSWERED, "content": "x"})
    for changed in changes:
        assert token_in.extend_key(history_key, changed) != recorded
    tool = {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "18 C"}
    assert token_in.extend_key("", tool) != token_in.extend_key("", {**tool, "tool_call_id": "other"})
    assert token_in.extend_key("", tool) == token_in.extend_key("", {**tool, "name": None, "extra": {"x": None}})


def test_end_tokens_come_from_the_model_files() -> None:
    vocab = {"<|end_of_text|>": 128001, "<|eom_id|>": 128008, "<|eot_id|>": 128009, "<|im_end|>": 151645}
    llama = chat_templates.end_token_ids({"eos_token_id": [128001, 128008, 128009]}, {"eos_token": "<|eot_id|>"}, vocab)
    assert llama == [128001, 128008, 128009]
    qwen = chat_templates.end_token_ids({"eos_token_id": [151645, 151643]}, {"eos_token": "<|im_end|>"}, vocab)
    assert qwen == [151645, 151643]
    added = {"eos_token": {"__type": "AddedToken", "content": "<|eot_id|>"}}
    assert chat_templates.end_token_ids({"eos_token_id": 128001}, added, vocab) == [128001, 128009]
    assert BY_NAME["llama3"].end_token_ids == {128001, 128008, 128009}
    assert BY_NAME["qwen3"].end_token_ids == {151645, 151643}
    with pytest.raises(ValueError, match="no end_token_ids"):
        chat_templates.template_info({"name": "x", "end_token_ids": []})


def qualification_cases() -> list[dict[str, Any]]:
    """The planned continuations of the templates the suite qualified (the registry's)."""
    return [case for case in QUALIFICATION["exchanges"] if case["template"] in BY_NAME]


def test_only_templates_that_continue_exactly_are_qualified() -> None:
    assert set(BY_NAME) == {"smollm2", "qwen3", "llama3", "deepseek_v3", "gemma3", "gpt-oss"}
    assert {case["template"] for case in qualification_cases()} == set(BY_NAME)
    refused = [case for case in QUALIFICATION["exchanges"] if case["template"] not in BY_NAME]
    assert {case["template"] for case in refused} == {"deepseek_v3 (as vLLM 0.32 loads it)"}


@pytest.mark.parametrize(
    "case", qualification_cases(), ids=lambda c: f"{c['template']}/{c['scenario']}/call{c['call']}".replace(" ", "_")
)
def test_bridge_on_real_templates(case: dict[str, Any]) -> None:
    info = BY_NAME[case["template"]]
    ends, turn_ends = info.end_token_ids, info.turn_end_ids
    bridge = token_in.bridge_ids(case["prefix"], case["full"], case["completion"], ends, turn_ends)
    assert bridge.ids is not None, f"template_unstable@{bridge.position}"
    assert bridge.ids == case["bridge"]
    ended = case["completion"][-1] in info.end_token_ids
    # past the closing token (the template's, added to a cut completion), the bridge is the full render's tail
    tail = bridge.ids if ended else bridge.ids[1:]
    assert case["full"][len(case["full"]) - len(tail) :] == tail
    if not ended:
        assert bridge.ids[0] in info.turn_end_ids


def test_every_end_token_of_a_model_closes_its_turn() -> None:
    """Llama 3 stops on <|eom_id|>, <|eot_id|> or <|end_of_text|>: each completion keeps its own; a cut one gets the
    template's <|eot_id|>. Qwen3 the same with <|im_end|> and <|endoftext|>."""
    seen: dict[str, set[int | None]] = {"llama3": set(), "qwen3": set()}
    for case in qualification_cases():
        if case["template"] not in seen:
            continue
        info = BY_NAME[case["template"]]
        last = case["completion"][-1]
        ended = last in info.end_token_ids
        seen[case["template"]].add(last if ended else None)
        if not ended:
            assert case["bridge"][0] in info.turn_end_ids
        else:
            assert case["bridge"][0] not in info.end_token_ids  # no second end token after the model's own
    assert seen["llama3"] == {128001, 128008, 128009, None}
    assert seen["qwen3"] == {151645, 151643, None}


def test_harmony_answers_end_on_return_and_histories_close_with_end() -> None:
    """gpt-oss stops an answer on <|return|> and a tool call on <|call|>; its history closes an answer with <|end|>,
    which the bridge leaves out after the model's own <|return|>."""
    cases = [c for c in qualification_cases() if c["template"] == "gpt-oss"]
    ended = {c["completion"][-1] for c in cases if c["completion"][-1] in BY_NAME["gpt-oss"].end_token_ids}
    assert ended == {200002, 200012}
    returned = [c for c in cases if c["completion"][-1] == 200002]
    assert returned and all(c["bridge"][0] != 200007 for c in returned)
    assert any(200007 in c["full"] for c in returned)  # the template's <|end|> the bridge did not add


def test_qwen3_changes_the_assistant_message_and_the_bridge_still_continues() -> None:
    """The history's render of Qwen3's assistant message is not a prefix of the next call's (the <think> block
    comes and goes): the bridge is found all the same."""
    unstable = [
        c for c in qualification_cases() if c["template"] == "qwen3" and c["full"][: len(c["prefix"])] != c["prefix"]
    ]
    assert len(unstable) >= 4
    assert {c["scenario"] for c in unstable} >= {"tools, enable_thinking=false", "tools+thinking"}


def test_the_docs_show_the_suites_table() -> None:
    agents_doc = (Path(__file__).parents[3] / "docs" / "agents.md").read_text()
    assert "\n".join(REGISTRY["table"]) in agents_doc


# -- through the gateway -----------------------------------------------------------------------------------------


class Alternating:
    """An OpenAI client whose calls go to two gateways in turn."""

    def __init__(self, *clients: openai.OpenAI) -> None:
        self.clients = clients
        self.calls = 0
        self.chat = self
        self.completions = self

    def create(self, **kwargs: Any) -> Any:
        client = self.clients[self.calls % len(self.clients)]
        self.calls += 1
        return client.chat.completions.create(**kwargs)


# Postgres only: gateways wait for each other's writers there (docs/operations.md, Several gateways); SQLite serves
# one gateway.
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_a_trajectory_alternating_between_two_gateways_extends_as_on_one(
    gateway_settings: dict[str, object], db_url: str, stream: bool
) -> None:
    trajectory = f"hop-{uuid.uuid4().hex[:8]}"
    settings = {**gateway_settings, "token_state_wait_s": 2.0}
    with running_gateway(**settings) as first, running_gateway(**settings) as second:
        start_token_in(first)
        httpx.post(second.url + "/v1/runs", json={"name": RUN, "config": {}}, timeout=30)  # its router refreshes
        client = Alternating(client_for(first, trajectory), client_for(second, trajectory))
        tool_loop(client, stream)  # type: ignore[arg-type]
        first.flush()
        second.flush()
    calls = stored_calls(db_url, trajectory)
    assert [c["segment_reason"] for c in calls] == ["first_call", None, None]
    assert [c["merge_reason"] for c in calls[1:]] == [EXTENDS, EXTENDS]
    for before, after in zip(calls, calls[1:]):
        whole = before["prompt_token_ids"] + before["completion_token_ids"]
        assert after["prompt_token_ids"][: len(whole)] == whole


def test_a_template_not_qualified_is_refused_unless_the_operator_vouches(
    gateway_settings: dict[str, object], db_url: str, tmp_path: Path
) -> None:
    other = FakeUpstream().start()
    other.probe_token_ids = [1, 2, 3]  # a template the registry does not know
    trajectory = f"unq-{uuid.uuid4().hex[:8]}"
    settings = {**gateway_settings, "upstream_url": other.base_url, "token_state_wait_s": 0.3}
    try:
        with running_gateway(**settings) as gw:
            start_token_in(gw)
            with pytest.raises(openai.BadRequestError) as refused:
                tool_loop(client_for(gw, trajectory), False, turns=1)
            gw.flush()
        vouched = tmp_path / "templates.json"
        entry = {"name": "mine", "end_token_ids": [2]}
        vouched.write_text(json.dumps({"templates": {chat_templates.fingerprint([[1, 2, 3], [1, 2, 3]]): entry}}))
        with running_gateway(**{**settings, "token_in_templates": str(vouched)}) as gw:
            start_token_in(gw)
            turns = tool_loop(client_for(gw, f"{trajectory}-ok"), False)
            gw.flush()
    finally:
        other.stop()
    assert refused.value.status_code == 400
    assert "not qualified" in refused.value.message
    assert chat_templates.fingerprint([[1, 2, 3], [1, 2, 3]]) in refused.value.message
    [call] = stored_calls(db_url, trajectory)
    assert call["status_code"] == 400 and not call["trainable"] and "not qualified" in call["error"]
    assert len(turns) == 3
    assert [c["segment_reason"] for c in stored_calls(db_url, f"{trajectory}-ok")] == ["first_call", None, None]
