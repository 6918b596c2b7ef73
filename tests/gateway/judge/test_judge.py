"""The LLM judge over HTTP and as a worker, on Postgres and SQLite, against a fake OpenAI-compatible judge model that
replays answers recorded from SmolLM2 on vLLM (tests/fixtures/judge/smollm2_*.json) or hand-made ones (which say
so): rewards land for a whole group or not at all, malformed answers and provider errors are retried, failures are
visible, long trajectories are truncated and say so."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.judge.core import judge_trajectories
from gateway.judge.worker import JudgeWorker
from gateway.runs.config import JudgeConfig
from gateway.store import db
from gateway.store.judging import judgeable_groups, load_group
from gateway.store.rewards import RewardItem, close_group, store_rewards
from gateway.store.runs import upsert_run
from tests.support.fake_judge import FakeJudge, chat_completion, judge_block, judge_fixture, scores_answer
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.judge_group import GROUP, IDS, RUN, write_group
from tests.support.openai_calls import assert_openai_error
from tests.support.trajectories import group, set_group_state

HANDMADE_REWARDS = [0.9, 1.0, 0.0, 0.1]


@pytest.fixture(scope="session")
def fake_judge() -> Iterator[FakeJudge]:
    judge = FakeJudge().start()
    yield judge
    judge.stop()


UNREACHABLE = "http://127.0.0.1:9/v1"  # nobody listens


@pytest.fixture
def gateway_settings(gateway_settings: dict[str, object], fake_judge: FakeJudge) -> dict[str, object]:
    """The operator allows the fake judge (and a dead port) as judge endpoints, and these tests' key variables."""
    return {**gateway_settings, "judge_api_bases": f"{fake_judge.base_url},{UNREACHABLE}",
            "judge_key_envs": "JUDGE_KEY,MY_JUDGE_KEY"}  # fmt: skip


def configure(gw: RunningGateway, fake: FakeJudge, **overrides: Any) -> None:
    response = httpx.post(
        f"{gw.base_url}/runs", json={"name": RUN, "config": {"judge": judge_block(fake, **overrides)}}, timeout=30
    )
    assert response.status_code in (200, 201), response.text


def judge_now(gw: RunningGateway, group_id: str = GROUP, body: Any = None, **headers: str) -> httpx.Response:
    return httpx.post(f"{gw.base_url}/groups/{group_id}/judge", json=body, headers=headers, timeout=60)


@pytest.fixture
def judged(gateway: RunningGateway, db_url: str, fake_judge: FakeJudge) -> RunningGateway:
    """The gateway with tests/support/judge_group.py's four trajectories recorded and the run's judge set to the
    fake."""
    engine = db.make_engine(db_url)
    try:
        write_group(engine)
    finally:
        engine.dispose()
    configure(gateway, fake_judge)
    return gateway


def trajectory(gw: RunningGateway, trajectory_id: str) -> dict[str, Any]:
    response = httpx.get(f"{gw.base_url}/trajectories/{trajectory_id}", timeout=30)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def assert_unrewarded(gw: RunningGateway, group_id: str = GROUP) -> None:
    view = group(gw, group_id)
    assert (view["state"], view["rewarded"]) == ("open", 0), view
    assert all(t["reward"] is None and t["metrics"] is None for t in view["trajectories"])


def test_recorded_smollm2_answer_becomes_the_groups_rewards(judged: RunningGateway, fake_judge: FakeJudge) -> None:
    recorded = judge_fixture("smollm2_guided")
    fake_judge.reset(FakeJudge.replay("smollm2_guided"))
    response = judge_now(judged)
    assert response.status_code == 200, response.text
    # What the judge sent is exactly what SmolLM2 answered when recorded (else: scripts/record_judge_fixtures.py).
    assert fake_judge.received == [recorded["request"]] and fake_judge.paths == ["/v1/chat/completions"]
    sent = fake_judge.received[0]
    assert sent["model"] == "smollm2" and sent["response_format"]["type"] == "json_schema"
    body = response.json()
    assert (body["object"], body["group_id"], body["run"], body["model"]) == (
        "group.judgement", GROUP, RUN, "hosted_vllm/smollm2"
    )
    assert (body["group_state"], body["group_ready"], body["attempts"], body["failed_attempts"]) == (
        "ready", True, 1, []
    )
    assert body["truncation"]["truncated"] is False and body["truncation"]["prompt_chars"] > 0
    assert [d["trajectory_id"] for d in body["data"]] == list(IDS)
    assert all(d["reward"] == 1.0 and d["explanation"].startswith("The score is") for d in body["data"])

    view = group(judged, GROUP)
    assert (view["state"], view["rewarded"]) == ("ready", 4)
    metrics = view["trajectories"][0]["metrics"]
    assert metrics == {"judge_score": 1.0, "judge_attempts": 1.0, "judge_truncated": 0.0, "judge_chars_removed": 0.0}
    stored = trajectory(judged, "j-1")["metadata"]["judge"]
    assert stored["explanation"] == body["data"][0]["explanation"] and stored["model"] == "hosted_vllm/smollm2"
    assert stored["attempts"] == 1 and stored["truncation"]["truncated"] is False and stored["judged_at"]


def test_handmade_answer_ranks_the_group(judged: RunningGateway, fake_judge: FakeJudge) -> None:
    fake_judge.reset(FakeJudge.replay("handmade_valid"))
    response = judge_now(judged)
    assert response.status_code == 200, response.text
    assert [d["reward"] for d in response.json()["data"]] == HANDMADE_REWARDS
    rewards = {t["trajectory_id"]: t["reward"] for t in group(judged, GROUP)["trajectories"]}
    assert rewards == dict(zip(IDS, HANDMADE_REWARDS))
    # The prompt: the shared system prompt and task once, every trajectory's turns labelled by id.
    user = fake_judge.received[0]["messages"][1]["content"]
    assert user.count("How much do 12 pencils cost?") == 1 and user.count("You are a shopping assistant.") == 1
    assert all(f'# Trajectory "{t}"' in user for t in IDS)
    assert '[assistant calls tool calculator]\n{"expression": "12 + 0.35"}' in user and "[tool result (call_9)]" in user


def missing_id() -> tuple[int, Any]:
    return 200, chat_completion(scores_answer({"j-1": 0.5, "j-2": 0.5, "j-3": 0.5}, "hand-made: j-4 is missing"))


def out_of_range() -> tuple[int, Any]:
    return 200, chat_completion(scores_answer({"j-1": 0.5, "j-2": 7, "j-3": 0.5, "j-4": 0.5}, "hand-made: 7"))


def test_malformed_answers_are_retried_with_feedback(judged: RunningGateway, fake_judge: FakeJudge) -> None:
    configure(judged, fake_judge, max_attempts=5)
    fake_judge.reset(
        FakeJudge.replay("smollm2_unguided"),  # recorded: SmolLM2 without guided decoding writes no JSON
        FakeJudge.replay("smollm2_json_object"),  # recorded: JSON, but one score and no ids
        missing_id(),
        out_of_range(),
        FakeJudge.replay("handmade_valid"),
    )
    response = judge_now(judged)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["attempts"] == 5 and len(body["failed_attempts"]) == 4
    assert "not a JSON object" in body["failed_attempts"][0] and "cut off at max_tokens" in body["failed_attempts"][0]
    assert "no score for 'j-4'" in body["failed_attempts"][2] and "outside [0, 1]" in body["failed_attempts"][3]
    assert [d["reward"] for d in body["data"]] == HANDMADE_REWARDS
    assert trajectory(judged, "j-1")["metrics"]["judge_attempts"] == 5.0
    # Each retry shows the model its bad answer and says what was wrong with it.
    retry = fake_judge.received[3]["messages"]
    assert [m["role"] for m in retry] == ["system", "user", "assistant", "user"]
    assert retry[2]["content"] == missing_id()[1]["choices"][0]["message"]["content"]
    assert "no score for 'j-4'" in retry[3]["content"]
    assert fake_judge.received[0]["messages"] == fake_judge.received[1]["messages"][:2]


def test_malformed_answers_never_half_written(judged: RunningGateway, fake_judge: FakeJudge) -> None:
    configure(judged, fake_judge, max_attempts=3)
    fake_judge.reset(missing_id(), out_of_range(), FakeJudge.replay("smollm2_unguided"))
    response = judge_now(judged)
    error = assert_openai_error(response, 502)
    assert (error["type"], error["code"]) == ("judge_error", "judge_invalid_answer")
    assert "no valid answer after 3 attempt(s)" in error["message"] and "no reward stored" in error["message"]
    attempts = response.json()["attempts"]
    assert len(attempts) == 3 and "no score for 'j-4'" in attempts[0] and "outside [0, 1]" in attempts[1]
    assert len(fake_judge.received) == 3
    assert_unrewarded(judged)  # three of four scores were fine in the first answer: none was stored


def test_provider_errors_leave_the_group_unrewarded(judged: RunningGateway, fake_judge: FakeJudge) -> None:
    overloaded = (500, {"error": {"message": "EngineCore died", "type": "InternalServerError", "code": 500}})
    fake_judge.reset(overloaded, overloaded, overloaded)
    response = judge_now(judged)
    error = assert_openai_error(response, 502)
    assert error["code"] == "judge_provider_error" and "HTTP 500" in error["message"]
    assert "EngineCore died" in error["message"] and len(response.json()["attempts"]) == 3
    assert len(fake_judge.received) == 3
    assert_unrewarded(judged)

    # A 4xx other than 408/409/425/429 would fail the same way again: not retried.
    fake_judge.reset((400, {"error": {"message": "This model's maximum context length is 2048 tokens", "code": 400}}))
    error = assert_openai_error(judge_now(judged), 502)
    assert "maximum context length" in error["message"] and len(fake_judge.received) == 1

    # Nobody listening: a connection error, retried, then the same 502.
    configure(judged, fake_judge, api_base=UNREACHABLE, max_attempts=2)
    error = assert_openai_error(judge_now(judged), 502)
    assert error["code"] == "judge_provider_error" and "127.0.0.1:9" in error["message"]
    assert_unrewarded(judged)

    # After a transient error, the next attempt's good answer is stored.
    configure(judged, fake_judge)
    fake_judge.reset(overloaded, FakeJudge.replay("handmade_valid"))
    response = judge_now(judged)
    assert response.status_code == 200 and response.json()["attempts"] == 2
    assert "HTTP 500" in response.json()["failed_attempts"][0]


def test_long_trajectories_are_truncated_and_say_so(
    judged: RunningGateway, fake_judge: FakeJudge, db_url: str
) -> None:
    engine = db.make_engine(db_url)
    try:
        write_group(engine, group="jg-long", ids=IDS_LONG, long_tool_output=40_000)
    finally:
        engine.dispose()
    configure(judged, fake_judge, max_context_chars=6_000)
    fake_judge.reset(auto=True)
    response = judge_now(judged, "jg-long")
    assert response.status_code == 200, response.text
    truncation = response.json()["truncation"]
    assert truncation["truncated"] is True and truncation["tool_outputs_truncated"] == 1
    assert truncation["messages_truncated"] == 0 and truncation["chars_removed"] > 35_000
    assert truncation["max_context_chars"] == 6_000 and truncation["prompt_chars"] <= 6_000
    messages = fake_judge.received[0]["messages"]
    assert sum(len(m["content"]) for m in messages) == truncation["prompt_chars"]
    assert f"…[truncated {truncation['chars_removed']} chars]…" in messages[1]["content"]
    assert "result: 4.2" in messages[1]["content"]  # the tail of the tool output survives the cut
    stored = trajectory(judged, IDS_LONG[0])
    assert stored["metrics"]["judge_truncated"] == 1.0 and stored["metadata"]["judge"]["truncation"] == truncation


IDS_LONG = ("long-1", "long-2", "long-3", "long-4")


def test_judge_endpoint_errors(judged: RunningGateway, fake_judge: FakeJudge, db_url: str) -> None:
    fake_judge.reset(auto=True)
    assert assert_openai_error(judge_now(judged, "no-such-group"), 404)["code"] == "group_not_found"
    assert assert_openai_error(judge_now(judged, "bad id!"), 400)["code"] == "invalid_id"
    assert assert_openai_error(judge_now(judged, body=[1]), 422)["code"] == "invalid_value"
    bad = assert_openai_error(judge_now(judged, body={"max_attempts": 0}), 422)
    assert bad["message"].startswith("judge.max_attempts")
    key = assert_openai_error(judge_now(judged, body={"api_key": "sk-secret"}), 422)
    assert "api_key_env" in key["message"] and "sk-secret" not in key["message"]
    needs_litellm = judge_now(judged, body={"model": "anthropic/claude-haiku", "client": "builtin"})
    assert assert_openai_error(needs_litellm, 501)["code"] == "judge_unavailable"
    assert fake_judge.received == []

    # A run with no judge block: the body can name a model for this call.
    engine = db.make_engine(db_url)
    try:
        write_group(engine, run="plain-run", group="pg-1", ids=("p-1", "p-2"))
    finally:
        engine.dispose()
    missing = assert_openai_error(judge_now(judged, "pg-1"), 422)
    assert missing["code"] == "judge_not_configured" and "plain-run" in missing["message"]
    rubric = "Only the final dollar amount matters."
    response = judge_now(judged, "pg-1", body={**judge_block(fake_judge), "rubric": rubric})
    assert response.status_code == 200, response.text
    assert rubric in fake_judge.received[0]["messages"][0]["content"]

    # Once the trainer claimed the group its rewards are frozen: refused before asking the model.
    set_group_state(db_url, GROUP, "claimed")
    fake_judge.reset(auto=True)
    assert assert_openai_error(judge_now(judged), 409)["code"] == "reward_conflict"
    assert fake_judge.received == []


def test_judge_needs_the_admin_key(
    gateway_settings: dict[str, object], fake_judge: FakeJudge, db_url: str
) -> None:
    with running_gateway(**{**gateway_settings, "agent_keys": "agent-1", "admin_key": "admin-x"}) as gw:
        engine = db.make_engine(db_url)
        try:
            write_group(engine)
        finally:
            engine.dispose()
        fake_judge.reset(auto=True)
        assert_openai_error(judge_now(gw, body=judge_block(fake_judge)), 401)
        assert_openai_error(judge_now(gw, body=judge_block(fake_judge), Authorization="Bearer agent-1"), 401)
        ok = judge_now(gw, body=judge_block(fake_judge), Authorization="Bearer admin-x")
        assert ok.status_code == 200, ok.text
        assert "admin-x" not in json.dumps(fake_judge.headers)  # the gateway's keys never reach the judge model


def test_run_config_judge_block(gateway: RunningGateway) -> None:
    def post(config: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{gateway.base_url}/runs", json={"name": "jr", "config": config}, timeout=30)

    created = post({"judge": {"model": "openai/gpt-4o-mini", "rubric": "Be strict.", "api_key_env": "JUDGE_KEY"}})
    assert created.status_code == 201, created.text
    judge = created.json()["config"]["judge"]
    assert (judge["model"], judge["rubric"], judge["max_attempts"], judge["temperature"]) == (
        "openai/gpt-4o-mini", "Be strict.", 3, 0.0
    )
    assert "api_key" not in judge
    for config, where in [
        ({"judge": {"model": "gpt-4o-mini"}}, "config.judge.model"),
        ({"judge": {"model": "openai/x", "api_key": "sk-1"}}, "api_key_env"),
        ({"judge": {"model": "openai/x", "max_context_chars": 100}}, "config.judge.max_context_chars"),
        ({"judge": {"model": "openai/x", "temprature": 1}}, "config.judge.temprature"),
        ({"judge": {"rubric": "no model"}}, "config.judge.model"),
    ]:
        error = assert_openai_error(post(config), 422)
        assert where in error["message"] and "sk-1" not in error["message"], error
    removed = post({"judge": None})
    assert removed.status_code == 200 and removed.json()["config"]["judge"] is None


# --- the worker -------------------------------------------------------------------------------------------------


def group_ids(prefix: str, n: int = 4) -> tuple[str, ...]:
    return tuple(f"{prefix}-{i}" for i in range(1, n + 1))


def rewards_of(engine: Any, group_id: str) -> list[float | None]:
    loaded = load_group(engine, group_id)
    assert loaded is not None
    return [t["reward"] for t in loaded.trajectories]


def test_worker_judges_complete_unrewarded_groups_only(
    db_url: str, fake_judge: FakeJudge, caplog: pytest.LogCaptureFixture
) -> None:
    db.upgrade(db_url)
    engine = db.make_engine(db_url)
    try:
        write_group(engine, group="w-size", ids=group_ids("ws"))  # at its expected size, idle for an hour
        write_group(engine, group="w-closed", ids=group_ids("wc", 2), size=None)
        close_group(engine, "w-closed")  # closed with two of no expected size
        write_group(engine, group="w-active", ids=group_ids("wa"), start=time.time() - 5)  # agents still at it
        write_group(engine, group="w-short", ids=group_ids("wp"), size=5)  # one trajectory still to come
        write_group(engine, group="w-open", ids=group_ids("wo"), size=None)  # no size, not closed
        write_group(engine, group="w-single", ids=group_ids("w1", 1), size=1)  # a group of one never trains
        write_group(engine, group="w-human", ids=group_ids("wh"))
        store_rewards(engine, [RewardItem("wh-2", 0.3)])  # someone else rewards this group
        write_group(engine, group="w-ready", ids=group_ids("wr", 2), size=2)
        store_rewards(engine, [RewardItem("wr-1", 1.0), RewardItem("wr-2", 0.0)])
        write_group(engine, run="other-run", group="w-other", ids=group_ids("wx"))
        upsert_run(engine, RUN, {"judge": judge_block(fake_judge, settle_s=60)})

        assert judgeable_groups(engine, RUN, min_size=2, settle_s=60) == ["w-size", "w-closed", "w-human"]
        assert judgeable_groups(engine, RUN, min_size=1, settle_s=0) == [
            "w-size", "w-closed", "w-active", "w-single", "w-human"
        ]  # fmt: skip

        fake_judge.reset(auto=True)
        worker = JudgeWorker(db_settings(db_url, fake_judge), RUN)
        try:
            with caplog.at_level(logging.INFO, logger="trajgate.judge"):
                result = asyncio.run(worker.judge_pending())
            assert (result.judged, result.failed, result.skipped) == (2, 0, 1)
            assert len(fake_judge.received) == 2
            assert rewards_of(engine, "w-size") == [1.0, 0.75, 0.5, 0.25]
            assert rewards_of(engine, "w-closed") == [1.0, 0.5]
            assert rewards_of(engine, "w-human") == [None, 0.3, None, None]  # left to whoever rewards it
            assert rewards_of(engine, "w-active") == [None] * 4 and rewards_of(engine, "w-other") == [None] * 4
            assert "group 'w-size': ws-1=1.00 ws-2=0.75 ws-3=0.50 ws-4=0.25 (1 attempt(s)" in caplog.text
            assert "'w-human' has rewards from someone else" in caplog.text
            assert asyncio.run(worker.judge_pending()).judged == 0  # nothing left; w-human is not even loaded
        finally:
            worker.close()
    finally:
        engine.dispose()


def db_settings(db_url: str, fake_judge: FakeJudge) -> Any:
    from gateway.runs.settings import load_settings

    return load_settings(_env_file=None, database_url=db_url, judge_api_bases=fake_judge.base_url)


def test_worker_failure_is_logged_and_retried_later(
    db_url: str, fake_judge: FakeJudge, caplog: pytest.LogCaptureFixture
) -> None:
    db.upgrade(db_url)
    engine = db.make_engine(db_url)
    try:
        write_group(engine, group="w-fail", ids=group_ids("wf"))
        upsert_run(engine, RUN, {"judge": judge_block(fake_judge, max_attempts=2)})
        down = (503, {"error": {"message": "no capacity", "code": 503}})
        fake_judge.reset(down, down)
        worker = JudgeWorker(db_settings(db_url, fake_judge), RUN)
        try:
            with caplog.at_level(logging.INFO, logger="trajgate.judge"):
                result = asyncio.run(worker.judge_pending())
            assert (result.judged, result.failed) == (0, 1) and worker.failed == 1
            assert "group 'w-fail' not judged, left unrewarded (retry in 30s)" in caplog.text
            assert "HTTP 503" in caplog.text and "no capacity" in caplog.text
            assert rewards_of(engine, "w-fail") == [None] * 4
            fake_judge.reset(auto=True)
            assert asyncio.run(worker.judge_pending()).judged == 0 and fake_judge.received == []  # backing off
            worker._later["w-fail"].until = 0  # the delay has passed
            assert asyncio.run(worker.judge_pending()).judged == 1
            assert rewards_of(engine, "w-fail") == [1.0, 0.75, 0.5, 0.25]
        finally:
            worker.close()
    finally:
        engine.dispose()


def test_cli_judge_once(sqlite_url: str, fake_judge: FakeJudge, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from gateway.cli import main

    monkeypatch.setenv("TRAJGATE_DATABASE_URL", sqlite_url)
    monkeypatch.setenv("TRAJGATE_JUDGE_API_BASES", fake_judge.base_url)
    db.upgrade(sqlite_url)
    engine = db.make_engine(sqlite_url)
    try:
        write_group(engine)
        assert main(["judge", "--run", "no-such-run", "--once"]) == 2
        assert "no run named 'no-such-run'" in capsys.readouterr().err
        assert main(["judge", "--run", RUN, "--once"]) == 2
        assert "has no judge configured" in capsys.readouterr().err
        upsert_run(engine, RUN, {"judge": judge_block(fake_judge)})
        fake_judge.reset(FakeJudge.replay("handmade_valid"))
        assert main(["judge", "--run", RUN, "--once", "--log-level", "warning"]) == 0
        assert "1 group(s) judged for run 'judge-run'" in capsys.readouterr().out
        assert rewards_of(engine, GROUP) == HANDMADE_REWARDS
    finally:
        engine.dispose()


def test_retries_back_off_exponentially(sqlite_url: str, fake_judge: FakeJudge) -> None:
    db.upgrade(sqlite_url)
    engine = db.make_engine(sqlite_url)
    try:
        write_group(engine)
        trajectories = load_group(engine, GROUP).trajectories  # type: ignore[union-attr]
    finally:
        engine.dispose()
    config = JudgeConfig.model_validate(judge_block(fake_judge, backoff_s=1.0, max_attempts=4))
    fake_judge.reset(missing_id(), (502, {"error": {"message": "bad gateway"}}), missing_id(), missing_id())
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    with pytest.raises(Exception, match="no valid answer after 4 attempt"):
        asyncio.run(judge_trajectories(trajectories, config, sleep=sleep))
    assert len(slept) == 3 and all(base <= s <= base * 1.1 for s, base in zip(slept, [1.0, 2.0, 4.0]))


def test_litellm_path(judged: RunningGateway, fake_judge: FakeJudge, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same judge through litellm (the `judge` extra): hosted_vllm/ and openai/ models by name, against the
    fake; litellm's own retries are off (ours count), and the key comes from the environment."""
    pytest.importorskip("litellm")
    configure(judged, fake_judge, client="litellm")
    fake_judge.reset(FakeJudge.replay("smollm2_guided"))
    response = judge_now(judged)
    assert response.status_code == 200, response.text
    assert response.json()["client"] == "litellm"
    sent = fake_judge.received[0]
    assert sent["model"] == "smollm2" and sent["response_format"] == judge_fixture("smollm2_guided")["request"][
        "response_format"
    ]
    assert sent["messages"] == judge_fixture("smollm2_guided")["request"]["messages"]

    monkeypatch.setenv("MY_JUDGE_KEY", "sk-judge-123")
    configure(judged, fake_judge, client="litellm", model="openai/gpt-4o-mini", api_key_env="MY_JUDGE_KEY",
              max_attempts=2)  # fmt: skip
    overloaded = (500, {"error": {"message": "overloaded", "type": "server_error", "code": 500}})
    fake_judge.reset(overloaded, overloaded)
    error = assert_openai_error(judge_now(judged), 502)
    assert error["code"] == "judge_provider_error" and "overloaded" in error["message"]
    assert len(fake_judge.received) == 2  # exactly our two attempts: no hidden retries inside litellm
    assert fake_judge.headers[0].get("Authorization") == "Bearer sk-judge-123"
    assert fake_judge.received[0]["model"] == "gpt-4o-mini"
    rewards = {t["trajectory_id"]: t["reward"] for t in group(judged, GROUP)["trajectories"]}
    assert rewards == {d["trajectory_id"]: d["reward"] for d in response.json()["data"]}  # the first judgement stands


def test_gateway_start_never_imports_litellm(tmp_path: Any) -> None:
    code = (
        "import sys\n"
        "from gateway.runs.settings import load_settings\n"
        "from gateway.app import create_app\n"
        "import gateway.cli, gateway.api.judge_api, gateway.judge.worker\n"
        f"create_app(load_settings(_env_file=None, database_url='sqlite:///{tmp_path}/x.db', spool_dir='{tmp_path}'))\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('litellm', 'openai', 'tiktoken'))\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_client_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.judge import providers

    def config(**values: Any) -> JudgeConfig:
        return JudgeConfig.model_validate({"model": "hosted_vllm/smollm2", "api_base": "http://vllm:8000/v1", **values})

    monkeypatch.delenv("HOSTED_VLLM_API_BASE", raising=False)
    monkeypatch.setattr(providers, "litellm_installed", lambda: True)
    assert providers.client_for(config()) == "litellm"
    assert providers.client_for(config(client="builtin")) == "builtin"
    monkeypatch.setattr(providers, "litellm_installed", lambda: False)
    assert providers.client_for(config()) == "builtin"  # the fallback when the `judge` extra is not installed
    assert providers.client_for(config(model="openai/gpt-4o-mini", api_base=None)) == "builtin"
    for bad, message in [
        (config(model="anthropic/claude-haiku"), "needs litellm"),
        (config(client="litellm"), "not installed"),
        (config(api_base=None), "needs api_base"),
    ]:
        with pytest.raises(providers.JudgeUnavailable, match=message):
            providers.client_for(bad)
