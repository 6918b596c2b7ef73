"""The web UI at /ui against a run seeded through the store (tests/support/ui_seed.py), on Postgres and SQLite: the pages show
the seeded numbers, every page and asset needs the admin key (a login form sets an HttpOnly cookie), hostile content
renders inert, and the trajectory search pages by keyset."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from gateway.store import db
from gateway.store.runs import upsert_run
from gateway.store.training import acquire_run_lease
from gateway.store.ui_reads import advantages
from gateway.ui.pages import _trend
from gateway.ui.token_text import DERENDER_COMPLETIONS, TokenTextCache, batches, derender_body
from gateway.ui.tree_view import layout as tree_layout
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.openai_calls import assert_openai_error
from tests.support.pgcluster import create_database, drop_database
from tests.support.ui_seed import (
    EVAL_REWARDS,
    HOSTILE,
    RUN,
    STEP_METRICS,
    TOKEN_TEXT_IDS,
    TOKEN_TEXT_TRAJECTORY,
    TOKEN_TEXTS,
    TRAIN_REWARDS,
    TREE_TRAJECTORY,
    add_step,
    seed,
)

ADMIN = "admin-secret-for-ui"
PAGES = [
    "/ui",
    f"/ui/run?name={RUN}",
    "/ui/group?id=g0",
    "/ui/trajectory?id=g0-t0",
    f"/ui/trajectories?run={RUN}",
]
ASSETS = ["/ui/static/ui.js", "/ui/static/ui.css", f"/ui/events?run={RUN}"]


@pytest.fixture(scope="module", params=["postgres", "sqlite"])
def seeded_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One seeded database per backend, shared by this module's tests (they only read it, but for the live test's
    extra step, which comes after every number asserted here)."""
    if request.param == "postgres":
        url = create_database(request.getfixturevalue("pg_server_url"))
    else:
        url = f"sqlite:///{tmp_path_factory.mktemp('ui') / 'trajgate.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        seed(engine)
    finally:
        engine.dispose()
    yield url
    if request.param == "postgres":
        drop_database(url)


@pytest.fixture(scope="module")
def ui(seeded_url: str, upstream: FakeUpstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    with running_gateway(
        database_url=seeded_url, upstream_url=upstream.base_url, base_model="smollm2",
        spool_dir=tmp_path_factory.mktemp("spool"), admin_key=ADMIN,
    ) as gw:  # fmt: skip
        yield gw


@contextmanager
def admin(gw: RunningGateway) -> Iterator[httpx.Client]:
    """A client logged in through the form, as a browser is."""
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        response = client.post("/ui/login", data={"key": ADMIN, "next": "/ui"})
        assert response.status_code == 303 and response.headers["location"] == "/ui"
        yield client


# A completion token's span: colour class, trained mark, partial flag, id, logprob, partial note, what it shows.
TOKEN = re.compile(
    r'<span class="tok (lp[^ "]+) (\w+)( partial)?" title="id (\d+) · logprob ([^"·]+?)( · [^"]+)?">([^<]*)</span>'
)


def text_of(page: str) -> str:
    """The page's visible text, tags dropped and whitespace squeezed, entities decoded."""
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page)))


def test_every_page_and_asset_needs_the_admin_key(ui: RunningGateway) -> None:
    with httpx.Client(base_url=ui.url, timeout=30) as anonymous:
        for path in PAGES:
            for cookies in ({}, {"trajgate_ui": "forged"}, {"trajgate_ui": ADMIN}):
                anonymous.cookies.clear()
                anonymous.cookies.update(cookies)
                response = anonymous.get(path)
                assert response.status_code == 303, (path, cookies)
                location = urlparse(response.headers["location"])
                assert location.path == "/ui/login" and parse_qs(location.query)["next"] == [path]
        anonymous.cookies.clear()
        for path in ASSETS:
            assert assert_openai_error(anonymous.get(path), 401)["code"] == "invalid_api_key"
        login = anonymous.get("/ui/login")
        assert login.status_code == 200 and 'type="password"' in login.text and ADMIN not in login.text
    # The key in a header works too (scripts), the session cookie in a browser; never the key in the URL.
    for path in PAGES + ASSETS[:2]:
        assert httpx.get(ui.url + path, headers={"authorization": f"Bearer {ADMIN}"}).status_code == 200, path
    assert httpx.get(ui.url + f"/ui?key={ADMIN}").status_code == 303
    with admin(ui) as client:
        for path in PAGES + ASSETS[:2]:
            response = client.get(path)
            assert response.status_code == 200, path
            assert "content-security-policy" in response.headers and response.headers["x-frame-options"] == "DENY"


def test_login_cookie_is_httponly_and_not_the_key(ui: RunningGateway) -> None:
    wrong = httpx.post(ui.url + "/ui/login", data={"key": "nope"})
    assert wrong.status_code == 401 and "not the admin key" in wrong.text and "set-cookie" not in wrong.headers
    right = httpx.post(ui.url + "/ui/login", data={"key": ADMIN, "next": "https://evil.example/"})
    assert right.status_code == 303 and right.headers["location"] == "/ui"  # no open redirect
    cookie = right.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
    assert ADMIN not in cookie
    with admin(ui) as client:
        assert client.get("/ui").status_code == 200
        out = client.post("/ui/logout")
        assert out.status_code == 303 and client.get("/ui").status_code == 303


def test_runs_page(ui: RunningGateway) -> None:
    with admin(ui) as client:
        page = text_of(client.get("/ui").text)
    assert RUN in page
    # policy version 2 published; groups: 2 trained, 1 dropped; last step 2; eval per version
    assert re.search(rf"{RUN} base-model 2 dropped 1 trained 2 2 ", page), page
    assert "v0: 0.250 (n=4)" in page and "v2: 0.750 (n=4)" in page


def test_runs_page_shows_reward_trend_and_trainer(ui: RunningGateway, seeded_url: str) -> None:
    """The reward of the last steps as an inline sparkline (no script: the CSP allows it) with the change, and who
    holds each run; a run whose name and trainer are hostile (written straight to the store, which the gateway's
    name check would refuse) renders inert."""
    engine = db.make_engine(seeded_url)
    try:
        upsert_run(engine, HOSTILE, {}, base_model="base-model")
        acquire_run_lease(engine, HOSTILE, HOSTILE, -5)  # expired
    finally:
        engine.dispose()
    with admin(ui) as client:
        raw = client.get("/ui").text
    page = text_of(raw)
    # Seeded: steps 1 and 2 with reward_mean 0.5 then 0.625, the worker's lease good for 10 minutes.
    assert re.search(rf"{RUN} .*?▲ 0\.625 \(\+0\.125 vs the 1 before\) ui-test-worker until \d{{4}}-", page), page
    assert '<polyline points="0.0,17.0 80.0,1.0"/>' in raw
    hostile = html.escape(HOSTILE).replace("&quot;", "&#34;")  # (as Jinja writes a quote)
    assert "<script>alert" not in raw and "<img src=x" not in raw and raw.count("<script") == 1
    assert f">{hostile}</a>" in raw and f"<code>{hostile}</code> <span class=\"expired\">lease expired</span>" in raw


def test_reward_trend_skips_steps_without_a_reward() -> None:
    assert _trend([]) is None and _trend([{"step": 1, "reward_mean": None}]) is None
    one = _trend([{"step": 1, "reward_mean": 0.25}, {"step": 2, "reward_mean": None}])
    assert one is not None and (one["last"], one["change"], one["arrow"], one["steps"]) == (0.25, None, "–", 1)
    falling = _trend([{"step": s, "reward_mean": r} for s, r in ((1, 1.0), (2, None), (3, 0.5), (4, 0.0))])
    assert falling is not None and (falling["change"], falling["arrow"]) == (-0.75, "▼")
    assert falling["points"] == "0.0,1.0 40.0,9.0 80.0,17.0"


def test_run_page_numbers(ui: RunningGateway) -> None:
    with admin(ui) as client:
        raw = client.get(f"/ui/run?name={RUN}").text
    page = text_of(raw)
    assert "groups (train) dropped 1 trained 2" in page
    assert "dropped groups zero reward variance: 1" in page
    train_total = sum(len(r) for r in TRAIN_REWARDS.values())
    eval_total = sum(len(r) for r in EVAL_REWARDS.values())
    assert f"train: {train_total} ({train_total} rewarded, 0 with untrainable calls)" in page
    assert f"eval: {eval_total} ({eval_total} rewarded" in page
    # eval: version 0 rewards 0,1,0,0 -> 0.25 ± 1.96 * 0.433 / 2; version 2: 0.75
    assert "0 4 0.250 [-0.174, 0.674]" in page and "2 4 0.750 [0.326, 1.174]" in page
    # the steps table, newest first, with the metrics the trainer logged
    assert "2 0.625 0.484 0.0045 0.998 1.120 0.010 0.640 455 1.00 1 0" in page
    assert "1 0.500 0.500 -0.0123 1.001 1.310 0.020 0.810 412 1.00 1 1 (zero reward variance: 1)" in page
    # the data the charts are drawn from: one point per step, one per eval version
    data = json.loads(re.search(r'<script type="application/json" id="run-data">(.*?)</script>', raw, re.S).group(1))
    assert [s["step"] for s in data["steps"]] == [1, 2]
    assert [s["metrics"]["reward_mean"] for s in data["steps"]] == [m["reward_mean"] for m in STEP_METRICS]
    assert [e["policy_version"] for e in data["eval"]] == sorted(EVAL_REWARDS)


def test_group_page_side_by_side(ui: RunningGateway) -> None:
    with admin(ui) as client:
        page = text_of(client.get("/ui/group?id=g0").text)
        dropped = text_of(client.get("/ui/group?id=g2").text)
    # rewards 1,0,1,0: population std 0.5, advantages +-1 (as trainer.samples computes them)
    for i, value in enumerate(TRAIN_REWARDS["g0"]):
        adv = "1.000" if value else "-1.000"
        assert f"g0-t{i} reward {value:.3f} · advantage {adv}" in page
        assert f"judge: answer for g0-t{i} checked against the directory" in page
    assert "trained at step 1" in page and "→ search(" in page and "Oslo" in page
    assert "dropped: zero reward variance" in dropped


def test_advantages_match_the_trainer() -> None:
    from trainer.samples import group_advantages

    for rewards in ([1.0, 0.0, 1.0, 0.0], [0.2, 0.9, 0.4], [0.5, 0.5]):
        for mode in ("group", "drgrpo"):
            assert advantages(rewards, mode) == pytest.approx(group_advantages(rewards, mode))  # type: ignore[arg-type]


def test_trajectory_page(ui: RunningGateway) -> None:
    with admin(ui) as client:
        raw = client.get("/ui/trajectory?id=g0-t0").text
    page = text_of(raw)
    assert "turn 0" in page and "turn 1" in page
    assert "policy version 0 · latency 81 ms · finish tool_calls" in page
    assert "finish stop" in page and "trainable" in page
    assert '→ search({"query":' in page  # the tool call the model made
    assert "tool (call_1)" in page and "Zenpri Ushven" in page  # the tool's result, as the agent sent it back
    assert "extends turn 0 : trained in the same row" in page and "first call: starts a row" in page
    tokens = TOKEN.findall(raw)
    assert len(tokens) == 6 + 5  # the two calls' completion tokens
    assert {mark for _, mark, _, _, _, _, _ in tokens} == {"trained"}  # trainable calls of a trajectory step 1 trained
    assert tokens[0][0] == "lp-forced" and tokens[0][4] == "–"  # the factory's first logprob is vLLM's -inf
    assert all(cls.startswith("lp") for cls, *_ in tokens)


def test_trajectory_page_shows_token_text_from_vllm(seeded_url: str, upstream: FakeUpstream, tmp_path: Path) -> None:
    """The page asks vLLM's completions derender for its tokens' strings in one request (replayed from the real
    server: tests/fixtures/vllm/ui_token_text.json) and shows each token as its text, the id and logprob on hover;
    a token holding only part of a character shows '·' and the token completing it the whole character. Shown
    again, the page asks nothing: a call's strings are kept by its id."""
    upstream.mode = "replay"
    before = len(upstream.received)
    with running_gateway(
        database_url=seeded_url, upstream_url=upstream.base_url, base_model="smollm2", spool_dir=tmp_path / "spool",
        admin_key=ADMIN,
    ) as gw, admin(gw) as client:  # fmt: skip
        pages = [client.get(f"/ui/trajectory?id={TOKEN_TEXT_TRAJECTORY}").text for _ in range(2)]
    asked = [body for body in upstream.received[before:] if "generate_responses" in body]
    assert asked == [derender_body(TOKEN_TEXT_IDS)]
    expected = [text for texts in TOKEN_TEXTS for text in texts]
    for raw in pages:
        tokens = TOKEN.findall(raw)
        assert [int(t[3]) for t in tokens] == [i for ids in TOKEN_TEXT_IDS for i in ids]
        assert [html.unescape(t[6]) for t in tokens] == [text or "·" for text in expected]
        assert [bool(t[2]) for t in tokens] == [text == "" for text in expected]
        assert all(t[5] == " · part of a character a later token completes" for t in tokens if t[2])
        assert "token ids shown, not text" not in raw


def test_token_text_batches_and_cache() -> None:
    """Calls go to vLLM in requests of at most TOKENS_PER_REQUEST tokens (a longer call alone), in order; the cache
    drops the least recently shown call first once it holds more strings than its bound."""
    assert batches([3, 5, 2, 10, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
    assert batches([], 8) == []
    cache = TokenTextCache(max_tokens=5)
    cache.put("a", ["x"] * 2)
    cache.put("b", ["y"] * 2)
    assert cache.get("a") == ["x", "x"]  # "a" is now the most recently shown
    cache.put("c", ["z"] * 2)  # 6 > 5: "b" goes
    assert cache.get("b") is None and cache.get("a") == ["x", "x"] and cache.get("c") == ["z", "z"]


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("forbidden", f"vLLM answered 403 on {DERENDER_COMPLETIONS} (start vLLM with --enable-scale-out)"),
        ("hang", f"vLLM did not answer {DERENDER_COMPLETIONS} in 0.5 s"),
        ("down", "vLLM unreachable: ClientConnectorError"),
    ],
)
def test_token_ids_when_vllm_cannot_say_their_text(seeded_url: str, tmp_path: Path, mode: str, why: str) -> None:
    """vLLM started without --enable-scale-out, hanging, or down: the page still renders, with the ids, and says
    why."""
    fake = FakeUpstream().start()
    upstream_url = fake.base_url
    if mode == "down":
        fake.stop()
    else:
        fake.mode = mode
    try:
        with running_gateway(
            database_url=seeded_url, upstream_url=upstream_url, base_model="smollm2", spool_dir=tmp_path / "spool",
            admin_key=ADMIN, ui_token_text_timeout_s=0.5,
        ) as gw, admin(gw) as client:  # fmt: skip
            response = client.get(f"/ui/trajectory?id={TOKEN_TEXT_TRAJECTORY}")
    finally:
        fake.stop()
    assert response.status_code == 200
    assert f"token ids shown, not text: {why}" in text_of(response.text)
    tokens = TOKEN.findall(response.text)
    assert [t[6] for t in tokens] == [str(i) for ids in TOKEN_TEXT_IDS for i in ids]


def test_trajectory_page_draws_the_call_tree(ui: RunningGateway) -> None:
    """The seeded tree (a supervisor's turn 0; its sub-agent's turn 1, a new root; turn 2 resuming turn 0; turn 3 a
    parallel branch off turn 0; turn 4 going on from turn 2) as SVG: a node per call linking to it, an edge per
    parent, each root's break reason, one lane per branch."""
    with admin(ui) as client:
        raw = client.get(f"/ui/trajectory?id={TREE_TRAJECTORY}").text
    svg = re.search(r'<svg id="call-tree".*?</svg>', raw, re.S).group(0)
    nodes = re.findall(
        r'<a href="#turn-(\d+)-(\d+)"><circle class="tree-node (\w+)[^"]*" cx="([\d.]+)" cy="([\d.]+)"[^>]*>'
        r'<title>[^<]*</title></circle><text class="tree-label[^"]*"[^>]*>([^<]*)</text></a>',
        svg,
    )
    assert [html.unescape(n[5]) for n in nodes] == [
        "turn 0 · first call",
        "turn 1 · new root: new_root",
        "turn 2 · extends turn 0",
        "turn 3 · fork of turn 0",
        "turn 4 · extends turn 2",
    ]
    assert [n[2] for n in nodes] == ["root", "root", "extends", "fork", "extends"]
    assert len(re.findall(r'<path class="tree-edge"', svg)) == 3
    for turn, choice, *_ in nodes:  # every node links to its call's section
        assert f'<section class="call" id="turn-{turn}-{choice}">' in raw
    x = [float(n[3]) for n in nodes]
    assert x[0] == x[2] == x[4] and len({x[0], x[1], x[3]}) == 3  # the supervisor's lane, the sub-agent's, the fork's
    assert [float(n[4]) for n in nodes] == sorted(float(n[4]) for n in nodes)  # time reads downwards
    assert 'class="tree-label tree-break"' in svg and svg.count("tree-break") == 1  # the sub-agent's new root
    page = text_of(raw)
    assert "new row: new_root" in page
    assert "fork: extends turn 0 , whose branch goes on in another call: a new row" in page
    assert "extends turn 2 : trained in the same row" in page
    # each call shows what it added to its tree parent's messages; only the sub-agent's root shows its whole prompt
    sections = re.findall(r'<section class="call" id="turn-(\d+)-0">(.*?)</section>', raw, re.S)
    assert [turn for turn, body in sections if "the whole prompt is shown" in body] == ["1"]
    assert "Bergen, or Oslo" in page and "Are you sure?" in page


def test_call_tree_lanes_are_reused_once_a_branch_ends() -> None:
    """Roots one after another (a chat-mode agent whose template drops tool calls) stay in one column; a fork takes
    a lane from its parent's row on, and a later root reuses the lane once that fork has ended."""

    def call(seq: int, parent: int | None, branch: int, reason: str = "extends", fork: bool = False) -> dict[str, Any]:
        return {"seq": seq, "choice_index": 0, "turn": seq, "parent": {"seq": parent, "choice_index": 0} if parent
                is not None else None, "branch": branch, "parent_turn": parent, "parent_choice": 0 if parent is not
                None else None, "fork": fork, "merge_reason": reason, "trainable": True}  # fmt: skip

    chain = tree_layout([call(0, None, 0, "first_call"), call(1, None, 1, "template_dropped_tool_call"),
                         call(2, None, 2, "template_dropped_tool_call")])  # fmt: skip
    assert len({n.x for n in chain.nodes}) == 1 and chain.edges == []
    assert [n.label for n in chain.nodes][1] == "turn 1 · new root: template_dropped_tool_call"
    forked = tree_layout([
        call(0, None, 0, "first_call"), call(1, 0, 0), call(2, 0, 2, fork=True), call(3, None, 3, "compacted"),
        call(4, 1, 0),
    ])  # fmt: skip
    x = [n.x for n in forked.nodes]
    assert x[0] == x[1] == x[4] and x[2] > x[0] and x[3] == x[2]  # the compacted root reuses the fork's lane
    assert len(forked.edges) == 3 and forked.edges[1].startswith(f"M{x[0]:g},") and " C" in forked.edges[1]
    assert [n.kind for n in forked.nodes] == ["root", "extends", "fork", "root", "extends"]


def test_hostile_content_renders_inert(ui: RunningGateway) -> None:
    with admin(ui) as client:
        for path in ("/ui/trajectory?id=g0-t1", "/ui/trajectories?run=" + RUN):
            raw = client.get(path).text
            assert "<script>alert" not in raw and "<img src=x" not in raw
        raw = client.get("/ui/trajectory?id=g0-t1").text
    assert html.escape(HOSTILE, quote=False) in raw.replace("&#34;", '"').replace("&#39;", "'")
    assert raw.count("<script") == 1  # only our own script tag (src), nothing from the data


def test_trajectory_search_keyset_pages(ui: RunningGateway) -> None:
    everything = [tid for rewards in (TRAIN_REWARDS, {f"eval-v{v}": r for v, r in EVAL_REWARDS.items()})
                  for group, values in rewards.items() for tid in (f"{group}-t{i}" for i in range(len(values)))]  # fmt: skip
    seen: list[str] = []
    with admin(ui) as client:
        url = f"/ui/trajectories?run={RUN}&limit=7"
        pages = 0
        while url:
            raw = client.get(url).text
            seen += re.findall(r'href="/ui/trajectory\?id=([^"]+)"', raw)
            found = re.search(r'id="next-page" href="([^"]+)"', raw)
            url = html.unescape(found.group(1)) if found else ""
            pages += 1
        assert pages == 3 and len(seen) == len(everything) == len(set(seen))
        assert sorted(seen) == sorted(everything)
        winners = client.get(f"/ui/trajectories?run={RUN}&mode=train&reward_min=1").text
        ids = re.findall(r'href="/ui/trajectory\?id=([^"]+)"', winners)
        expected = {f"{g}-t{i}" for g, r in TRAIN_REWARDS.items() for i, v in enumerate(r) if v >= 1}
        assert set(ids) == expected
        evals = re.findall(r'href="/ui/trajectory\?id=([^"]+)"', client.get("/ui/trajectories?group=eval-v2").text)
        assert sorted(evals) == [f"eval-v2-t{i}" for i in range(4)]
        none = client.get(f"/ui/trajectories?run={RUN}&untrainable=yes").text
        assert "no trajectory matches" in none
        assert assert_openai_error(client.get(f"/ui/trajectories?run={RUN}&after=%%%"), 400)["code"] == "invalid_value"
        assert assert_openai_error(client.get(f"/ui/trajectories?run={RUN}&reward_min=nan"), 422)["code"] == "invalid_value"
        assert assert_openai_error(client.get(f"/ui/trajectories?run={RUN}&mode=both"), 422)["code"] == "invalid_value"
        assert assert_openai_error(client.get("/ui/trajectory?id=nope"), 404)["code"] == "trajectory_not_found"
        assert assert_openai_error(client.get("/ui/run?name=nope"), 404)["code"] == "run_not_found"


def test_live_steps_reach_the_page_stream(ui: RunningGateway, seeded_url: str) -> None:
    engine = db.make_engine(seeded_url)
    try:
        with admin(ui) as client, client.stream("GET", f"/ui/events?run={RUN}&after=2") as stream:
            assert stream.status_code == 200
            add_step(engine, 3, 0.875)
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    step = json.loads(line[6:])
                    break
    finally:
        engine.dispose()
    assert step["step"] == 3 and step["metrics"]["reward_mean"] == 0.875


def test_open_gateway_says_so(upstream: FakeUpstream, tmp_path: Path) -> None:
    with running_gateway(
        database_url=f"sqlite:///{tmp_path / 'open.db'}", upstream_url=upstream.base_url, base_model="smollm2",
        spool_dir=tmp_path / "spool",
    ) as gw:  # fmt: skip
        page = httpx.get(gw.url + "/ui")
        assert page.status_code == 200 and "Auth is off" in page.text and "No runs yet" in page.text
        assert httpx.get(gw.url + "/ui/static/ui.js").status_code == 200
        assert httpx.get(gw.url + "/ui/login").status_code == 303
        assert httpx.post(gw.base_url + "/runs", json={"name": "fresh"}).status_code == 201
        fresh = httpx.get(gw.url + "/ui/run?name=fresh")
        assert fresh.status_code == 200 and "no rewarded eval trajectories yet" in fresh.text
        assert "fresh" in httpx.get(gw.url + "/ui/trajectories?run=fresh").text
