"""Runs over HTTP on Postgres and SQLite: config create/merge/validate, routing and sampling overrides picked up by
the gateway, progress counts, steps, and the live progress stream."""

from __future__ import annotations

import json
import re
import signal
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.proxy.capture import prepare_upstream
from gateway.runs.config import RunConfig
from gateway.store.db import make_engine
from gateway.store.models import CHAT, COMPLETIONS, PolicyVersion
from gateway.store.runs import record_train_step
from gateway.store.training import acquire_run_lease
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import RunningGateway, running_gateway, start_serve
from tests.support.openai_calls import assert_openai_error, client_body
from tests.support.trajectories import make_calls, reward, set_group_state
from tests.support.waiting import wait_until


def post_run(gw: RunningGateway, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(gw.base_url + "/runs", json=body, headers=headers, timeout=30)


def test_run_config_create_merge_and_validate(gateway: RunningGateway) -> None:
    created = post_run(gateway, {"name": "cfg", "config": {"learning_rate": 1e-4, "sampling": {"temperature": 1.0}}})
    assert created.status_code == 201, created.text
    config = created.json()["config"]
    assert (config["learning_rate"], config["loss"], config["lora_rank"]) == (1e-4, "cispo", 16)  # defaults filled
    assert config["sampling"]["temperature"] == 1.0 and config["sampling"]["top_p"] is None
    assert created.json()["base_model"] == "smollm2"  # the gateway's base model when none is given

    updated = post_run(gateway, {"name": "cfg", "base_weights": "/models/smollm2", "config": {"loss": "gspo"}})
    assert updated.status_code == 200, updated.text
    run = updated.json()
    assert (run["config"]["loss"], run["config"]["learning_rate"]) == ("gspo", 1e-4)
    assert run["base_weights"] == "/models/smollm2"

    bad = [
        ({"name": "cfg", "config": {"learning_rte": 1e-4}}, "config.learning_rte"),
        ({"name": "cfg", "config": {"learning_rate": 0.5}}, "config.learning_rate"),
        ({"name": "cfg", "config": {"learning_rate": "fast"}}, "config.learning_rate"),
        ({"name": "cfg", "config": {"lora_rank": 12}}, "config.lora_rank"),
        ({"name": "cfg", "config": {"loss": "ppo"}}, "config.loss"),
        ({"name": "cfg", "config": {"sampling": {"temprature": 1}}}, "config.sampling.temprature"),
        ({"name": "cfg", "config": {"sampling": {"top_p": 1.5}}}, "config.sampling.top_p"),
        ({"name": "cfg", "config": {"on_policy_sampling": "no"}}, "config.on_policy_sampling"),
        ({"name": "bad name!", "config": {}}, "name"),
        ({"name": "..", "config": {}}, "name"),
        ({"name": "org/../cfg", "config": {}}, "name"),
        ({"name": "org//cfg", "config": {}}, "name"),
        ({"config": {}}, "name"),
        ({"name": "cfg", "cofig": {}}, "cofig"),
    ]
    for body, where in bad:
        error = assert_openai_error(post_run(gateway, body), 422)
        assert error["message"].startswith(where), (body, error)
    assert httpx.get(gateway.base_url + "/runs/cfg").json()["config"]["loss"] == "gspo"  # nothing changed


def test_run_routes_and_sampling_reach_the_gateway(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    router = gateway.app.state.router
    post_run(gateway, {"name": "org/agent", "config": {"sampling": {"temperature": 0.7, "max_tokens": 64}}})
    route = router.resolve("org/agent", "smollm2")  # updated in-process at once, no refresh wait
    assert (route.version, route.served_name, route.sampling) == (0, "smollm2", {"temperature": 0.7, "max_tokens": 64})
    assert "org/agent" in [m["id"] for m in httpx.get(gateway.base_url + "/models").json()["data"]]

    # The trainer publishes a policy version: the background refresh routes the run's calls to the adapter.
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                PolicyVersion.__table__.insert().values(
                    run="org/agent", step=3, served_name="org/agent@3", adapter_path="/ckpt/3", status="loaded",
                    created_at=datetime.now(UTC),
                )
            )
    finally:
        engine.dispose()
    wait_until(lambda: router.resolve("org/agent", "smollm2").version == 3, 10, "the refresh to pick up version 3")
    assert router.resolve("org/agent", "smollm2").served_name == "org/agent@3"
    body = {**client_body(upstream.fixture("chat")), "model": "org/agent"}
    response = httpx.post(gateway.base_url + "/chat/completions", json=body)
    assert response.headers["x-policy-version"] == "3"
    assert upstream.received[-1]["model"] == "org/agent@3"
    view = httpx.get(gateway.base_url + "/runs/org/agent").json()
    assert (view["policy_version"], view["served_name"]) == (3, "org/agent@3")


def test_sampling_overrides_win_over_the_client() -> None:
    client = {"model": "run", "messages": [], "temperature": 0.0, "max_completion_tokens": 500, "top_p": 0.5}
    upstream, _ = prepare_upstream(client, CHAT, "base", overrides={"temperature": 1.0, "max_tokens": 32})
    assert (upstream["temperature"], upstream["max_tokens"], upstream["max_completion_tokens"]) == (1.0, 32, 32)
    assert upstream["top_p"] == 0.5 and upstream["model"] == "base" and upstream["logprobs"] is True
    assert client["temperature"] == 0.0  # the client's body (what is recorded) is left alone
    plain, _ = prepare_upstream({"model": "run", "prompt": "x", "seed": 1}, COMPLETIONS, "base", overrides={})
    assert plain == {"model": "base", "prompt": "x", "seed": 1, "logprobs": 0, "return_token_ids": True}
    sampling = RunConfig.model_validate({"sampling": {"seed": 7, "top_k": 20}}).sampling
    assert sampling.applied() == {"seed": 7, "top_k": 20}


def test_run_progress_and_steps(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    make_calls(gateway, upstream, ["p-a", "p-b"], group="g-prog", size=2)
    make_calls(gateway, upstream, ["p-eval"], group="g-eval", size=1, **{"X-Mode": "eval"})
    reward(gateway, "p-a", 1)
    reward(gateway, "p-eval", 0.25)
    engine = make_engine(db_url)
    try:
        record_train_step(engine, "my-agent", 1, {"loss": 0.5, "reward_mean": 0.1})
        record_train_step(engine, "my-agent", 2, {"loss": float("nan"), "reward_mean": 0.2})  # a NaN loss is kept
    finally:
        engine.dispose()

    run = httpx.get(gateway.base_url + "/runs/my-agent").json()
    assert run["groups"] == {"open": 1} and run["eval_groups"] == {"ready": 1}
    assert run["trajectories"]["train"] == {"total": 2, "rewarded": 1, "untrainable": 0}
    assert run["last_step"]["step"] == 2 and run["last_step"]["metrics"] == {"loss": None, "reward_mean": 0.2}
    assert run["eval_reward_by_version"] == [{"policy_version": 0, "mean_reward": 0.25, "trajectories": 1}]
    assert run["config"] == RunConfig().model_dump(mode="json")  # created by its first call: defaults
    # One call per trajectory here: nothing to extend (tests/gateway/store/test_lineage.py covers the reasons).
    assert run["merge"] == {"calls": 3, "by_reason": {"first_call": 3}, "merge_ratio": None}

    listed = httpx.get(gateway.base_url + "/runs").json()["data"]
    assert [r["name"] for r in listed] == ["my-agent"]
    steps = httpx.get(gateway.base_url + "/runs/my-agent/steps").json()["data"]
    assert [s["step"] for s in steps] == [1, 2] and steps[0]["metrics"]["loss"] == 0.5
    assert [s["step"] for s in httpx.get(gateway.base_url + "/runs/my-agent/steps?after=1").json()["data"]] == [2]
    for path in ("/runs/nope", "/runs/nope/steps", "/runs/nope/events"):
        assert assert_openai_error(httpx.get(gateway.base_url + path), 404)["code"] == "run_not_found"
    assert_openai_error(httpx.get(gateway.base_url + "/runs/my-agent/steps?after=x"), 400)


def _metric_values(text: str, name: str) -> dict[str, float]:
    """{label set as written: value} of one /metrics family."""
    return {labels: float(value) for labels, value in re.findall(rf"^{name}{{(.*?)}} (\S+)$", text, re.M)}


def test_runs_show_step_reward_trend_groups_and_trainer(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    """Every run in `GET /v1/runs` (and `GET /v1/runs/{run}`) says where its training stands, and /metrics has the
    same per run: a run with no steps, one with more steps than the trend shows (one step without a reward), a lease
    held and one expired."""
    assert post_run(gateway, {"name": "quiet", "config": {}}).status_code == 201
    assert post_run(gateway, {"name": "stale", "config": {}}).status_code == 201
    make_calls(gateway, upstream, ["r-a", "r-b"], group="g-ready", size=2)
    make_calls(gateway, upstream, ["r-c", "r-d"], group="g-claimed", size=2)
    make_calls(gateway, upstream, ["r-e"], group="g-open", size=2)
    for trajectory in ("r-a", "r-b", "r-c", "r-d"):
        assert reward(gateway, trajectory, 1).status_code == 200
    set_group_state(db_url, "g-claimed", "claimed")
    engine = make_engine(db_url)
    try:
        for step in range(1, 11):  # reward_mean step/16, but steps 8 and 9 logged none a number (NaN is stored null)
            mean: object = {8: "high", 9: float("nan")}.get(step, step / 16)
            record_train_step(engine, "my-agent", step, {"loss": 0.1, "reward_mean": mean})
        acquire_run_lease(engine, "my-agent", "trainer-host-1", 600)
        acquire_run_lease(engine, "stale", "trainer-gone", -5)  # its holder stopped renewing it 5 s ago
    finally:
        engine.dispose()

    listed = {run["name"]: run for run in httpx.get(gateway.base_url + "/runs", timeout=30).json()["data"]}
    assert sorted(listed) == ["my-agent", "quiet", "stale"]
    quiet = listed["quiet"]
    assert (quiet["step"], quiet["last_step_at"], quiet["reward_trend"], quiet["trainer"], quiet["groups"]) == (
        None, None, [], None, {}
    )
    busy = listed["my-agent"]
    assert busy["step"] == 10 and datetime.fromisoformat(busy["last_step_at"]) <= datetime.now(UTC)
    assert busy["reward_trend"] == [
        {"step": step, "reward_mean": None if step in (8, 9) else step / 16} for step in range(3, 11)
    ]  # the newest 8, oldest first
    assert busy["groups"] == {"open": 1, "ready": 1, "claimed": 1} and busy["eval_groups"] == {}
    trainer = busy["trainer"]
    assert (trainer["holder"], trainer["expired"]) == ("trainer-host-1", False)
    assert datetime.fromisoformat(trainer["lease_until"]) > datetime.now(UTC)
    stale = listed["stale"]["trainer"]
    assert (stale["holder"], stale["expired"]) == ("trainer-gone", True)
    fields = ("step", "last_step_at", "reward_trend", "groups", "eval_groups", "trainer")
    for name, run in listed.items():  # the run's own route has the same fields
        one = httpx.get(f"{gateway.base_url}/runs/{name}", timeout=30).json()
        assert {key: one[key] for key in fields} == {key: run[key] for key in fields}, name

    metrics = httpx.get(gateway.url + "/metrics", timeout=30).text
    assert _metric_values(metrics, "trajgate_run_groups") == {
        f'run="{run}",state="{state}"': float(run == "my-agent")
        for run in ("my-agent", "quiet", "stale")
        for state in ("open", "ready", "claimed")
    }
    assert _metric_values(metrics, "trajgate_run_step") == {'run="my-agent"': 10, 'run="quiet"': 0, 'run="stale"': 0}
    assert _metric_values(metrics, "trajgate_run_trainer_held") == {
        'run="my-agent"': 1, 'run="quiet"': 0, 'run="stale"': 0
    }
    since = _metric_values(metrics, "trajgate_run_seconds_since_step")
    assert list(since) == ['run="my-agent"'] and 0 <= since['run="my-agent"'] < 60


def _read_events(url: str, headers: dict[str, str], want: int, out: list[str], ready: threading.Event) -> None:
    with httpx.stream("GET", url, headers=headers, timeout=30) as response:
        out.append(response.headers["content-type"])
        ready.set()
        for line in response.iter_lines():
            if line.strip():
                out.append(line)
            if sum(1 for item in out if "step" in item) == want:
                return


@pytest.fixture
def stepping(db_url: str) -> Iterator[Any]:
    engine = make_engine(db_url)
    yield lambda run, step: record_train_step(engine, run, step, {"loss": 1.0 / step})
    engine.dispose()


@pytest.mark.parametrize("ndjson", [False, True])
def test_event_stream_follows_training_steps(
    gateway: RunningGateway, upstream: FakeUpstream, stepping: Any, ndjson: bool
) -> None:
    post_run(gateway, {"name": "live", "config": {}})
    stepping("live", 1)  # history: sent first
    lines: list[str] = []
    ready = threading.Event()
    headers = {"Accept": "application/x-ndjson"} if ndjson else {}
    reader = threading.Thread(
        target=_read_events, args=(gateway.base_url + "/runs/live/events", headers, 3, lines, ready), daemon=True
    )
    reader.start()
    assert ready.wait(10)
    wait_until(lambda: any('"step"' in line for line in lines), 10, "the history to reach the client")
    stepping("live", 2)  # live: recorded while the client reads
    stepping("live", 3)
    reader.join(10)
    assert not reader.is_alive(), lines
    content_type, *events = lines
    if ndjson:
        assert content_type.startswith("application/x-ndjson")
        steps = [json.loads(line) for line in events]
    else:
        assert content_type.startswith("text/event-stream")
        assert [line for line in events if line.startswith("id:")] == ["id: 1", "id: 2", "id: 3"]
        steps = [json.loads(line[len("data: "):]) for line in events if line.startswith("data: ")]
    assert [(s["step"], s["metrics"]["loss"]) for s in steps] == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    # A reconnecting EventSource resumes after the last step it saw.
    resumed: list[str] = []
    _read_events(gateway.base_url + "/runs/live/events?format=ndjson", {"Last-Event-ID": "2"}, 1, resumed, ready)
    assert json.loads(resumed[1])["step"] == 3


def test_runs_need_the_admin_key(gateway_settings: dict[str, object]) -> None:
    with running_gateway(**{**gateway_settings, "agent_keys": "agent-1", "admin_key": "admin-x"}) as gw:
        body = {"name": "keyed", "config": {}}
        assert_openai_error(post_run(gw, body), 401)
        assert_openai_error(post_run(gw, body, Authorization="Bearer agent-1"), 401)
        assert post_run(gw, body, Authorization="Bearer admin-x").status_code == 201
        for path in ("/runs", "/runs/keyed", "/runs/keyed/steps", "/runs/keyed/events"):
            assert_openai_error(httpx.get(gw.base_url + path, headers={"x-api-key": "agent-1"}), 401)
        listed = httpx.get(gw.base_url + "/runs", headers={"x-api-key": "admin-x"})
        assert [r["name"] for r in listed.json()["data"]] == ["keyed"]


def test_sigterm_ends_open_event_streams(sqlite_url: str, upstream: FakeUpstream, tmp_path: Path) -> None:
    """A live stream never finishes by itself; `trajgate serve` must end it on SIGTERM, not wait out the graceful
    timeout (after which an orchestrator's SIGKILL would cost the writer's queued records)."""
    # A graceful timeout far above the wait below: a stream left open would hold the shutdown for all of it.
    process, _, port = start_serve(upstream.base_url, sqlite_url, tmp_path / "spool", "--graceful-timeout", "300")
    base = f"http://127.0.0.1:{port}/v1"
    try:
        assert httpx.post(base + "/runs", json={"name": "term", "config": {}}).status_code == 201
        lines: list[str] = []
        ready = threading.Event()
        reader = threading.Thread(target=_read_events, args=(base + "/runs/term/events", {}, 1, lines, ready))
        reader.start()
        assert ready.wait(10)
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        reader.join(10)
        assert not reader.is_alive()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
