"""Rewards and group readiness over HTTP, on Postgres and SQLite: every readiness rule, every error, concurrency
from many tasks and two gateways, and a reward that overtakes its trajectory's last call."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import pytest

from gateway.recorder import writer as gateway_writer
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.openai_calls import assert_openai_error
from tests.support.stored import stored_calls
from tests.support.trajectories import group, make_calls, reward, set_group_state


def test_ready_when_expected_size_reached(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    make_calls(gateway, upstream, ["s-a", "s-b", "s-c"], group="g-size", size=3)
    first = reward(gateway, "s-a", 0.5, metrics={"steps": 3}, metadata={"task": "t1"})
    assert first.status_code == 200, first.text
    assert first.json() == {
        "trajectory_id": "s-a", "group_id": "g-size", "reward": 0.5, "group_state": "open", "group_ready": False
    }
    assert reward(gateway, "s-a", 0.5).json()["group_state"] == "open"  # the same reward again: idempotent
    assert reward(gateway, "s-a", 0.25).status_code == 200  # changing it while the group is open is allowed
    assert reward(gateway, "s-b", 1).json()["group_ready"] is False  # not ready while a reward is missing
    assert group(gateway, "g-size")["state"] == "open"
    last = reward(gateway, "s-c", -1.0)
    assert last.json()["group_ready"] is True and last.json()["group_state"] == "ready"
    view = group(gateway, "g-size")
    assert (view["state"], view["expected_size"], view["size"], view["rewarded"]) == ("ready", 3, 3, 3)
    assert view["ready_at"] is not None
    rewards = {t["trajectory_id"]: (t["reward"], t["metrics"]) for t in view["trajectories"]}
    assert rewards == {"s-a": (0.25, {"steps": 3.0}), "s-b": (1.0, None), "s-c": (-1.0, None)}
    assert reward(gateway, "s-a", 0.75).json()["group_state"] == "ready"  # still changeable until claimed


def test_different_reward_after_claim_is_409(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    for state in ("claimed", "trained", "dropped"):
        make_calls(gateway, upstream, [f"c-{state}"], group=f"g-{state}", size=1)
        assert reward(gateway, f"c-{state}", 1.0).json()["group_ready"] is True
        set_group_state(db_url, f"g-{state}", state)
        same = reward(gateway, f"c-{state}", 1.0)
        assert same.status_code == 200 and same.json()["group_state"] == state
        error = assert_openai_error(reward(gateway, f"c-{state}", 0.0), 409)
        assert error["code"] == "reward_conflict" and state in error["message"]
        assert group(gateway, f"g-{state}")["trajectories"][0]["reward"] == 1.0


def test_close_with_fewer_than_expected(gateway: RunningGateway, upstream: FakeUpstream) -> None:
    make_calls(gateway, upstream, ["f-a", "f-b"], group="g-few", size=4)
    assert reward(gateway, "f-a", 1).json()["group_state"] == "open"
    assert reward(gateway, "f-b", 0).json()["group_state"] == "open"
    closed = httpx.post(f"{gateway.base_url}/groups/g-few/close")
    assert closed.status_code == 200, closed.text
    assert closed.json() == {"group_id": "g-few", "closed": True, "group_state": "ready", "group_ready": True}
    again = httpx.post(f"{gateway.base_url}/groups/g-few/close")  # closing twice is harmless
    assert again.json()["group_state"] == "ready"
    view = group(gateway, "g-few")
    assert (view["state"], view["closed"], view["expected_size"], view["size"]) == ("ready", True, 4, 2)


def test_close_before_rewards(gateway: RunningGateway, upstream: FakeUpstream) -> None:
    make_calls(gateway, upstream, ["b-a", "b-b"], group="g-early")  # no expected size: only a close completes it
    assert reward(gateway, "b-a", 1).json()["group_state"] == "open"
    closed = httpx.post(f"{gateway.base_url}/groups/g-early/close").json()
    assert (closed["group_state"], closed["group_ready"]) == ("open", False)  # b-b has no reward yet
    assert reward(gateway, "b-b", 0).json()["group_ready"] is True


def test_late_trajectory_reopens_a_ready_group(gateway: RunningGateway, upstream: FakeUpstream) -> None:
    make_calls(gateway, upstream, ["l-a"], group="g-late", size=1)
    assert reward(gateway, "l-a", 1).json()["group_ready"] is True
    make_calls(gateway, upstream, ["l-b"], group="g-late")
    gateway.flush()
    view = group(gateway, "g-late")
    assert (view["state"], view["ready_at"], view["size"]) == ("open", None, 2)  # l-b has no reward: not ready
    assert reward(gateway, "l-b", 0).json()["group_ready"] is True


def test_untrainable_trajectory_counts_and_is_flagged(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    make_calls(gateway, upstream, ["u-a"], group="g-untrainable", size=2)
    upstream.mode = "error500"
    try:
        response = httpx.post(
            gateway.base_url + "/chat/completions",
            json={"model": "my-agent", "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-Trajectory-Id": "u-b", "X-Group-Id": "g-untrainable"},
        )
        assert response.status_code == 500
    finally:
        upstream.mode = "replay"
    assert reward(gateway, "u-a", 1).json()["group_state"] == "open"
    assert reward(gateway, "u-b", 0).json()["group_ready"] is True  # counted toward the size of 2
    view = group(gateway, "g-untrainable")
    assert view["untrainable_trajectories"] == 1
    assert {t["trajectory_id"]: t["untrainable_calls"] for t in view["trajectories"]} == {"u-a": 0, "u-b": 1}


INVALID = [
    ('{"reward": NaN}', "finite"),  # what Python's json.dumps sends for float("nan")
    ('{"reward": Infinity}', "finite"),
    ('{"reward": -Infinity}', "finite"),
    ('{"reward": 1e999}', "finite"),
    ('{"reward": "1.0"}', "number"),
    ('{"reward": true}', "number"),
    ('{"reward": null}', "number"),
    ("{}", "reward"),
    ('{"reward": 1, "metrics": {"acc": NaN}}', "metrics.acc"),
    ('{"reward": 1, "metrics": {"acc": "high"}}', "metrics.acc"),
    ('{"reward": 1, "metadata": {"x": [1, Infinity]}}', "metadata"),
    ('{"reward": 1, "rewrd": 2}', "rewrd"),
    ("[1]", "body"),
]


def test_invalid_rewards_are_422(gateway: RunningGateway, upstream: FakeUpstream) -> None:
    make_calls(gateway, upstream, ["bad-a"], group="g-bad", size=1)
    # A refused reward is refused before it waits for the writer, and the group read below does not wait: without
    # this the call may still be queued behind the lowered writer on a busy machine, and the group not found yet.
    gateway.flush()
    for body, needle in INVALID:
        response = httpx.post(f"{gateway.base_url}/trajectories/bad-a/reward", content=body)
        error = assert_openai_error(response, 422)
        assert needle in error["message"] and error["code"] == "invalid_value", (body, error)
    assert group(gateway, "g-bad")["rewarded"] == 0


def test_reward_request_errors(gateway: RunningGateway) -> None:
    url = gateway.base_url
    assert assert_openai_error(reward(gateway, "nobody", 1), 404)["code"] == "trajectory_not_found"
    assert_openai_error(httpx.post(f"{url}/trajectories/bad%20id/reward", json={"reward": 1}), 400)
    assert_openai_error(httpx.post(f"{url}/trajectories/x/reward", content=b"{not json"), 400)
    assert_openai_error(httpx.post(f"{url}/trajectories/x/reward", content=json.dumps({"reward": float("nan")})), 422)
    assert assert_openai_error(httpx.post(f"{url}/groups/nogroup/close"), 404)["code"] == "group_not_found"
    assert_openai_error(httpx.get(f"{url}/trajectories/x/reward"), 405)


def test_batch_is_all_or_nothing(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    make_calls(gateway, upstream, ["r-a", "r-b"], group="g-batch", size=2)
    url = gateway.base_url + "/rewards"

    unknown = httpx.post(url, json=[{"trajectory_id": "r-a", "reward": 1}, {"trajectory_id": "ghost", "reward": 0}])
    assert assert_openai_error(unknown, 404)["code"] == "trajectory_not_found"
    assert unknown.json()["items"] == [
        {"index": 1, "trajectory_id": "ghost", "status": 404, "message": unknown.json()["items"][0]["message"]}
    ]
    assert group(gateway, "g-batch")["rewarded"] == 0  # r-a was not stored either

    invalid = httpx.post(
        url,
        content='[{"trajectory_id": "r-a", "reward": 1}, {"trajectory_id": "r-b", "reward": NaN}, {"reward": 2}]',
    )
    assert_openai_error(invalid, 422)
    assert [(i["index"], i["status"]) for i in invalid.json()["items"]] == [(1, 422), (2, 422)]
    assert "finite" in invalid.json()["items"][0]["message"]
    twice = httpx.post(url, json=[{"trajectory_id": "r-a", "reward": 1}, {"trajectory_id": "r-a", "reward": 0}])
    assert "twice" in assert_openai_error(twice, 422)["message"]
    assert_openai_error(httpx.post(url, json=[]), 422)
    assert_openai_error(httpx.post(url, json={"trajectory_id": "r-a", "reward": 1}), 422)
    assert group(gateway, "g-batch")["rewarded"] == 0

    ok = httpx.post(url, json=[{"trajectory_id": "r-a", "reward": 1}, {"trajectory_id": "r-b", "reward": 0.5}])
    assert ok.status_code == 200, ok.text
    assert [(r["trajectory_id"], r["group_ready"]) for r in ok.json()["data"]] == [("r-a", True), ("r-b", True)]
    assert httpx.post(url, json=[{"trajectory_id": "r-a", "reward": 1}]).status_code == 200  # idempotent

    set_group_state(db_url, "g-batch", "claimed")
    conflict = httpx.post(url, json=[{"trajectory_id": "r-a", "reward": 1}, {"trajectory_id": "r-b", "reward": 0}])
    assert assert_openai_error(conflict, 409)["code"] == "reward_conflict"
    assert [(i["index"], i["status"]) for i in conflict.json()["items"]] == [(1, 409)]


def test_reward_keys(gateway_settings: dict[str, object], upstream: FakeUpstream) -> None:
    with running_gateway(**{**gateway_settings, "agent_keys": "agent-1", "admin_key": "admin-x"}) as gw:
        make_calls(gw, upstream, ["k-a"], group="g-key", size=1, Authorization="Bearer agent-1")
        url = f"{gw.base_url}/trajectories/k-a/reward"
        assert_openai_error(httpx.post(url, json={"reward": 1}), 401)
        assert_openai_error(httpx.post(url, json={"reward": 1}, headers={"Authorization": "Bearer nope"}), 401)
        for key in ("agent-1", "admin-x", "agent-1#g-key/k-a"):  # the api-key attribution form works too
            assert httpx.post(url, json={"reward": 1}, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        close = f"{gw.base_url}/groups/g-key/close"
        assert_openai_error(httpx.post(close), 401)
        assert httpx.post(close, headers={"x-api-key": "agent-1"}).status_code == 200
        # Reading is for the admin key only.
        read = f"{gw.base_url}/groups/g-key"
        assert_openai_error(httpx.get(read, headers={"Authorization": "Bearer agent-1"}), 401)
        assert httpx.get(read, headers={"Authorization": "Bearer admin-x"}).json()["state"] == "ready"


async def _post_all(gateways: list[RunningGateway], rewards: dict[str, float]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as client:
        posts = [
            client.post(f"{gateways[i % len(gateways)].base_url}/trajectories/{tid}/reward", json={"reward": value})
            for i, (tid, value) in enumerate(rewards.items())
        ]
        return list(await asyncio.gather(*posts))


async def test_concurrent_rewards_flip_readiness_exactly_once(
    gateway: RunningGateway, gateway_settings: dict[str, Any], upstream: FakeUpstream, db_url: str
) -> None:
    n = 32
    groups = {f"g-conc-{g}": [f"cc-{g}-{i:02d}" for i in range(n)] for g in range(2)}
    for group_id, ids in groups.items():
        await asyncio.to_thread(make_calls, gateway, upstream, ids, group_id, n)
    gateway.flush()
    rewards = {tid: i / n for ids in groups.values() for i, tid in enumerate(ids)}
    # A second gateway (own engine, pool and writer) on the same database: readiness must hold across processes.
    with running_gateway(**gateway_settings) as other:
        responses = await _post_all([gateway, other], rewards)
        assert [r.status_code for r in responses] == [200] * 2 * n, [r.text for r in responses if r.status_code != 200]
        ready_at = {}
        for group_id, ids in groups.items():
            flips = [r for r in responses if r.json()["group_id"] == group_id and r.json()["group_ready"]]
            assert len(flips) == 1  # exactly one transaction made the group ready
            view = group(gateway, group_id)
            assert (view["state"], view["size"], view["rewarded"]) == ("ready", n, n)
            assert {t["trajectory_id"]: t["reward"] for t in view["trajectories"]} == {t: rewards[t] for t in ids}
            ready_at[group_id] = view["ready_at"]
        again = await _post_all([other, gateway], rewards)  # every client retries: nothing changes
        assert all(r.status_code == 200 and r.json()["group_ready"] for r in again)
        assert {group_id: group(other, group_id)["ready_at"] for group_id in groups} == ready_at


def hold_the_writer(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The writer's database writes wait at this gate until it is set (at most 60 s)."""
    gate = threading.Event()
    real_write = gateway_writer.write_calls

    def held_write(engine: Any, records: Any, *rest: Any) -> None:
        gate.wait(60)
        real_write(engine, records, *rest)

    monkeypatch.setattr(gateway_writer, "write_calls", held_write)
    return gate


def test_reward_overtaking_the_last_call(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer is asynchronous: a reward posted right after the agent's last call must still find that call.

    The writer is held at a gate (not by a timing window, which a busy machine outlasts), so the calls are
    certainly still unwritten when the reward arrives; the gate opens while the reward waits for them."""
    gate = hold_the_writer(monkeypatch)
    make_calls(gateway, upstream, ["o-new"], group="g-overtake-1", size=1)
    assert stored_calls(db_url, "o-new") == []  # the call is not in the database yet...
    threading.Timer(0.5, gate.set).start()
    started = time.monotonic()
    response = reward(gateway, "o-new", 1.0)  # ...but the reward finds it
    assert response.status_code == 200, response.text
    assert response.json()["group_ready"] is True
    assert time.monotonic() - started < 30

    make_calls(gateway, upstream, ["o-two"], group="g-overtake-2", size=1)
    gateway.flush()
    gate.clear()
    make_calls(gateway, upstream, ["o-two"], group="g-overtake-2", size=1)  # its second (last) call
    assert len(stored_calls(db_url, "o-two")) == 1
    threading.Timer(0.5, gate.set).start()
    assert reward(gateway, "o-two", 0.5).json()["group_ready"] is True
    # The group became ready with both calls in it: the trainer would claim a complete trajectory.
    assert [t["calls"] for t in group(gateway, "g-overtake-2")["trajectories"]] == [2]


def test_a_reward_whose_calls_are_not_yet_stored_is_503_and_stores_nothing(
    gateway_settings: dict[str, object], upstream: FakeUpstream, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past TRAJGATE_WRITER_WAIT_S a reward (or close) is refused with a 503 the client retries, and nothing is
    stored. Going ahead would answer 404 for a trajectory the agent was just answered, or, as for `w-two` here,
    make its group ready without its last call: the trainer would train on half a trajectory."""
    gate = hold_the_writer(monkeypatch)
    gate.set()
    with running_gateway(**{**gateway_settings, "writer_wait_s": 0.3}) as gw:
        make_calls(gw, upstream, ["w-two"], group="g-unwritten-2", size=1)
        gw.flush()
        gate.clear()
        make_calls(gw, upstream, ["w-new"], group="g-unwritten-1", size=1)
        make_calls(gw, upstream, ["w-two"], group="g-unwritten-2", size=1)  # its last call, held unwritten
        for trajectory in ("w-new", "w-two"):
            refused = reward(gw, trajectory, 1.0)
            error = assert_openai_error(refused, 503)
            assert error["code"] == "calls_not_written" and "TRAJGATE_WRITER_WAIT_S" in error["message"]
            assert refused.headers["retry-after"] == "1"
        closed = httpx.post(f"{gw.base_url}/groups/g-unwritten-2/close", timeout=30)
        assert assert_openai_error(closed, 503)["code"] == "calls_not_written"
        assert gw.app.state.metrics.writer_wait_timeouts._value.get() == 3  # on /metrics: two rewards, one close
        view = group(gw, "g-unwritten-2")
        assert (view["state"], view["rewarded"]) == ("open", 0)  # nothing was stored
        assert [t["calls"] for t in view["trajectories"]] == [1]
        gate.set()
        gw.flush()  # the retry's own 0.3 s wait must not race a writer a busy machine keeps from the core
        retried = reward(gw, "w-two", 1.0)
        assert retried.status_code == 200 and retried.json()["group_ready"] is True, retried.text
        assert [t["calls"] for t in group(gw, "g-unwritten-2")["trajectories"]] == [2]
        assert reward(gw, "w-new", 0.5).status_code == 200


async def test_rewards_waiting_for_records_leave_reads_answering(
    gateway_settings: dict[str, object], upstream: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round of rewards arrives while the writer is behind (a busy SQLite): each waits for its calls' records,
    and none may hold a database thread meanwhile, or the agent's progress read queues behind all of them (it once
    went unanswered for over 300 s). More rewards wait here than the gateway has database threads."""
    gate = hold_the_writer(monkeypatch)
    with running_gateway(**{**gateway_settings, "db_threads": 2}) as gw:
        trajectories = [f"busy-{i}" for i in range(8)]
        make_calls(gw, upstream, trajectories, group="g-busy", size=len(trajectories))
        async with httpx.AsyncClient(base_url=gw.base_url, timeout=60) as client:
            rewards = [
                asyncio.create_task(client.post(f"/trajectories/{t}/reward", json={"reward": 1.0}))
                for t in trajectories
            ]
            await asyncio.sleep(0.5)  # every reward is in and waiting for the held writer
            try:
                runs = await client.get("/runs")
                assert runs.status_code == 200, runs.text
                assert not any(task.done() for task in rewards)  # the read answered while all of them waited
            finally:
                gate.set()
            answers = await asyncio.gather(*rewards)
    assert [a.status_code for a in answers] == [200] * len(trajectories)
    assert sum(a.json()["group_ready"] for a in answers) == 1
