"""Issue 34 item 3, tenants: an agent key bound to runs (`TRAJGATE_AGENT_KEYS` entries `KEY=RUN[,RUN...]`) reaches
only those runs, on every route, on Postgres and SQLite. Another run is the 404 of a run, trajectory, group or
response that does not exist, in the shape of the API called, with the same message; unbound keys and the admin key
keep today's behaviour (every run)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from fastapi.routing import APIRoute
from pydantic import SecretStr

from gateway.http.auth import Auth
from gateway.http.deps import require_agent
from gateway.http.errors import GatewayError
from gateway.runs.settings import ConfigError, load_settings
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.messages_agent import COUNT_TOKENS, FIRST
from tests.support.openai_calls import client_body
from tests.support.responses_agent import ask
from tests.support.stored import stored_calls

KEY_A = "tenant-a-key"
KEY_B = "dGVuYW50LWI="  # base64 with its padding: bound by the text after the LAST '='
KEY_FREE = "unbound-key"
ADMIN = "admin-key"
AGENT_KEYS = f"{KEY_A}=run-a; {KEY_B}=run-b,run-shared; {KEY_FREE}"
ADMIN_ONLY = {"authorization": f"Bearer {ADMIN}"}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def not_found(run: str) -> dict[str, Any]:
    """What OpenAI answers for a model that does not exist: what a bound key gets for any run not its own."""
    message = f"The model `{run}` does not exist or you do not have access to it."
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "model_not_found"}}


@pytest.fixture
def tenants(gateway_settings: dict[str, object]) -> Iterator[RunningGateway]:
    """Two bound keys (one base64 with padding, bound to two runs), one unbound key, the admin key."""
    with running_gateway(**gateway_settings, agent_keys=AGENT_KEYS, admin_key=ADMIN) as gw:
        yield gw


def chat(
    gw: RunningGateway, upstream: FakeUpstream, key: str, run: str, trajectory: str, group: str | None = None,
    path: str = "/chat/completions", **headers: str,
) -> httpx.Response:  # fmt: skip
    """One chat (or completions) call, answered from a vLLM recording whatever the run's name."""
    body = {**client_body(upstream.fixture("completions" if path == "/completions" else "chat")), "model": run}
    sent = {**bearer(key), "x-trajectory-id": trajectory, **headers}
    if group is not None:
        sent["x-group-id"] = group
    return httpx.post(gw.base_url + path, json=body, headers=sent, timeout=30)


# -- parsing TRAJGATE_AGENT_KEYS --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "keys"),
    [
        ("k1, k2 ,", [("k1", None), ("k2", None)]),  # today's form: unbound keys
        ("dGVzdA==,b3RoZXI=", [("dGVzdA==", None), ("b3RoZXI=", None)]),  # base64 padding is no binding
        ("b3RoZXI=,dGVzdA", [("b3RoZXI=", None), ("dGVzdA", None)]),  # nor is a key after a padded one
        ("key=run-a,run-b", [("key", {"run-a", "run-b"})]),
        ("dGVzdA===run-a", [("dGVzdA==", {"run-a"})]),  # a padded key, bound: its last '=' starts the runs
        ("k=org/agent:v1 ; u1,u2; k2 = run-b",
         [("k", {"org/agent:v1"}), ("u1", None), ("u2", None), ("k2", {"run-b"})]),  # fmt: skip
        ("k=run-a;k=run-a", [("k", {"run-a"}), ("k", {"run-a"})]),  # the same binding twice is one
    ],
)
def test_agent_keys_are_parsed_by_the_last_equals_sign(value: str, keys: list[tuple[str, set[str] | None]]) -> None:
    settings = load_settings(_env_file=None, agent_keys=value, admin_key=ADMIN)
    parsed = [(k.get_secret_value(), set(k.runs) if k.runs is not None else None) for k in settings.agent_keys]
    assert parsed == keys
    assert all(isinstance(key, SecretStr) for key in settings.agent_keys)
    assert "run-a" not in repr(settings.agent_keys) and "k1" not in repr(settings)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("s3cret=run-a,,run-b", "neither nothing nor a list of run names"),  # an empty item
        ("s3cret=run-a,", "neither nothing nor a list of run names"),
        ("s3cret=run a", "neither nothing nor a list of run names"),  # not a run name
        ("s3cret=org/../x", "neither nothing nor a list of run names"),
        ("s3cret=run-a,s3cond=run-b", "a binding is one key"),  # two bindings need ';' between them
        ("=run-a", "a binding is one key"),
        ("s3cret=run-a;s3cret=run-b", "appears again with other runs"),
        ("s3cret=run-a;s3cret", "appears again with other runs"),
    ],
)
def test_a_binding_that_could_be_mistyped_is_refused_at_start(value: str, says: str) -> None:
    """Read as unbound keys, any of these would open every run to the key: it is a start-up error instead, which
    names the entry by position and never quotes the key."""
    with pytest.raises(ConfigError) as info:
        load_settings(_env_file=None, agent_keys=value, admin_key=ADMIN)
    message = str(info.value)
    assert message.startswith("invalid TRAJGATE_AGENT_KEYS") and says in message and "\n" not in message
    assert "s3cret" not in message and "s3cond" not in message


def test_bindings_without_an_admin_key_are_refused() -> None:
    """Without an admin key the reads, the export and the UI are open to anyone: a binding would wall nothing off."""
    with pytest.raises(ConfigError) as info:
        load_settings(_env_file=None, agent_keys="s3cret=run-a")
    assert "TRAJGATE_AGENT_KEYS" in str(info.value) and "TRAJGATE_ADMIN_KEY" in str(info.value)
    assert "s3cret" not in str(info.value)
    assert load_settings(_env_file=None, agent_keys="k1,k2").admin_key is None  # unbound keys: as before


def test_auth_returns_the_runs_of_the_key_that_matched() -> None:
    settings = load_settings(_env_file=None, agent_keys=AGENT_KEYS, admin_key=ADMIN)
    auth = Auth(settings.agent_keys, settings.admin_key)
    assert auth.check_agent(KEY_A) == frozenset({"run-a"})
    assert auth.check_agent(KEY_B) == frozenset({"run-b", "run-shared"})
    assert auth.check_agent(KEY_FREE) is None and auth.check_agent(ADMIN) is None
    assert auth.bound
    with pytest.raises(GatewayError, match="invalid API key"):
        auth.check_agent("run-a")
    # the admin key sees every run even if it is also listed, bound, as an agent key
    both = load_settings(_env_file=None, agent_keys=f"{ADMIN}=run-a", admin_key=ADMIN)
    assert Auth(both.agent_keys, both.admin_key).check_agent(ADMIN) is None
    assert not Auth(load_settings(_env_file=None, agent_keys="k1").agent_keys, None).bound


# -- every route ------------------------------------------------------------------------------------------------------

# The routes an agent key may call, besides the model calls (raw ASGI, not FastAPI routes): each is tested below.
AGENT_ROUTES = {
    ("POST", "/v1/trajectories/{trajectory_id}/reward"),
    ("POST", "/v1/rewards"),
    ("POST", "/v1/groups/{group_id}/close"),
    ("GET", "/v1/responses/{response_id}"),
}


def _agent_routes(gw: RunningGateway) -> set[tuple[str, str]]:
    found = set()
    for entry in gw.app.api.routes:
        router = getattr(entry, "original_router", None)  # (FastAPI keeps an included router whole)
        inherited = list(router.dependencies) if router is not None else []
        for route in router.routes if router is not None else [entry]:
            if isinstance(route, APIRoute) and any(
                depends.dependency is require_agent for depends in [*inherited, *route.dependencies]
            ):
                found |= {(method, route.path) for method in route.methods}
    return found


def test_model_calls_to_another_run_are_404_as_a_run_that_does_not_exist(
    tenants: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    assert _agent_routes(tenants) == AGENT_ROUTES  # a new agent route must be added here, and its binding tested
    assert chat(tenants, upstream, KEY_B, "run-b", "t-b-own").status_code == 200  # run-b exists now
    before = len(upstream.received)
    for path in ("/chat/completions", "/completions"):
        for run in ("run-b", "run-never-made"):
            refused = chat(tenants, upstream, KEY_A, run, "t-refused", path=path)
            assert (refused.status_code, refused.json()) == (404, not_found(run)), (path, run)
        # X-Run names the run where `model` cannot: it is the one checked
        refused = chat(tenants, upstream, KEY_A, "run-a", "t-refused", path=path, **{"x-run": "run-b"})
        assert (refused.status_code, refused.json()) == (404, not_found("run-b"))
        # the key#group/trajectory form binds as its key does
        refused = chat(tenants, upstream, f"{KEY_A}#g-x/t-refused", "run-b", "t-refused", path=path)
        assert (refused.status_code, refused.json()) == (404, not_found("run-b"))
    assert len(upstream.received) == before  # nothing reached vLLM
    with pytest.raises(openai.NotFoundError) as sdk:  # and the SDK reads it as it reads OpenAI's
        openai.OpenAI(base_url=tenants.base_url, api_key=KEY_A, max_retries=0).chat.completions.create(
            **{**client_body(upstream.fixture("chat")), "model": "run-b"}
        )
    assert sdk.value.code == "model_not_found"
    # its own runs, by model or X-Run; the unbound key and the admin key: any run
    assert chat(tenants, upstream, KEY_A, "run-a", "t-a-own").status_code == 200
    assert chat(tenants, upstream, KEY_A, "run-b", "t-a-xrun", **{"x-run": "run-a"}).status_code == 200
    assert chat(tenants, upstream, KEY_A, "run-a", "t-a-own", path="/completions").status_code == 200
    assert chat(tenants, upstream, KEY_B, "run-shared", "t-b-shared").status_code == 200
    for key in (KEY_FREE, ADMIN):
        assert chat(tenants, upstream, key, "run-b", f"t-{key}").status_code == 200
        assert chat(tenants, upstream, key, "run-never-made", f"t-{key}-2").status_code == 200
    tenants.flush()
    assert stored_calls(db_url, "t-refused") == []
    assert [c["run"] for c in stored_calls(db_url, "t-a-xrun")] == ["run-a"]
    assert [c["run"] for c in stored_calls(db_url, "t-a-own")] == ["run-a", "run-a"]


def test_messages_to_another_run_are_anthropics_404(tenants: RunningGateway, db_url: str) -> None:
    def sdk(key: str, trajectory: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=f"{tenants.url}/t/{trajectory}", api_key=key, max_retries=0)

    for run in ("run-b", "run-never-made"):
        body = {"type": "error", "error": {"type": "not_found_error", "message": not_found(run)["error"]["message"]}}
        with pytest.raises(anthropic.NotFoundError) as refused:
            sdk(KEY_A, "t-m-refused").messages.create(**{**FIRST, "model": run})
        assert refused.value.body == body
        with pytest.raises(anthropic.NotFoundError) as counted:
            sdk(KEY_A, "t-m-refused").messages.count_tokens(**{**COUNT_TOKENS, "model": run})
        assert counted.value.body == body
        # X-Run decides as on the chat path, before vLLM is asked anything
        with pytest.raises(anthropic.NotFoundError):
            sdk(KEY_A, "t-m-refused").messages.create(**{**FIRST, "model": "run-a"}, extra_headers={"x-run": run})
    assert sdk(KEY_A, "t-m-a").messages.create(**{**FIRST, "model": "run-a"}).stop_reason == "tool_use"
    assert sdk(KEY_A, "t-m-a").messages.count_tokens(**{**COUNT_TOKENS, "model": "run-a"}).input_tokens > 0
    assert sdk(KEY_FREE, "t-m-free").messages.create(**{**FIRST, "model": "run-b"}).stop_reason == "tool_use"
    tenants.flush()
    assert stored_calls(db_url, "t-m-refused") == []
    assert [c["run"] for c in stored_calls(db_url, "t-m-a")] == ["run-a"]


def test_rewards_and_closes_of_another_runs_trajectories_are_404_as_unknown_ones(
    tenants: RunningGateway, upstream: FakeUpstream
) -> None:
    assert chat(tenants, upstream, KEY_A, "run-a", "t-ra", group="g-ra").status_code == 200
    assert chat(tenants, upstream, KEY_B, "run-b", "t-rb", group="g-rb").status_code == 200
    tenants.flush()

    def reward(key: str, trajectory: str, value: float = 1.0) -> httpx.Response:
        url = f"{tenants.base_url}/trajectories/{trajectory}/reward"
        return httpx.post(url, json={"reward": value}, headers=bearer(key), timeout=30)

    def close(key: str, group: str) -> httpx.Response:
        return httpx.post(f"{tenants.base_url}/groups/{group}/close", headers=bearer(key), timeout=30)

    def batch(key: str, trajectories: list[str]) -> httpx.Response:
        body = [{"trajectory_id": trajectory, "reward": 0.5} for trajectory in trajectories]
        return httpx.post(f"{tenants.base_url}/rewards", json=body, headers=bearer(key), timeout=30)

    def same_as_unknown(theirs: httpx.Response, unknown: httpx.Response, their_id: str, unknown_id: str) -> None:
        assert theirs.status_code == unknown.status_code == 404
        assert theirs.text == unknown.text.replace(unknown_id, their_id)

    for key in (KEY_A, f"{KEY_A}#g-rb/t-rb"):  # (the key#group/trajectory form: its key decides)
        same_as_unknown(reward(key, "t-rb"), reward(key, "t-nowhere"), "t-rb", "t-nowhere")
        same_as_unknown(close(key, "g-rb"), close(key, "g-nowhere"), "g-rb", "g-nowhere")
        same_as_unknown(batch(key, ["t-ra", "t-rb"]), batch(key, ["t-ra", "t-nowhere"]), "t-rb", "t-nowhere")
    refused = batch(KEY_A, ["t-ra", "t-rb"])
    assert [(item["index"], item["status"]) for item in refused.json()["items"]] == [(1, 404)]
    group = httpx.get(f"{tenants.base_url}/groups/g-ra", headers=ADMIN_ONLY, timeout=30).json()
    assert [t["reward"] for t in group["trajectories"]] == [None]  # all or nothing: its own item was not stored
    # a key's own, and any run for the unbound key and the admin key
    assert reward(KEY_A, "t-ra").json()["reward"] == 1.0
    assert close(KEY_A, "g-ra").json()["group_ready"] is True
    assert [r["trajectory_id"] for r in batch(KEY_B, ["t-rb"]).json()["data"]] == ["t-rb"]
    assert reward(KEY_FREE, "t-rb", 0.25).json()["reward"] == 0.25
    assert reward(ADMIN, "t-ra", 0.75).json()["reward"] == 0.75
    assert close(KEY_FREE, "g-rb").json()["closed"] is True


def _responses(gw: RunningGateway, key: str, trajectory: str) -> openai.OpenAI:
    # eval mode: the client's greedy sampling reaches vLLM, as when the Responses exchanges were recorded
    return openai.OpenAI(base_url=f"{gw.url}/eval/t/{trajectory}/v1", api_key=key, max_retries=0)


def test_responses_of_another_run_are_404_as_unknown_ones(gateway_settings: dict[str, object]) -> None:
    """A response's run is checked against the reader's key: fetched or continued after the key was bound to other
    runs (a restart with new bindings), it is the 404 of an unknown id; a call to another run is OpenAI's 404."""
    unknown_id = "resp_" + "0" * 32
    first = {**gateway_settings, "agent_keys": f"{KEY_A}=run-a,run-c;{KEY_FREE}", "admin_key": ADMIN}
    with running_gateway(**first) as gw:
        on_a = ask(_responses(gw, KEY_A, "t-resp-a"), False, run="run-a")
        on_c = ask(_responses(gw, KEY_A, "t-resp-c"), False, run="run-c")
        with pytest.raises(openai.NotFoundError) as refused:
            ask(_responses(gw, KEY_A, "t-resp-refused"), False, run="run-b")
        assert refused.value.body == not_found("run-b")["error"]
        with pytest.raises(openai.NotFoundError) as refused:  # continuing its own response, into another run
            _responses(gw, KEY_A, "t-resp-a").responses.create(
                model="run-b", input="more", previous_response_id=on_a.id
            )
        assert refused.value.code == "model_not_found"
        assert ask(_responses(gw, KEY_FREE, "t-resp-free"), False, run="run-b").output_text
        gw.flush()
    with running_gateway(**{**first, "agent_keys": f"{KEY_A}=run-c;{KEY_FREE}"}) as gw:
        client = _responses(gw, KEY_A, "t-resp-a")
        for response_id in (on_a.id, unknown_id):
            with pytest.raises(openai.NotFoundError) as fetched:
                client.responses.retrieve(response_id)
            assert fetched.value.body == {"message": f"No response found with id '{response_id}'.",
                                          "type": "invalid_request_error", "param": None,
                                          "code": "not_found"}  # fmt: skip
            with pytest.raises(openai.NotFoundError) as continued:
                client.responses.create(model="run-c", input="more", previous_response_id=response_id)
            assert continued.value.body == {"message": f"Previous response with id '{response_id}' not found.",
                                            "type": "invalid_request_error", "param": None,
                                            "code": "previous_response_not_found"}  # fmt: skip
        # still bound to run-c: that response is read back from its record
        assert client.responses.retrieve(on_c.id).output_text == on_c.output_text


def test_models_lists_a_bound_key_only_its_runs(tenants: RunningGateway, upstream: FakeUpstream) -> None:
    assert chat(tenants, upstream, KEY_FREE, "run-other", "t-models").status_code == 200
    tenants.flush()
    tenants.app.state.router.refresh(tenants.app.state.engine)  # (as the background refresh does)
    asked = {key: httpx.get(f"{tenants.base_url}/models", headers=bearer(key), timeout=30) for key in (
        KEY_A, KEY_B, KEY_FREE, ADMIN)}  # fmt: skip
    assert [m["id"] for m in asked[KEY_A].json()["data"]] == ["run-a"]
    assert [m["id"] for m in asked[KEY_B].json()["data"]] == ["run-b", "run-shared"]
    for key in (KEY_FREE, ADMIN):  # every run, and the base model
        ids = [m["id"] for m in asked[key].json()["data"]]
        assert ids[0] == "smollm2" and "run-other" in ids
    # which runs exist is itself what a tenant may not read: no key, no list
    for headers in ({}, bearer("wrong")):
        assert httpx.get(f"{tenants.base_url}/models", headers=headers, timeout=30).status_code == 401


def test_reads_export_and_the_ui_are_the_admin_keys_and_show_every_run(
    tenants: RunningGateway, upstream: FakeUpstream
) -> None:
    """Reading recorded runs (trajectories, groups, runs, steps, events, export, judge, the UI) takes the admin key,
    as before tenants: a bound key is refused there like every agent key, and the admin key sees every tenant's runs."""
    assert chat(tenants, upstream, KEY_A, "run-a", "t-read-a", group="g-read-a").status_code == 200
    assert chat(tenants, upstream, KEY_B, "run-b", "t-read-b", group="g-read-b").status_code == 200
    tenants.flush()
    reads = ["/v1/trajectories/t-read-a", "/v1/groups/g-read-a", "/v1/runs", "/v1/runs/run-a", "/v1/runs/run-a/steps",
             "/v1/runs/run-a/export", "/v1/trajectories/t-read-b", "/v1/runs/run-b/export"]  # fmt: skip
    for key in (KEY_A, KEY_B, KEY_FREE):
        for path in reads:
            assert httpx.get(tenants.url + path, headers=bearer(key), timeout=30).status_code == 401, (key, path)
        judge = httpx.post(f"{tenants.base_url}/groups/g-read-a/judge", headers=bearer(key), json={}, timeout=30)
        assert judge.status_code == 401
        page = httpx.get(f"{tenants.url}/ui", headers=bearer(key), timeout=30)
        assert page.status_code == 303 and page.headers["location"].startswith("/ui/login")
        login = httpx.post(f"{tenants.url}/ui/login", data={"key": key}, timeout=30)
        assert login.status_code == 401 and "set-cookie" not in login.headers
    for path in reads:
        assert httpx.get(tenants.url + path, headers=ADMIN_ONLY, timeout=30).status_code == 200, path
    runs = {run["name"] for run in httpx.get(f"{tenants.base_url}/runs", headers=ADMIN_ONLY, timeout=30).json()["data"]}
    assert {"run-a", "run-b"} <= runs
    for run, trajectory in (("run-a", "t-read-a"), ("run-b", "t-read-b")):
        export = httpx.get(f"{tenants.base_url}/runs/{run}/export", headers=ADMIN_ONLY, timeout=30).text
        assert f'"trajectory_id":"{trajectory}"' in export.replace(" ", "")
    page = httpx.get(f"{tenants.url}/ui", headers=ADMIN_ONLY, timeout=30).text
    assert ">run-a<" in page and ">run-b<" in page


def test_metrics_name_runs_only_to_the_admin_key(tenants: RunningGateway, upstream: FakeUpstream) -> None:
    """/metrics stays open for the process's own figures (scrapers expect that), but its per-run series name every
    run: with an admin key set, only a scrape that sends it gets them."""
    assert chat(tenants, upstream, KEY_A, "run-a", "t-metrics-a").status_code == 200
    tenants.flush()
    for headers in ({}, bearer(KEY_A), bearer(KEY_FREE), bearer("wrong")):
        page = httpx.get(tenants.url + "/metrics", headers=headers, timeout=30)
        assert page.status_code == 200 and "trajgate_requests_total" in page.text
        assert "trajgate_run_" not in page.text and "run-a" not in page.text, headers
    page = httpx.get(tenants.url + "/metrics", headers=ADMIN_ONLY, timeout=30).text
    assert 'trajgate_run_step{run="run-a"}' in page
