"""The policy vLLM samples is the policy the trainer trains: what the gateway sends upstream in train and eval mode,
and which calls it records untrainable because they were sampled from another distribution (docs/design.md §4)."""

from __future__ import annotations

import copy
from typing import Any

import httpx
import openai
import pytest

from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import RunningGateway
from tests.support.openai_calls import assert_openai_error, client_body, on_policy, sdk, without_injected
from tests.support.stored import stored_calls
from trainer.samples import CallData, GroupData, TrajectoryData, build_samples


def configure(gw: RunningGateway, config: dict[str, Any]) -> None:
    response = httpx.post(gw.base_url + "/runs", json={"name": "my-agent", "config": config}, timeout=30)
    assert response.status_code in (200, 201), response.text


def test_train_call_at_temperature_07_is_sampled_at_1_and_trainable(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    fixture = upstream.fixture("chat")
    body = {**client_body(fixture), "temperature": 0.7, "top_p": 0.9}
    response = sdk(gateway, **{"X-Trajectory-Id": "t-warm"}).chat.completions.with_raw_response.create(**body)
    assert upstream.received[-1] == on_policy(fixture["request"])
    assert response.http_response.json() == without_injected(fixture["response"])  # the client sees vLLM's answer
    gateway.flush()
    (call,) = stored_calls(db_url, "t-warm")
    assert (call["trainable"], call["untrainable_reason"]) == (True, None)
    assert (call["request"]["temperature"], call["request"]["top_p"]) == (0.7, 0.9)  # what the agent sent is kept


@pytest.mark.parametrize("name", ["chat_stream", "completions", "completions_stream", "chat_n2_seeded"])
def test_streams_completions_and_n2_are_sampled_neutral(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str, name: str
) -> None:
    fixture = upstream.fixture(name)
    body = {**client_body(fixture), "temperature": 0.7, "presence_penalty": 0.5, "extra_body": {"top_k": 20}}
    client = sdk(gateway, **{"X-Trajectory-Id": f"t-{name}"})
    if fixture["path"] == "/v1/completions":
        answer = client.completions.create(**body)
        text = "".join(c.choices[0].text for c in answer if c.choices) if fixture["stream"] else answer.choices[0].text
        assert text == upstream.fixture("completions")["response"]["choices"][0]["text"]
    elif fixture["stream"]:
        chunks = client.chat.completions.create(**body)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        assert len(client.chat.completions.create(**body).choices) == 2
    assert upstream.received[-1] == on_policy(fixture["request"])
    gateway.flush()
    calls = stored_calls(db_url, f"t-{name}")
    assert len(calls) == fixture["request"].get("n", 1)
    assert all(c["trainable"] and c["untrainable_reason"] is None for c in calls)


def test_run_pinned_to_temperature_07_records_untrainable_calls(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    configure(gateway, {"sampling": {"temperature": 0.7, "max_tokens": 24}})
    fixture = upstream.fixture("chat")
    body = {**client_body(fixture), "temperature": 0.2}
    response = sdk(gateway, **{"X-Trajectory-Id": "t-pinned"}).chat.completions.with_raw_response.create(**body)
    assert upstream.received[-1] == on_policy(fixture["request"], temperature=0.7)  # the run's override wins
    assert response.http_response.json() == without_injected(fixture["response"])  # answered normally
    gateway.flush()
    (call,) = stored_calls(db_url, "t-pinned")
    assert call["trainable"] is False
    assert call["untrainable_reason"].startswith("sampled with temperature=0.7: ")
    assert call["completion_token_ids"] and call["completion_logprobs"]  # nothing is lost


def test_on_policy_sampling_off_keeps_the_clients_values_and_flags_them(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    configure(gateway, {"on_policy_sampling": False})
    fixture = upstream.fixture("chat")
    client = sdk(gateway, **{"X-Trajectory-Id": "t-off"})
    # The recording is greedy (temperature 0): sent as is, which is off-policy too.
    client.chat.completions.create(**{**client_body(fixture), "top_p": 0.9})
    assert upstream.received[-1] == on_policy(fixture["request"], temperature=0, top_p=0.9)
    unset = {k: v for k, v in client_body(fixture).items() if k != "temperature"}
    client.chat.completions.create(**unset)
    # Left out, a parameter is sent neutral: vLLM would otherwise apply the model's generation_config defaults.
    assert upstream.received[-1] == on_policy({k: v for k, v in fixture["request"].items() if k != "temperature"})
    gateway.flush()
    first, second = stored_calls(db_url, "t-off")
    assert first["trainable"] is False
    assert first["untrainable_reason"].startswith("sampled with temperature=0, top_p=0.9: ")
    assert (second["trainable"], second["untrainable_reason"]) == (True, None)


def test_eval_calls_keep_the_clients_sampling(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    fixture = upstream.fixture("chat")
    client = openai.OpenAI(base_url=gateway.url + "/eval/g/ge/t/te/v1", api_key="sk", max_retries=0)
    client.chat.completions.create(**{**client_body(fixture), "temperature": 0.7})
    assert upstream.received[-1] == {**fixture["request"], "temperature": 0.7}  # untouched, as deployed
    gateway.flush()
    (call,) = stored_calls(db_url, "te")
    assert call["group"]["mode"] == "eval" and call["trainable"] is True


def test_on_policy_sampling_is_validated(gateway: RunningGateway) -> None:
    for bad in ("yes", 1, None):
        response = httpx.post(
            gateway.base_url + "/runs", json={"name": "r", "config": {"on_policy_sampling": bad}}, timeout=30
        )
        assert assert_openai_error(response, 422)["message"].startswith("config.on_policy_sampling")
    created = httpx.post(gateway.base_url + "/runs", json={"name": "r", "config": {}}, timeout=30)
    assert created.json()["config"]["on_policy_sampling"] is True


def _call(seq: int, trainable: bool, reason: str | None = None) -> CallData:
    return CallData(
        seq=seq,
        choice_index=0,
        policy_version=0,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        completion_logprobs=[-0.5, -0.25],
        trainable=trainable,
        untrainable_reason=reason,
    )


def test_step_stats_count_calls_refused_for_sampling() -> None:
    """A run pinned off-policy trains nothing, and the step's stats say why instead of a silent no-op."""
    reason = "sampled with temperature=0.7: ..."
    pinned = GroupData(
        "g-pinned",
        [TrajectoryData("a", 1.0, [_call(0, False, reason)]), TrajectoryData("b", 0.0, [_call(0, False, reason)])],
    )
    mixed = GroupData(
        "g-mixed",
        [
            TrajectoryData("c", 1.0, [_call(0, True), _call(1, False, "missing logprobs")]),
            TrajectoryData("d", 0.0, [_call(0, True)]),
        ],
    )
    batch = build_samples(copy.deepcopy([pinned, mixed]))
    assert batch.dropped_groups == [("g-pinned", "no trainable tokens")]
    assert batch.stats["untrainable_calls"] == 3
    assert batch.stats["untrainable_reasons"] == {reason: 2, "missing logprobs": 1}
    assert batch.trainable_tokens == 4
