"""Issue 33, "tenants stay apart and secrets stay home": what one agent key stores is not another's to read, the
gateway's secrets go nowhere an admin names, memory is bounded in bytes, and what the store cannot hold is refused
before it is answered (or stored anyway), never answered and then lost."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import openai
import orjson
import pytest
import sqlalchemy
from fastapi.routing import APIRoute

from gateway.http.deps import require_agent
from gateway.judge.worker import JudgeSetupError, JudgeWorker
from gateway.runs.settings import load_settings
from gateway.store import db
from gateway.store.models import UiSession
from gateway.store.runs import upsert_run
from scripts.record_fixtures import TOOL_SYSTEM, WEATHER_RESULT
from tests.support.fake_judge import FakeJudge
from tests.support.fake_upstream import FakeUpstream, load_fixtures
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.judge_group import RUN as RUN_JUDGED
from tests.support.judge_group import write_group
from tests.support.openai_calls import assert_openai_error
from tests.support.responses_agent import FUNCTION_TOOL, RUN, TOOL_ITEMS, ask
from tests.support.stored import stored_calls

KEY_A, KEY_B = "agent-key-a", "agent-key-b"
JUDGE_GROUP = "jg-security"


@pytest.fixture
def keyed(gateway_settings: dict[str, object]) -> Iterator[RunningGateway]:
    """A gateway with two agent keys (two tenants) and an admin key."""
    with running_gateway(**gateway_settings, agent_keys=f"{KEY_A},{KEY_B}", admin_key="admin-key") as gw:
        yield gw


def sdk(gw: RunningGateway, trajectory: str, key: str) -> openai.OpenAI:
    # eval mode: the client's greedy sampling reaches vLLM, as when the Responses exchanges were recorded
    return openai.OpenAI(base_url=f"{gw.url}/eval/t/{trajectory}/v1", api_key=key, max_retries=0)


def _agent_reads(gw: RunningGateway) -> list[str]:
    """Every GET route an agent key may call that names stored state by id (a path parameter)."""
    paths = []
    for entry in gw.app.api.routes:
        # (FastAPI keeps an included router whole, its dependencies on the router)
        router = getattr(entry, "original_router", None)
        inherited = list(router.dependencies) if router is not None else []
        for route in router.routes if router is not None else [entry]:
            if not isinstance(route, APIRoute) or "GET" not in route.methods or "{" not in route.path:
                continue
            if any(depends.dependency is require_agent for depends in [*inherited, *route.dependencies]):
                paths.append(route.path)
    return paths


def _walk(gw: RunningGateway, response_id: str, key: str) -> dict[str, int]:
    """Status of every agent read of this response id, and of continuing it, with `key`."""
    seen = {}
    for path in _agent_reads(gw):
        url = gw.url + re.sub(r"\{[^}]+\}", response_id, path)
        seen[path] = httpx.get(url, headers={"authorization": f"Bearer {key}"}).status_code
    continued = httpx.post(
        gw.base_url + "/responses", headers={"authorization": f"Bearer {key}"},
        json={"model": RUN, "input": "more", "previous_response_id": response_id},
    )  # fmt: skip
    seen["previous_response_id"] = continued.status_code
    return seen


# -- 1. stored responses belong to the key that created them ---------------------------------------------------------


def test_another_key_cannot_fetch_or_continue_a_response(keyed: RunningGateway, db_url: str) -> None:
    first = ask(sdk(keyed, "t-tenant-a", KEY_A), False)
    other = sdk(keyed, "t-tenant-b", KEY_B)
    with pytest.raises(openai.NotFoundError) as fetched:
        other.responses.retrieve(first.id)
    assert fetched.value.body["message"].startswith("No response found")  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as continued:
        other.responses.create(model=RUN, input="and Germany?", previous_response_id=first.id)
    assert continued.value.code == "previous_response_not_found"
    # the owner may, with the key alone or in its key#trajectory form
    assert sdk(keyed, "t-tenant-a", KEY_A).responses.retrieve(first.id).output_text == first.output_text
    assert sdk(keyed, "t-tenant-a", f"{KEY_A}#t-tenant-a").responses.retrieve(first.id).id == first.id
    # ... and the same holds for the record read back from the database (another gateway, a restart)
    keyed.flush()
    keyed.app.state.responses._kept.clear()
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    assert sdk(keyed, "t-tenant-a", KEY_A).responses.retrieve(first.id).output_text == first.output_text
    # the record names its owner by a fingerprint, never the key
    [call] = stored_calls(db_url, "t-tenant-a")
    owner = call["request"]["trajgate_responses"]["owner"]
    assert re.fullmatch(r"[0-9a-f]{32}", owner)
    assert KEY_A.encode() not in orjson.dumps(call["request"])


def test_every_agent_read_of_stored_state_is_a_404_for_another_key(keyed: RunningGateway, db_url: str) -> None:
    """Walks every GET route an agent key can call with an id (today: GET /v1/responses/{id}) plus continuing by
    previous_response_id: the owner's key gets 200, another key the 404 of an unknown id, from memory and from the
    database alike."""
    response_id = ask(sdk(keyed, "t-walk", KEY_A), False).id
    assert _agent_reads(keyed) == ["/v1/responses/{response_id}"]
    unknown = _walk(keyed, "resp_" + "0" * 32, KEY_B)
    assert set(unknown.values()) == {404}
    for from_database in (False, True):
        if from_database:
            keyed.flush()
            keyed.app.state.responses._kept.clear()
        assert _walk(keyed, response_id, KEY_B) == unknown
        owner = _walk(keyed, response_id, KEY_A)
        assert owner["/v1/responses/{response_id}"] == 200
        assert owner["previous_response_id"] == 418  # found, and sent on: replay has no answer for "more"


def test_response_ids_are_unguessable(gateway: RunningGateway) -> None:
    """128 random bits each: not a per-process prefix and a counter, where the next id follows from the last."""
    ids = [ask(sdk(gateway, f"t-ids-{i}", "x"), False).id for i in range(3)]
    hexes = [i.removeprefix("resp_") for i in ids]
    assert all(re.fullmatch(r"[0-9a-f]{32}", h) for h in hexes)
    assert len({h[:16] for h in hexes}) == 3 and len({h[-8:] for h in hexes}) == 3


def test_auth_off_keeps_one_tenant(gateway: RunningGateway) -> None:
    first = ask(sdk(gateway, "t-open", "anything"), False)
    assert sdk(gateway, "t-open", "something else").responses.retrieve(first.id).id == first.id


# -- 3. memory held by stored responses is bounded in bytes ----------------------------------------------------------


def _metric(gw: RunningGateway, name: str) -> float:
    text = httpx.get(gw.url + "/metrics").text
    [value] = re.findall(rf"^{name} (\S+)$", text, re.M)
    return float(value)


def test_responses_memory_is_bounded_in_bytes_and_the_record_stays(gateway: RunningGateway, db_url: str) -> None:
    api = gateway.app.state.responses
    common: dict[str, Any] = {"model": RUN, "instructions": TOOL_SYSTEM, "tools": [FUNCTION_TOOL],
                              "max_output_tokens": 48, "temperature": 0}  # fmt: skip
    first = sdk(gateway, "t-evicted", "x").responses.create(input=TOOL_ITEMS, **common)
    one = api.kept_bytes
    assert api.kept_count == 1 and one > 1000
    assert _metric(gateway, "trajgate_responses_kept_bytes") == one
    api.memory_bytes = 2 * one  # room for about two: each later one pushes the oldest out
    later = [ask(sdk(gateway, f"t-filler-{i}", "x"), False).id for i in range(4)]
    assert first.id not in api._kept and later[0] not in api._kept and later[-1] in api._kept
    assert api.kept_bytes == sum(kept.size for kept in api._kept.values()) <= api.memory_bytes
    assert 1 <= api.kept_count < 5
    assert _metric(gateway, "trajgate_responses_kept_bytes") == api.kept_bytes
    assert _metric(gateway, "trajgate_responses_kept") == api.kept_count
    # what was dropped from memory is fetched and continued from its record
    gateway.flush()
    client = sdk(gateway, "t-evicted", "x")
    assert client.responses.retrieve(first.id).output[0].model_dump() == first.output[0].model_dump()
    output = {"type": "function_call_output", "call_id": first.output[0].call_id, "output": WEATHER_RESULT}
    second = client.responses.create(input=[output], previous_response_id=first.id, **common)
    assert second.output_text and second.previous_response_id == first.id
    gateway.flush()
    assert len(stored_calls(db_url, "t-evicted")) == 2
    # one larger than the whole bound is not kept at all (its record serves it)
    kept_before = dict(api._kept)
    api.memory_bytes = 10
    big = ask(sdk(gateway, "t-too-big", "x"), False)
    assert big.id not in api._kept and api._kept == kept_before


# -- 6. the key is checked before the body is read, on every model route ---------------------------------------------

MODEL_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"]


@pytest.mark.parametrize("path", MODEL_ROUTES)
def test_no_key_is_a_401_before_the_body_is_read(keyed: RunningGateway, path: str) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
        headers = {"content-type": "application/json", **headers}
        answer = httpx.post(keyed.url + path, content=b"{nope", headers=headers)
        assert answer.status_code == 401, (path, headers, answer.text)
        body = answer.json()
        if path.startswith("/v1/messages"):  # Anthropic's shape
            assert (body["type"], body["error"]["type"]) == ("error", "authentication_error")
        else:
            assert body["error"]["code"] == "invalid_api_key"
    # with a key, the same body is the client's mistake
    answer = httpx.post(keyed.url + path, content=b"{nope", headers={"authorization": f"Bearer {KEY_B}"})
    assert answer.status_code == 400


# -- 2. the judge reads keys and calls endpoints only from the operator's lists ---------------------------------------


@pytest.fixture(scope="module")
def listener() -> Iterator[FakeJudge]:
    """An OpenAI-compatible server anyone could stand up: it records what reaches it."""
    judge = FakeJudge().start()
    yield judge
    judge.stop()


def _judge(gw: RunningGateway, body: dict[str, Any]) -> httpx.Response:
    headers = {"authorization": "Bearer admin-key"}
    return httpx.post(f"{gw.base_url}/groups/{JUDGE_GROUP}/judge", json=body, headers=headers, timeout=60)


def test_judge_sends_no_variable_and_calls_no_endpoint_the_operator_did_not_allow(
    gateway_settings: dict[str, object], listener: FakeJudge, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANY_VAR", "the-gateways-secret")
    monkeypatch.setenv("LISTED_VAR", "admin-key")  # listed by mistake, but it is the admin key's value
    monkeypatch.setenv("DB_VAR", str(gateway_settings["database_url"]).replace("postgresql+psycopg://", "postgres://"))
    monkeypatch.setenv("TRAJGATE_JUDGE_KEY_LOCAL", "sk-judge-local")
    allowed = f"{listener.base_url}/"  # (a trailing slash makes no other endpoint)
    settings = {**gateway_settings, "admin_key": "admin-key", "agent_keys": KEY_A,
                "judge_key_envs": "LISTED_VAR,DB_VAR,TRAJGATE_ADMIN_KEY,TRAJGATE_DATABASE_URL"}  # fmt: skip
    engine = db.make_engine(db_url)
    with running_gateway(**settings) as gw:
        try:
            write_group(engine, group=JUDGE_GROUP, ids=("js-1", "js-2"))
        finally:
            engine.dispose()
        listener.reset(auto=True)
        block = {"model": "hosted_vllm/x", "client": "builtin", "max_attempts": 1, "backoff_s": 0.0}
        vllm = str(gateway_settings["upstream_url"])  # a vLLM upstream is always allowed
        refused = [
            ({"api_base": listener.base_url, "api_key_env": "ANY_VAR"}, "TRAJGATE_JUDGE_API_BASES"),
            ({"api_base": listener.base_url}, "TRAJGATE_JUDGE_API_BASES"),  # where a provider's own key would go
            ({"api_base": gw.base_url}, "TRAJGATE_JUDGE_API_BASES"),
            ({"api_base": vllm, "api_key_env": "ANY_VAR"}, "TRAJGATE_JUDGE_KEY_ENVS"),
            ({"api_base": vllm, "api_key_env": "TRAJGATE_JUDGE_KEY_ENVS"}, "TRAJGATE_JUDGE_KEY_ENVS"),  # a setting
            ({"api_base": vllm, "api_key_env": "LISTED_VAR"}, "own secrets"),
            ({"api_base": vllm, "api_key_env": "TRAJGATE_ADMIN_KEY"}, "own secrets"),
            ({"api_base": vllm, "api_key_env": "DB_VAR"}, "own secrets"),  # the database URL, as users write it
            ({"api_base": vllm, "api_key_env": "TRAJGATE_DATABASE_URL"}, "own secrets"),
        ]
        for override, setting in refused:
            error = _judge(gw, {**block, **override}).json()["error"]
            assert (error["code"], setting in error["message"]) == ("judge_not_allowed", True), error
            assert "the-gateways-secret" not in error["message"] and "admin-key" not in error["message"]
            run = httpx.post(
                f"{gw.base_url}/runs", json={"name": "judged-run", "config": {"judge": {**block, **override}}},
                headers={"authorization": "Bearer admin-key"},
            )  # fmt: skip
            assert (run.status_code, run.json()["error"]["code"]) == (400, "judge_not_allowed")
        assert listener.received == [] and listener.headers == []
        stored = httpx.get(f"{gw.base_url}/runs/judged-run", headers={"authorization": "Bearer admin-key"})
        assert stored.status_code == 404
    # allowed by the operator: the endpoint listed, the key from a TRAJGATE_JUDGE_KEY_ variable
    with running_gateway(**{**settings, "judge_api_bases": allowed}) as gw:
        answer = _judge(gw, {**block, "api_base": listener.base_url, "api_key_env": "TRAJGATE_JUDGE_KEY_LOCAL"})
        assert answer.status_code == 200, answer.text
        assert [h.get("Authorization") for h in listener.headers] == ["Bearer sk-judge-local"]


def test_judge_worker_refuses_a_stored_config_the_operator_did_not_allow(db_url: str, listener: FakeJudge) -> None:
    """A judge block stored before the lists existed is checked when the worker starts, before any call."""
    db.upgrade(db_url)
    engine = db.make_engine(db_url)
    try:
        write_group(engine, group=JUDGE_GROUP, ids=("jw-1", "jw-2"))
        upsert_run(engine, RUN_JUDGED, {"judge": {"model": "hosted_vllm/x", "api_base": listener.base_url}})
    finally:
        engine.dispose()
    listener.reset(auto=True)
    worker = JudgeWorker(load_settings(_env_file=None, database_url=db_url), RUN_JUDGED)
    try:
        with pytest.raises(JudgeSetupError, match="TRAJGATE_JUDGE_API_BASES"):
            worker.config()
    finally:
        worker.close()
    assert listener.received == []


# -- 7. ids "." and ".." are refused wherever an id is accepted ------------------------------------------------------

CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
MESSAGES = {"model": "smollm2", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


def _raw_post(gw: RunningGateway, path: str, body: Any, **headers: str) -> httpx.Response:
    """A POST whose path reaches the gateway as written (no client-side dot-segment resolution)."""
    url = httpx.URL(gw.url).copy_with(raw_path=path.encode())
    return httpx.post(url, json=body, headers=headers)


@pytest.mark.parametrize("dots", [".", ".."])
def test_dot_ids_are_refused_everywhere(gateway: RunningGateway, dots: str) -> None:
    encoded = dots.replace(".", "%2e")
    calls = [
        _raw_post(gateway, "/v1/chat/completions", CHAT, **{"x-trajectory-id": dots}),
        _raw_post(gateway, "/v1/chat/completions", CHAT, **{"x-trajectory-id": "t-ok", "x-group-id": dots}),
        _raw_post(gateway, f"/t/{encoded}/v1/chat/completions", CHAT),
        _raw_post(gateway, f"/g/{encoded}/t/t-ok/v1/chat/completions", CHAT),
        _raw_post(gateway, "/v1/chat/completions", CHAT, authorization=f"Bearer x#{dots}"),
        _raw_post(gateway, "/v1/chat/completions", CHAT, authorization=f"Bearer x#{dots}/t-ok"),
        _raw_post(gateway, f"/t/{encoded}/v1/responses", {"model": RUN, "input": "hi"}),
        _raw_post(gateway, "/v1/messages", MESSAGES, **{"x-trajectory-id": dots}),
        _raw_post(gateway, f"/v1/trajectories/{encoded}/reward", {"reward": 1.0}),
        _raw_post(gateway, f"/v1/groups/{encoded}/close", None),
        _raw_post(gateway, f"/v1/groups/{encoded}/judge", None),
    ]
    for answer in calls:
        assert answer.status_code == 400, (answer.request.url, answer.text)
        error = answer.json()["error"]
        assert "invalid" in error["message"] and "'.' or '..'" in error["message"], error
    # a run is named by `model` or X-Run; a part '.' or '..' was already refused
    for run in (_raw_post(gateway, "/v1/chat/completions", {**CHAT, "model": dots}),
                _raw_post(gateway, "/v1/chat/completions", CHAT, **{"x-run": f"org/{dots}"})):  # fmt: skip
        assert assert_openai_error(run, 400)["code"] == "invalid_model"
    assert assert_openai_error(_raw_post(gateway, "/v1/runs", {"name": dots}), 422)["code"] == "invalid_value"
    batch = _raw_post(gateway, "/v1/rewards", [{"trajectory_id": dots, "reward": 1.0}])
    assert batch.status_code == 422 and "'.' or '..'" in batch.text
    # "..." is an id like any other
    dots_id = _raw_post(gateway, "/v1/chat/completions", CHAT, **{"x-trajectory-id": "..."})
    assert dots_id.headers["x-trajectory-id"] == "..."


# -- 8, 9. a NUL in an admin input or a page cursor is a 4xx, not a database error -----------------------------------


def test_a_nul_in_an_admin_body_query_or_cursor_is_a_400(gateway: RunningGateway) -> None:
    runs = gateway.base_url + "/runs"
    for body in (
        {"name": "nul-run", "base_model": "a\u0000b"},
        {"name": "nul-run", "base_model": "m", "base_weights": "/w/\u0000"},
        {"name": "nul-run", "base_model": "m", "config": {"judge": {"model": "openai/x", "rubric": "r\u0000"}}},
        {"name": "nul-run", "base_model": "m", "config": {"sampling": {"stop": ["\u0000"]}}},
    ):
        error = assert_openai_error(httpx.post(runs, json=body), 400)
        assert error["code"] == "invalid_value" and "NUL" in error["message"]
    assert httpx.get(runs + "/nul-run").status_code == 404  # nothing stored
    judge = httpx.post(gateway.base_url + "/groups/g-1/judge", json={"model": "openai/x", "rubric": "\u0000"})
    assert assert_openai_error(judge, 400)["code"] == "invalid_value"
    for url in (runs + "?after=%00", gateway.url + "/ui/trajectories?run=x&after=%00", runs + "/x/steps?after=1%00"):
        assert assert_openai_error(httpx.get(url), 400)["code"] == "invalid_value", url
    # a page cursor is base64: its NUL is only seen once decoded
    assert httpx.post(runs, json={"name": "cursor-run", "base_model": "m"}).status_code == 201
    for raw in ("2026-01-01T00:00:00+00:00|t\x00", "\x00|t"):
        cursor = base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")
        page = httpx.get(gateway.url + "/ui/trajectories", params={"run": "cursor-run", "after": cursor})
        assert assert_openai_error(page, 400)["message"].startswith("not a page cursor")
    # (a reward's metadata may hold one: JSON columns store it as U+FFFD, as before)


# -- 10. what an upstream answers, the store holds ------------------------------------------------------------------

ODD_REASON = "a-finish-reason-no-vllm-ever-sent-" + "x" * 40 + "\u0000end"


def _odd(fixture: dict[str, Any]) -> dict[str, Any]:
    """The recording with a finish_reason longer than the old column and holding a NUL, and a NUL in the model name."""
    fixture = copy.deepcopy(fixture)
    fixture["request"]["messages"][0]["content"] += " (odd)"
    if fixture.get("stream"):
        chunks = []
        for chunk in fixture["chunks"]:
            if chunk != "[DONE]":
                data = json.loads(chunk)
                data["model"] = "small\u0000lm"
                for choice in data["choices"]:
                    if choice.get("finish_reason"):
                        choice["finish_reason"] = ODD_REASON
                chunk = json.dumps(data)
            chunks.append(chunk)
        fixture["chunks"] = chunks
    else:
        fixture["response"]["model"] = "small\u0000lm"
        fixture["response"]["choices"][0]["finish_reason"] = ODD_REASON
    return fixture


@pytest.fixture(scope="module")
def odd_upstream() -> Iterator[FakeUpstream]:
    recorded = load_fixtures()
    fake = FakeUpstream({"models": recorded["models"], "chat": _odd(recorded["chat"]),
                         "chat_stream": _odd(recorded["chat_stream"])}).start()  # fmt: skip
    yield fake
    fake.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_an_odd_upstream_answer_is_answered_and_stored(
    gateway_settings: dict[str, object], odd_upstream: FakeUpstream, db_url: str, stream: bool
) -> None:
    fixture = odd_upstream.fixture("chat_stream" if stream else "chat")
    body = {k: v for k, v in fixture["request"].items() if k not in ("logprobs", "return_token_ids")}
    trajectory = f"t-odd-{stream}"
    with running_gateway(**{**gateway_settings, "upstream_url": odd_upstream.base_url}) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/eval/t/{trajectory}/v1", api_key="x", max_retries=0)
        if stream:
            chunks = list(client.chat.completions.create(**body))
            assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
                ODD_REASON
            ]
        else:
            assert client.chat.completions.create(**body).choices[0].finish_reason == ODD_REASON
        gw.flush()
        writer = gw.app.state.writer
        assert (writer.counters.records_rejected, writer.counters.records_lost) == (0, 0)
    [call] = stored_calls(db_url, trajectory)
    assert call["finish_reason"] == ODD_REASON.replace("\u0000", "\ufffd")  # whole; U+FFFD marks the NUL
    assert call["response"]["model"] == "small\ufffdlm" and call["trainable"] is True


# -- 4, 5. UI sessions: one per login, ended by logout, expiry or a new admin key, on every gateway; Secure on https --

ADMIN = "admin-key"


def _login(gw: RunningGateway, **headers: str) -> httpx.Response:
    answer = httpx.post(gw.url + "/ui/login", data={"key": ADMIN, "next": "/ui"}, headers=headers)
    assert answer.status_code == 303 and answer.headers["location"] == "/ui", answer.text
    return answer


def _session(gw: RunningGateway) -> str:
    cookie = _login(gw).cookies.get("trajgate_ui")
    assert cookie
    return cookie


def _page_status(gw: RunningGateway, cookie: str) -> int:
    return httpx.get(gw.url + "/ui", cookies={"trajgate_ui": cookie}).status_code  # 200, or 303 to the login form


def test_ui_sessions_end_at_logout_expiry_and_key_change_on_every_gateway(
    gateway_settings: dict[str, object], db_url: str, tmp_path: Any
) -> None:
    settings = {**gateway_settings, "admin_key": ADMIN}
    with (
        running_gateway(**settings) as one,
        running_gateway(**{**settings, "spool_dir": tmp_path / "spool-two"}) as two,
    ):
        first, second, third = _session(one), _session(two), _session(one)
        assert len({first, second, third}) == 3  # one session per login
        assert ADMIN not in first and _login(one).headers["set-cookie"].count(f"Max-Age={12 * 3600}") == 1
        assert [_page_status(gw, cookie) for gw in (one, two) for cookie in (first, second)] == [200] * 4
        # logging out on one gateway ends that session on both; the others live on
        out = httpx.post(one.url + "/ui/logout", cookies={"trajgate_ui": first})
        assert out.status_code == 303 and 'trajgate_ui=""' in out.headers["set-cookie"]
        assert [_page_status(gw, first) for gw in (one, two)] == [303, 303]
        assert [_page_status(gw, second) for gw in (one, two)] == [200, 200]
        # an expired session is refused (its expiry moved to the past, rather than waiting for it)
        engine = db.make_engine(db_url)
        try:
            with engine.begin() as conn:
                stored = {row.id_hash for row in conn.execute(sqlalchemy.select(UiSession.id_hash))}
                assert first not in stored and len(stored) == 4  # only hashes are kept
                digest = hashlib.sha256(second.encode()).hexdigest()
                conn.execute(
                    sqlalchemy.update(UiSession)
                    .where(UiSession.id_hash == digest)
                    .values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
                )
        finally:
            engine.dispose()
        assert [_page_status(gw, second) for gw in (one, two)] == [303, 303]
        assert _page_status(two, third) == 200
    # a new admin key ends every session made with the old one
    with running_gateway(**{**settings, "admin_key": "another-admin-key"}) as changed:
        assert _page_status(changed, third) == 303


def test_ui_cookie_is_secure_when_the_login_came_over_https(gateway_settings: dict[str, object]) -> None:
    with running_gateway(**{**gateway_settings, "admin_key": ADMIN}) as gw:  # trusts a proxy on 127.0.0.1
        assert "Secure" not in _login(gw).headers["set-cookie"]
        assert "Secure" in _login(gw, **{"x-forwarded-proto": "https"}).headers["set-cookie"]
        assert "Secure" not in _login(gw, **{"x-forwarded-proto": "http"}).headers["set-cookie"]
    with running_gateway(**{**gateway_settings, "admin_key": ADMIN, "forwarded_allow_ips": "10.1.2.3"}) as gw:
        # not from a trusted proxy: the header is anyone's to send
        assert "Secure" not in _login(gw, **{"x-forwarded-proto": "https"}).headers["set-cookie"]
    with running_gateway(**{**gateway_settings, "admin_key": ADMIN, "forwarded_allow_ips": "*"}) as gw:
        assert "Secure" in _login(gw, **{"x-forwarded-proto": "https"}).headers["set-cookie"]


@pytest.mark.parametrize("served", ["m" * 513, "small\u0000lm"])
def test_a_base_model_name_the_store_cannot_hold_is_refused_before_any_answer(
    gateway_settings: dict[str, object], db_url: str, served: str
) -> None:
    """With TRAJGATE_BASE_MODEL unset the gateway takes vLLM's first model, which names every record's run: one the
    runs table cannot hold would have every call answered and then refused by the store."""
    recorded = load_fixtures()
    models = copy.deepcopy(recorded["models"])
    models["response"]["data"][0]["id"] = served
    fake = FakeUpstream({"models": models, "chat": recorded["chat"]}).start()
    try:
        with running_gateway(**{**gateway_settings, "upstream_url": fake.base_url, "base_model": None}) as gw:
            answer = httpx.post(gw.base_url + "/chat/completions", json=CHAT, headers={"x-trajectory-id": "t-base"})
            error = assert_openai_error(answer, 502)
            assert "TRAJGATE_BASE_MODEL" in error["message"]
            assert fake.received == []  # refused before vLLM was asked to answer
            gw.flush()
            assert gw.app.state.writer.counters.records_rejected == 0
    finally:
        fake.stop()
