"""The read API over what the gateway recorded, on Postgres and SQLite: a trajectory's calls in order with messages,
completions and token counts (exact ids on request), and groups."""

from __future__ import annotations

import httpx

from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import RunningGateway
from tests.support.openai_calls import assert_openai_error
from tests.support.stored import stored_calls
from tests.support.trajectories import make_calls, reward

CONVERSATION = ["conversation_turn1", "conversation_turn2_tool_call", "conversation_turn2_tool_result"]


def test_trajectory_view(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    for name in CONVERSATION:
        make_calls(gateway, upstream, ["conv"], group="g-read", size=1, fixture=name)
    assert reward(gateway, "conv", 0.5, metrics={"turns": 3}, metadata={"task": {"id": 7}}).status_code == 200

    view = httpx.get(gateway.base_url + "/trajectories/conv").json()
    assert {k: view[k] for k in ("trajectory_id", "run", "group_id", "mode", "reward", "metrics", "metadata")} == {
        "trajectory_id": "conv",
        "run": "my-agent",
        "group_id": "g-read",
        "mode": "train",
        "reward": 0.5,
        "metrics": {"turns": 3.0},
        "metadata": {"task": {"id": 7}},
    }
    assert view["untrainable_calls"] == 0 and view["rewarded_at"] is not None
    stored = stored_calls(db_url, "conv")
    assert [c["turn"] for c in view["calls"]] == [0, 1, 2]
    assert [c["seq"] for c in view["calls"]] == [c["seq"] for c in stored]
    for call, row, name in zip(view["calls"], stored, CONVERSATION):
        fixture = upstream.fixture(name)
        message = fixture["response"]["choices"][0]["message"]
        assert call["messages"] == fixture["request"]["messages"]
        assert call["completion"] == message["content"]
        assert call["tool_calls"] == (message.get("tool_calls") or None)
        assert call["prompt_tokens"] == len(row["prompt_token_ids"])
        assert call["completion_tokens"] == len(row["completion_token_ids"])
        assert (call["finish_reason"], call["trainable"], call["status_code"]) == (row["finish_reason"], True, 200)
        assert call["endpoint"] == "chat" and call["latency_ms"] > 0 and "prompt_token_ids" not in call
    assert view["calls"][1]["tool_calls"][0]["function"]["name"]  # the turn that called a tool

    full = httpx.get(gateway.base_url + "/trajectories/conv?include_tokens=true").json()
    for call, row in zip(full["calls"], stored):
        assert call["prompt_token_ids"] == row["prompt_token_ids"]
        assert call["completion_token_ids"] == row["completion_token_ids"]
        assert call["completion_logprobs"] == row["completion_logprobs"]


def test_completions_and_group_views(gateway: RunningGateway, upstream: FakeUpstream) -> None:
    completions = upstream.fixture("completions")
    make_calls(gateway, upstream, ["tc"], group="g-view", size=2)
    response = httpx.post(
        gateway.base_url + "/completions",
        json={**{k: v for k, v in completions["request"].items() if k not in ("logprobs", "return_token_ids")},
              "model": "my-agent"},
        headers={"X-Trajectory-Id": "tp", "X-Group-Id": "g-view"},
    )
    assert response.status_code == 200, response.text
    gateway.flush()
    (call,) = httpx.get(gateway.base_url + "/trajectories/tp").json()["calls"]
    assert call["endpoint"] == "completions"
    assert call["messages"] == completions["request"]["prompt"]
    assert call["completion"] == completions["response"]["choices"][0]["text"] and call["tool_calls"] is None

    reward(gateway, "tc", 1)
    group = httpx.get(gateway.base_url + "/groups/g-view").json()
    assert {k: group[k] for k in ("group_id", "run", "mode", "state", "expected_size", "closed", "size")} == {
        "group_id": "g-view", "run": "my-agent", "mode": "train", "state": "open", "expected_size": 2,
        "closed": False, "size": 2,
    }
    assert (group["rewarded"], group["claimed_by"], group["trained_step"], group["ready_at"]) == (1, None, None, None)
    assert [(t["trajectory_id"], t["reward"], t["calls"]) for t in group["trajectories"]] == [
        ("tc", 1.0, 1), ("tp", None, 1)
    ]

    missing = assert_openai_error(httpx.get(gateway.base_url + "/trajectories/nope"), 404)
    assert missing["code"] == "trajectory_not_found"
    assert assert_openai_error(httpx.get(gateway.base_url + "/groups/nope"), 404)["code"] == "group_not_found"
    assert_openai_error(httpx.get(gateway.base_url + "/groups/bad%20id"), 400)
