"""Several gateways on one Postgres with no sticky sessions (gateway/recorder/heartbeat.py): a reward, close or judge request
reaching one gateway counts the calls another gateway answered but has not yet written.

The other gateway's writer is slowed by a hidden fault (its database writes wait at a gate the test opens, or sleep
before each batch), so its calls are certainly unwritten when the request arrives: without the wait for it the
reward would be a 404, the close would find no group, the judge would score half a group, and a group could turn
ready without its last call.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from sqlalchemy import insert, select

from gateway.judge.worker import JudgeWorker
from gateway.recorder.writer import RecordWriter
from gateway.runs.settings import load_settings
from gateway.store import peers as peer_store
from gateway.store.db import READY_CHANNEL, make_engine
from gateway.store.models import GatewayPeer, PolicyVersion
from gateway.store.training import acquire_run_lease, commit_step
from tests.support.fake_judge import FakeJudge, judge_block
from tests.support.fake_upstream import FakeUpstream
from tests.support.fake_vllm_admin import FakeAdmin
from tests.support.gateway_harness import RunningGateway, running_gateway, start_serve
from tests.support.openai_calls import assert_openai_error, client_body
from tests.support.stored import stored_calls
from tests.support.trajectories import group, make_calls, reward
from tests.support.waiting import wait_until
from trainer.worker.publish import Publisher


@pytest.fixture(scope="module")
def fake_judge() -> Iterator[FakeJudge]:
    judge = FakeJudge().start()
    yield judge
    judge.stop()


@contextmanager
def two_gateways(upstream: FakeUpstream, pg_url: str, tmp_path: Path, **overrides: Any) -> Iterator[
    tuple[RunningGateway, RunningGateway]
]:  # fmt: skip
    """Two gateway processes' worth of state (own engine, writer, spool, heartbeat) on one Postgres."""
    settings = {"database_url": pg_url, "upstream_url": upstream.base_url, "base_model": "smollm2", **overrides}
    with ExitStack() as stack:
        a = stack.enter_context(running_gateway(**settings, spool_dir=tmp_path / "a"))
        b = stack.enter_context(running_gateway(**settings, spool_dir=tmp_path / "b"))
        yield a, b


def hold_writes(gw: RunningGateway, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """This gateway's writer (only this one's) waits at the gate before each database write, at most 60 s."""
    writer: RecordWriter = gw.app.state.writer
    gate = threading.Event()
    real_write = writer._write

    def held_write(*batch: Any) -> bool:
        gate.wait(60)
        return real_write(*batch)

    monkeypatch.setattr(writer, "_write", held_write)
    return gate


def slow_writes(gw: RunningGateway, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """This gateway's writer sleeps 0.1-0.4 s before each batch: behind the other one by that much, all the time."""
    writer: RecordWriter = gw.app.state.writer
    rng = random.Random(seed)
    real_write = writer._write

    def slow_write(*batch: Any) -> bool:
        time.sleep(rng.uniform(0.1, 0.4))
        return real_write(*batch)

    monkeypatch.setattr(writer, "_write", slow_write)


@contextmanager
def ready_notifications(pg_url: str) -> Iterator[list[str]]:
    """Every NOTIFY on the ready channel while the block runs (one per group that turned ready), in a list."""
    received: list[str] = []
    conn = psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True)
    conn.execute(f"LISTEN {READY_CHANNEL}")
    try:
        yield received
    finally:
        received.extend(n.payload for n in conn.notifies(timeout=1.0))
        conn.close()


def call_ids(pg_url: str, trajectory_id: str) -> list[str]:
    return [call["id"] for call in stored_calls(pg_url, trajectory_id)]


def answer(gw: RunningGateway, upstream: FakeUpstream, trajectory: str, group_id: str, size: int | None) -> str:
    """One chat call; the X-Request-Id the gateway answered with (the stored call's id)."""
    headers = {"X-Trajectory-Id": trajectory, "X-Group-Id": group_id}
    if size is not None:
        headers["X-Group-Size"] = str(size)
    response = httpx.post(f"{gw.base_url}/chat/completions", json=client_body(upstream.fixture("chat")),
                          headers=headers, timeout=30)  # fmt: skip
    assert response.status_code == 200, response.text
    return response.headers["x-request-id"]


def test_rewards_on_the_other_gateway_wait_for_its_writer(
    upstream: FakeUpstream, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four trajectories of two calls split between the gateways and one answered by B alone, every reward posted
    to A while B's writer is held: no 404, the group turns ready exactly once, with every call in it, in the order
    the calls were answered."""
    with two_gateways(upstream, pg_url, tmp_path) as (a, b), ready_notifications(pg_url) as notified:
        gate = hold_writes(b, monkeypatch)
        answered: dict[str, list[str]] = {}
        for i in range(4):
            first, second = (b, a) if i % 2 == 0 else (a, b)
            answered[f"w-{i}"] = [answer(gw, upstream, f"w-{i}", "g-wrong", 5) for gw in (first, second)]
        answered["w-b"] = [answer(b, upstream, "w-b", "g-wrong", 5)]
        a.flush()
        assert call_ids(pg_url, "w-1") == answered["w-1"][:1]  # B's calls are not in the database yet
        threading.Timer(0.5, gate.set).start()  # B's writer catches up half a second later
        with ThreadPoolExecutor(len(answered)) as pool:
            responses = list(pool.map(lambda tid: reward(a, tid, 0.5), answered))
        assert [r.status_code for r in responses] == [200] * len(answered), [r.text for r in responses]
        assert sum(r.json()["group_ready"] for r in responses) == 1  # the last reward flipped it, no other
        # Every call is in the database the moment the rewards are answered (nobody flushed B), in answer order.
        assert {tid: call_ids(pg_url, tid) for tid in answered} == answered
        view = group(a, "g-wrong")
        assert (view["state"], view["size"], view["rewarded"]) == ("ready", 5, 5)
        assert sorted(t["calls"] for t in view["trajectories"]) == [1, 2, 2, 2, 2]
    assert notified == ["my-agent"]


def test_close_and_judge_on_the_other_gateway(
    upstream: FakeUpstream, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_judge: FakeJudge
) -> None:
    with two_gateways(upstream, pg_url, tmp_path, judge_api_bases=fake_judge.base_url) as (a, b):
        judge = judge_block(fake_judge)
        created = httpx.post(f"{a.base_url}/runs", json={"name": "my-agent", "config": {"judge": judge}})
        assert created.status_code in (200, 201), created.text
        fake_judge.reset(auto=True)
        gate = hold_writes(b, monkeypatch)
        # A group only B answered, closed through A: without the wait, A has never heard of it (404).
        make_calls(b, upstream, ["c-0", "c-1"], group="g-close")
        threading.Timer(0.5, gate.set).start()
        closed = httpx.post(f"{a.base_url}/groups/g-close/close", timeout=60)
        assert closed.status_code == 200, closed.text
        assert closed.json()["group_state"] == "open"  # complete now, waiting for its rewards
        assert reward(a, "c-0", 1.0).json()["group_ready"] is False
        assert reward(a, "c-1", 0.0).json()["group_ready"] is True
        assert [t["calls"] for t in group(a, "g-close")["trajectories"]] == [1, 1]

        # A group half answered by B, judged through A: the judge scores all of it.
        gate.clear()
        make_calls(a, upstream, ["j-a"], group="g-judge", size=2)
        make_calls(b, upstream, ["j-b"], group="g-judge", size=2)
        threading.Timer(0.5, gate.set).start()
        judged = httpx.post(f"{a.base_url}/groups/g-judge/judge", timeout=60)
        assert judged.status_code == 200, judged.text
        assert sorted(item["trajectory_id"] for item in judged.json()["data"]) == ["j-a", "j-b"]
        assert judged.json()["group_state"] == "ready"


def test_judge_worker_waits_for_every_gateway(
    upstream: FakeUpstream, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_judge: FakeJudge
) -> None:
    """`trajgate judge` judges a group once it reaches its size; a trajectory's last call still in B's writer must
    be in what the judge reads."""
    with two_gateways(upstream, pg_url, tmp_path, judge_api_bases=fake_judge.base_url) as (a, b):
        judge = judge_block(fake_judge, settle_s=0)  # judge a group as soon as it has its size
        created = httpx.post(f"{a.base_url}/runs", json={"name": "my-agent", "config": {"judge": judge}})
        assert created.status_code in (200, 201), created.text
        fake_judge.reset(auto=True)
        gate = hold_writes(b, monkeypatch)
        make_calls(a, upstream, ["jw-a", "jw-b"], group="g-worker", size=2)
        make_calls(b, upstream, ["jw-b"], group="g-worker", size=2)  # jw-b's second, last call
        a.flush()
        threading.Timer(0.5, gate.set).start()
        worker = JudgeWorker(
            load_settings(_env_file=None, database_url=pg_url, judge_api_bases=fake_judge.base_url), "my-agent"
        )
        try:
            assert asyncio.run(worker.judge_pending()).judged == 1
        finally:
            worker.close()
        (request,) = fake_judge.received
        prompt = json.dumps(request["messages"])
        assert 'Trajectory \\"jw-b\\" (2 model calls)' in prompt, prompt
        assert group(a, "g-worker")["state"] == "ready"


def test_many_episodes_across_two_gateways_one_of_them_slow(
    upstream: FakeUpstream, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Episodes whose calls and rewards land on either gateway at random while B's writer runs 0.1-0.4 s behind:
    no 404, each group ready exactly once and complete, nothing lost."""
    groups, size, turns = 4, 3, 2
    rng = random.Random(7)
    with two_gateways(upstream, pg_url, tmp_path) as (a, b), ready_notifications(pg_url) as notified:
        slow_writes(b, monkeypatch, seed=7)
        plans = [
            (f"g-many-{g}", f"m-{g}-{t}", [rng.choice((a, b)) for _ in range(turns)], rng.choice((a, b)))
            for g in range(groups)
            for t in range(size)
        ]

        def episode(plan: tuple[str, str, list[RunningGateway], RunningGateway]) -> tuple[httpx.Response, bool]:
            group_id, tid, gateways, rewarded_by = plan
            ids = [answer(gw, upstream, tid, group_id, size) for gw in gateways]
            response = reward(rewarded_by, tid, 1.0 if tid.endswith("0") else 0.0)
            # Read as soon as the reward is answered: every call there, in the order answered.
            return response, call_ids(pg_url, tid) == ids

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(episode, plans))
        assert [response.status_code for response, _ in results] == [200] * len(plans)
        assert [complete for _, complete in results] == [True] * len(plans)
        flips = [response.json()["group_id"] for response, _ in results if response.json()["group_ready"]]
        assert sorted(flips) == [f"g-many-{g}" for g in range(groups)]
    assert notified == ["my-agent"] * groups


def test_who_is_waited_for(upstream: FakeUpstream, pg_url: str, tmp_path: Path) -> None:
    """A gateway silent past TRAJGATE_PEER_ALIVE_S is not waited for; a live one that never catches up is waited
    for TRAJGATE_PEER_WAIT_S, then the request is a 503 and nothing is stored; a gateway that stops removes itself.
    The other gateways here are rows only, so nothing depends on how fast one beats."""
    settings = {"database_url": pg_url, "upstream_url": upstream.base_url, "base_model": "smollm2"}
    engine = make_engine(pg_url)
    try:
        with running_gateway(**settings, spool_dir=tmp_path, peer_wait_s=0.5, peer_alive_s=5) as gw:
            make_calls(gw, upstream, ["p-0"], group="g-peers", size=1)
            with engine.begin() as conn:
                now = peer_store.clock(conn)
                conn.execute(insert(GatewayPeer).values(gateway_id="dead", started_at=now - 60, seen_at=now - 6))
            assert reward(gw, "p-0", 1.0).json()["group_ready"] is True
            assert _timeouts(gw) == 0  # the dead gateway was not waited for
            with engine.begin() as conn:
                conn.execute(insert(GatewayPeer).values(gateway_id="stuck", started_at=now, seen_at=now + 3600))
            response = reward(gw, "p-0", 0.5)
            refused = assert_openai_error(response, 503)  # waited 0.5 s for "stuck", then refused
            assert refused["code"] == "gateways_behind" and "stuck" in refused["message"]
            assert response.headers["retry-after"] == "1"
            assert group(gw, "g-peers")["trajectories"][0]["reward"] == 1.0  # nothing stored
            closed = httpx.post(f"{gw.base_url}/groups/g-peers/close", timeout=30)
            assert_openai_error(closed, 503)
            assert _timeouts(gw) == 2
            with engine.connect() as conn:
                ids = set(conn.execute(select(GatewayPeer.gateway_id)).scalars())
            assert ids == {gw.app.state.peers.gateway_id, "dead", "stuck"}
        with engine.connect() as conn:
            assert set(conn.execute(select(GatewayPeer.gateway_id)).scalars()) == {"dead", "stuck"}
    finally:
        engine.dispose()


def _timeouts(gw: RunningGateway) -> float:
    return gw.app.state.metrics.peer_wait_timeouts._value.get()


def test_two_serve_processes(upstream: FakeUpstream, pg_url: str, tmp_path: Path) -> None:
    """`trajgate serve` twice, as users run it: each episode's call answered by one process and its reward posted to
    the other at once (its record is still in the first one's writer batch), then SIGTERM: both leave gateway_peers."""
    processes = [start_serve(upstream.base_url, pg_url, tmp_path / name) for name in ("a", "b")]
    body = client_body(upstream.fixture("chat"))
    try:
        urls = [f"http://127.0.0.1:{port}/v1" for _, _, port in processes]
        engine = make_engine(pg_url)
        try:
            with engine.connect() as conn:
                assert len(conn.execute(select(GatewayPeer.gateway_id)).all()) == 2  # each beat before serving
        finally:
            engine.dispose()
        responses = []
        with httpx.Client(timeout=60) as client:
            for i in range(8):
                headers = {"X-Trajectory-Id": f"s-{i}", "X-Group-Id": f"g-serve-{i // 2}", "X-Group-Size": "2"}
                answered = client.post(f"{urls[i % 2]}/chat/completions", json=body, headers=headers)
                assert answered.status_code == 200, answered.text
                responses.append(client.post(f"{urls[1 - i % 2]}/trajectories/s-{i}/reward", json={"reward": i % 2}))
        assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses]
        assert [r.json()["group_ready"] for r in responses] == [False, True] * 4
    finally:
        for process, output, _ in processes:
            process.terminate()
            assert process.wait(60) in (0, -signal.SIGTERM), output.finish()  # uvicorn re-raises it when done
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(select(GatewayPeer.gateway_id)).all() == []  # a clean stop removes the row
    finally:
        engine.dispose()


def test_a_retired_adapter_is_unloaded_only_once_every_gateway_stopped_routing_to_it(
    upstream: FakeUpstream, pg_url: str, tmp_path: Path
) -> None:
    """keep 1: publishing step 2 retires step 1's adapter. Gateway B's route table still names it (its background
    reload is stopped), so the trainer leaves it loaded in vLLM, however often it looks, until B has reloaded its
    routes and said so in its heartbeat; then it is unloaded. Unloading at once left B routing calls to an adapter
    vLLM no longer had (404s)."""
    run, trainer = "my-agent", "trainer"
    with two_gateways(upstream, pg_url, tmp_path) as (a, b):
        assert httpx.post(a.base_url + "/runs", json={"name": run}, timeout=30).status_code in (200, 201)
        engine = make_engine(pg_url)
        try:
            acquire_run_lease(engine, run, trainer, 600)
            vllm = FakeAdmin("vllm")
            publisher = Publisher(engine, vllm, run, lambda step: tmp_path / f"{step}", keep=1, echo=lambda _: None,
                                  alive_s=60)  # type: ignore[arg-type]  # fmt: skip

            def step(n: int) -> None:
                commit_step(engine, run, n, trainer, [], {}, trajectory_ids=[], lease_holder=trainer)
                assert publisher.publish(n, time.perf_counter())

            step(1)
            for gw in (a, b):
                wait_until(lambda gw=gw: gw.app.state.router.resolve(run, "smollm2").version == 1, 10,
                           "the gateway to route step 1")  # fmt: skip

            async def frozen() -> None:
                return None

            b.app._refresh_routes = frozen  # type: ignore[method-assign]  # B keeps routing step 1
            step(2)
            wait_until(lambda: a.app.state.router.resolve(run, "smollm2").version == 2, 10, "A to route step 2")
            retired_at = _retired_at(engine, run, 1)
            wait_until(lambda: _routes_read_at(engine, a) > retired_at, 10, "A's heartbeat past the retirement")
            publisher.reconcile()  # only B holds the adapter now
            assert f"{run}@1" in vllm.served
            assert b.app.state.router.resolve(run, "smollm2").served_name == f"{run}@1"
            assert _version_status(engine, run, 1) == "retiring"

            b.app.state.router.refresh(b.app.state.engine)  # B reloads its routes: step 1 is gone from them

            def unloaded() -> bool:
                publisher.reconcile()
                return f"{run}@1" not in vllm.served

            wait_until(unloaded, 10, "step 1's adapter to be unloaded once B reloaded its routes")
            assert _version_status(engine, run, 1) == "unloaded"
            assert vllm.served == {f"{run}@2"}
        finally:
            engine.dispose()


def _version_status(engine: Any, run: str, step: int) -> str:
    with engine.connect() as conn:
        return conn.execute(
            select(PolicyVersion.status).where(PolicyVersion.run == run, PolicyVersion.step == step)
        ).scalar_one()


def _retired_at(engine: Any, run: str, step: int) -> float:
    with engine.connect() as conn:
        return conn.execute(
            select(PolicyVersion.retired_at).where(PolicyVersion.run == run, PolicyVersion.step == step)
        ).scalar_one()


def _routes_read_at(engine: Any, gw: RunningGateway) -> float:
    with engine.connect() as conn:
        read_at = conn.execute(
            select(GatewayPeer.routes_read_at).where(GatewayPeer.gateway_id == gw.app.state.peers.gateway_id)
        ).scalar_one_or_none()
    return read_at or 0.0
