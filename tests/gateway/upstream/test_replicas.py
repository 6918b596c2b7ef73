"""Several vLLM replicas behind one gateway: stickiness, least-loaded placement, failover, adapters per replica.

The replicas are FakeUpstreams replaying real vLLM recordings; the trainer side uses stand-ins for VllmAdmin (its
HTTP side is exercised against real vLLM in tests/e2e), as tests/trainer/worker/test_trainer_loop.py does."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import httpx
import pytest

from gateway.runs.settings import load_settings
from gateway.store import db
from gateway.store.runs import upsert_run
from gateway.store.training import acquire_run_lease, commit_step, loaded_versions
from gateway.upstream import replicas as replicas_module
from gateway.upstream.replicas import Replicas
from tests.support.fake_upstream import FakeUpstream
from tests.support.fake_vllm_admin import FakeAdmin
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.openai_calls import client_body, sdk
from tests.support.stored import stored_calls
from tests.support.token_in_agent import client_for, start_token_in, tool_loop
from tests.support.waiting import wait_until
from trainer.worker.publish import Publisher, VllmReplicas, vllm_admin


@pytest.fixture
def fakes() -> Iterator[list[FakeUpstream]]:
    started = [FakeUpstream().start() for _ in range(2)]
    yield started
    for fake in started:
        fake.stop()


@pytest.fixture
def replicated(fakes: list[FakeUpstream], sqlite_url: str, tmp_path: Path) -> Iterator[RunningGateway]:
    urls = ",".join(fake.base_url for fake in fakes)
    settings = {"database_url": sqlite_url, "upstream_url": urls, "base_model": "smollm2", "spool_dir": tmp_path}
    with running_gateway(**settings, replica_probe_s=60) as gw:  # probed once at start: the tests decide the rest
        yield gw


def chat(gw: RunningGateway, fake: FakeUpstream, trajectory: str) -> None:
    body = client_body(fake.fixture("chat"))
    sdk(gw, **{"X-Trajectory-Id": trajectory, "X-Group-Id": "g"}).chat.completions.create(**body)


def counts(fakes: list[FakeUpstream]) -> list[int]:
    return [len(fake.received) for fake in fakes]


def test_one_url_is_one_replica_and_a_list_is_several() -> None:
    assert load_settings(_env_file=None, upstream_url="http://vllm:8000/v1/").upstream_urls == ["http://vllm:8000/v1"]
    several = load_settings(_env_file=None, upstream_url=" http://a:8000/v1, http://b:8000/v1 ,")
    assert several.upstream_urls == ["http://a:8000/v1", "http://b:8000/v1"]


@pytest.mark.parametrize("value", ["http://a/v1,ftp://b/v1", "http://a/v1,http://a/v1", " , "])
def test_bad_replica_lists_are_refused_at_start(value: str) -> None:
    with pytest.raises(Exception, match="TRAJGATE_UPSTREAM_URL"):
        load_settings(_env_file=None, upstream_url=value)


def test_a_trajectory_sticks_to_its_replica(replicated: RunningGateway, fakes: list[FakeUpstream]) -> None:
    chat(replicated, fakes[0], "t1")
    first = counts(fakes)
    for _ in range(3):
        chat(replicated, fakes[0], "t1")
    after = counts(fakes)
    home = first.index(1)
    assert after[home] == 4 and after[1 - home] == 0  # every call of t1 went where its first one did
    chat(replicated, fakes[0], "t2")  # a new trajectory goes to the idle replica with fewer trajectories
    assert counts(fakes)[1 - home] == 1


def test_a_token_in_trajectory_renders_generates_and_derenders_on_one_replica(
    replicated: RunningGateway, fakes: list[FakeUpstream], sqlite_url: str
) -> None:
    start_token_in(replicated)
    for trajectory, stream in (("loop-a", False), ("loop-b", True)):
        before = counts(fakes)
        tool_loop(client_for(replicated, trajectory), stream)
        grew = [after - was for after, was in zip(counts(fakes), before, strict=True)]
        assert sorted(grew)[0] == 0 and sorted(grew)[1] >= 9  # 3 turns of render(s), generate, derender(s)
    assert all(len(fake.received) for fake in fakes)  # the second trajectory went to the other replica
    replicated.flush()
    for trajectory in ("loop-a", "loop-b"):
        calls = stored_calls(sqlite_url, trajectory)
        assert [c["segment_reason"] for c in calls] == ["first_call", None, None]  # each turn extended the last


def test_new_trajectories_go_to_the_least_loaded_replica(fakes: list[FakeUpstream]) -> None:
    replicas = Replicas([fake.base_url for fake in fakes])
    a, b = replicas.all
    first, second = replicas.lease("t1", "smollm2"), replicas.lease("t2", "smollm2")
    assert (first.replica, second.replica) == (a, b)  # equally loaded: spread by trajectories placed
    busy = replicas.lease("t1", "smollm2")  # t1 sticks to a, which now has two calls in flight
    assert busy.replica is a and (a.in_flight, b.in_flight) == (2, 1)
    assert replicas.pick("t3", "smollm2") is b  # the least-loaded replica, although placement would say a
    first.release()
    busy.release()
    busy.release()  # releasing twice counts once
    assert (a.in_flight, b.in_flight) == (0, 1)
    assert replicas.pick("t4", "smollm2") is a


def test_a_release_marks_when_the_gateway_was_last_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The record writer reads `touched`, with nothing in flight, to tell a quiet gateway from one between two calls:
    each release stamps it (with none in flight, every call that started has ended); a second release of the same
    lease is no activity."""
    now = [5.0]
    monkeypatch.setattr(replicas_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    replicas = Replicas(["http://127.0.0.1:9/v1"])
    assert replicas.touched == 0.0
    lease = replicas.lease("t1", None)
    assert replicas.touched == 0.0  # a call in flight: the writer does not read it then
    now[0] = 7.5
    lease.release()
    assert replicas.touched == 7.5
    now[0] = 9.0
    lease.release()
    assert replicas.touched == 7.5


def test_sticky_map_is_bounded(fakes: list[FakeUpstream]) -> None:
    replicas = Replicas([fake.base_url for fake in fakes], sticky_max=2)
    homes = {t: replicas.pick(t, None) for t in ("t1", "t2", "t3")}
    assert len(replicas._sticky) == 2 and "t1" not in replicas._sticky  # the least recently used went first
    assert replicas.pick("t3", None) is homes["t3"]


def test_a_stopped_replica_loses_no_call_and_its_trajectory_moves(
    replicated: RunningGateway, fakes: list[FakeUpstream], sqlite_url: str
) -> None:
    chat(replicated, fakes[0], "t1")
    home = counts(fakes).index(1)
    other = 1 - home
    fakes[home].stop()  # the replica dies between two calls of the trajectory
    chat(replicated, fakes[0], "t1")  # refused connection: retried once on the other replica, answered
    chat(replicated, fakes[0], "t1")  # and the trajectory now lives there
    assert len(fakes[other].received) == 2
    replicated.flush()
    calls = stored_calls(sqlite_url, "t1")
    assert [c["status_code"] for c in calls] == [200, 200, 200] and all(c["trainable"] for c in calls)
    ready = httpx.get(replicated.url + "/ready")
    assert ready.status_code == 200  # one replica is enough to serve
    assert ready.json()["replicas"] == {fakes[home].base_url: "unreachable", fakes[other].base_url: "ok"}
    metrics = httpx.get(replicated.url + "/metrics").text
    assert f'trajgate_replica_up{{replica="{fakes[home].base_url}"}} 0.0' in metrics
    assert f'trajgate_replica_up{{replica="{fakes[other].base_url}"}} 1.0' in metrics
    latency = f'trajgate_upstream_latency_seconds_count{{endpoint="chat",replica="{fakes[other].base_url}"}}'
    assert latency + " 2.0" in metrics


def test_a_5xx_takes_a_replica_out_until_its_probe_answers(fakes: list[FakeUpstream]) -> None:
    async def scenario() -> None:
        replicas = Replicas([fake.base_url for fake in fakes])
        a, b = replicas.all
        lease = replicas.lease("t1", "smollm2")
        lease.answered(500)
        lease.release()
        assert not a.healthy and replicas.pick("t1", "smollm2") is b  # the trajectory moved on
        async with aiohttp.ClientSession() as session:
            await replicas.probe(session, {})
        assert a.healthy  # its /models answers: back in rotation
        fakes[1].stop()
        async with aiohttp.ClientSession() as session:
            await replicas.probe(session, {})
        assert not b.healthy and replicas.pick("t1", "smollm2") is a

    asyncio.run(scenario())


def test_a_replica_without_the_runs_adapter_gets_none_of_that_runs_traffic(fakes: list[FakeUpstream]) -> None:
    async def probe(replicas: Replicas) -> None:
        async with aiohttp.ClientSession() as session:
            await replicas.probe(session, {})

    replicas = Replicas([fake.base_url for fake in fakes])
    a, b = replicas.all
    fakes[0].adapters = ["r@1"]  # b restarted and forgot the adapter
    asyncio.run(probe(replicas))
    picks = [replicas.pick(f"t{i}", "r@1") for i in range(4)]
    assert picks == [a] * 4  # new trajectories of the run too, though b has placed none
    assert replicas.pick("base", "smollm2") is b  # b still serves the base model
    fakes[1].adapters = ["r@1"]  # the trainer's reconcile re-loaded it
    asyncio.run(probe(replicas))
    assert replicas.pick("t-new", "r@1") is b


def test_a_version_newer_than_the_last_probe_goes_to_replicas_that_had_the_run_not_to_a_restarted_one(
    fakes: list[FakeUpstream],
) -> None:
    """The gateway learns of a version (its route reload, once a second) before its probe of /models lists it; the
    trainer published it only once every replica it could reach loaded it, so a replica listing an earlier version of
    the run has it, and one listing none of the run's (it restarted) may not: it gets none of them until listed."""

    async def probe(replicas: Replicas) -> None:
        async with aiohttp.ClientSession() as session:
            await replicas.probe(session, {})

    replicas = Replicas([fake.base_url for fake in fakes])
    a, b = replicas.all
    fakes[0].adapters = ["r@1", "other@4"]  # b restarted: it lists nothing of r's
    fakes[1].adapters = ["other@4"]
    asyncio.run(probe(replicas))
    assert {replicas.pick(f"t{i}", "r@2") for i in range(4)} == {a}  # r@2: published since the probe
    assert replicas.usable("new@1") == [a, b]  # a new run's first version: any replica
    fakes[1].adapters = ["r@2", "other@4"]
    asyncio.run(probe(replicas))
    assert replicas.pick("t-new", "r@2") is b  # listed now


def test_models_lists_which_replicas_serve_each_name(replicated: RunningGateway, fakes: list[FakeUpstream]) -> None:
    def listed() -> dict[str, list[str]]:
        return {m["id"]: m["replicas"] for m in httpx.get(replicated.base_url + "/models").json()["data"]}

    wait_until(lambda: len(listed()["smollm2"]) == 2, 10, "both replicas probed")
    assert listed() == {"smollm2": [fake.base_url for fake in fakes]}


@pytest.fixture
def committed_step(sqlite_url: str) -> Iterator[Any]:
    db.upgrade(sqlite_url)
    engine = db.make_engine(sqlite_url)
    upsert_run(engine, "r", {}, base_model="smollm2")
    acquire_run_lease(engine, "r", "w", 60)
    commit_step(engine, "r", 1, "w", [], {}, trajectory_ids=[], lease_holder="w")
    yield engine
    engine.dispose()


def publisher_for(engine: Any, admins: list[FakeAdmin], tmp_path: Path) -> Publisher:
    replicas = VllmReplicas(admins)
    return Publisher(engine, replicas, "r", lambda step: tmp_path / str(step), echo=lambda _: None)


def test_a_version_is_published_only_once_every_reachable_replica_serves_it(
    committed_step: Any, tmp_path: Path
) -> None:
    a, b, c = FakeAdmin("a"), FakeAdmin("b"), FakeAdmin("c")
    b.refuse = True
    c.up = False  # down during the publication
    publisher = publisher_for(committed_step, [a, b, c], tmp_path)
    assert not publisher.publish(1, 0.0)  # b refused: nothing is routed to r@1 yet
    assert loaded_versions(committed_step, "r") == []
    b.refuse = False
    assert publisher.publish(1, 0.0)  # a and b serve it; c, unreachable, is skipped
    assert [v.served_name for v in loaded_versions(committed_step, "r")] == ["r@1"]
    assert (a.served, b.served, c.served) == ({"r@1"}, {"r@1"}, set())
    c.up = True  # c is back without the adapter: the trainer's reconcile loads it there, and only there
    loads = (a.loads, b.loads)
    publisher.reconcile()
    assert c.served == {"r@1"} and (a.loads, b.loads) == loads


def test_no_reachable_replica_is_a_failed_publication(committed_step: Any, tmp_path: Path) -> None:
    a, b = FakeAdmin("a"), FakeAdmin("b")
    a.up = b.up = False
    publisher = publisher_for(committed_step, [a, b], tmp_path)
    assert not publisher.publish(1, 0.0)
    assert loaded_versions(committed_step, "r") == []


def test_one_upstream_url_keeps_a_single_admin() -> None:
    assert type(vllm_admin(["http://a:8000/v1"])).__name__ == "VllmAdmin"
    assert len(vllm_admin(["http://a:8000/v1", "http://b:8000/v1"]).replicas()) == 2


def test_one_replica_remembers_no_trajectories() -> None:
    """With a single upstream every call goes to it: no placement and no sticky map growing with every trajectory
    (it held up to 100,000 entries for nothing, and the garbage collector walked them)."""
    replicas = Replicas(["http://vllm:8000/v1"])
    picked = {replicas.pick(f"t{i}", "smollm2") for i in range(1000)}
    assert picked == {replicas.all[0]} and len(replicas._sticky) == 0
