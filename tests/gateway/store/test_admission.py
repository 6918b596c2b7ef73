"""Admission at the gateway, on Postgres and SQLite: the bound on groups in flight holds under 64 concurrent
episodes, calls of an admitted group never wait, refusals are 429s with Retry-After in the OpenAI error shape,
max_staleness 0 trains every group on exactly the previous policy, and two gateways share one bound.

The trainer is scripted through the store API (claim, commit, publish), the way trainer/worker/loop.py does it, so the
tests control when room frees; the upstream is the recorded-vLLM fake. A scripted step publishes its version under
the base model's name, which the recordings answer to.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import Engine, func, select, text

from gateway.store import db
from gateway.store.admission import _bound, due_groups, trainer_figures
from gateway.store.models import Admission, Call, Group, Run, Trajectory
from gateway.store.training import (
    acquire_run_lease,
    claim_ready_groups,
    commit_step,
    count_ready_groups,
    drop_groups,
    load_groups,
    mark_unloaded,
    publish_version,
)
from tests.support.examples import load_example
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.openai_calls import assert_openai_error, client_body, sdk_kwargs
from tests.support.waiting import wait_until
from trainer.samples import CallData, GroupData, TrajectoryData, build_samples

RUN = "my-agent"  # what sdk_kwargs names the run
TRAINER = "scripted-trainer"


def create_run(gw: RunningGateway, **config: Any) -> None:
    response = httpx.post(gw.base_url + "/runs", json={"name": RUN, "config": config}, timeout=30)
    assert response.status_code in (200, 201), response.text


def take_run(engine: Engine, *gateways: RunningGateway) -> None:
    """Become the run's trainer, and wait until every gateway routes the run with admission on."""
    acquire_run_lease(engine, RUN, TRAINER, 600)
    for gw in gateways:
        wait_until(lambda gw=gw: gw.app.state.router.resolve(RUN, "smollm2").admission is not None, 10,
                   "the gateway to see the run's trainer")  # fmt: skip


def client(gw: RunningGateway, group: str, trajectory: str, size: int | None = None, mode: str = "") -> openai.OpenAI:
    prefix = "/eval" if mode == "eval" else ""
    sized = f"/n/{size}" if size else ""
    return openai.OpenAI(base_url=f"{gw.url}{prefix}/g/{group}{sized}/t/{trajectory}/v1", api_key="k", max_retries=0,
                         timeout=60)  # fmt: skip


def call(gw: RunningGateway, upstream: FakeUpstream, group: str, trajectory: str, **kw: Any) -> httpx.Response:
    """One chat call through the SDK; the raw HTTP response, whatever its status."""
    try:
        raw = client(gw, group, trajectory, **kw).chat.completions.with_raw_response.create(
            **sdk_kwargs(upstream.fixture("chat"))
        )
        return raw.http_response
    except openai.APIStatusError as exc:
        return exc.response


def reward(gw: RunningGateway, trajectory: str, value: float) -> None:
    response = httpx.post(f"{gw.base_url}/trajectories/{trajectory}/reward", json={"reward": value}, timeout=30)
    assert response.status_code == 200, response.text


@contextmanager
def engine_on(db_url: str) -> Iterator[Engine]:
    engine = db.make_engine(db_url)
    try:
        yield engine
    finally:
        engine.dispose()


class ScriptedTrainer:
    """Trains whenever `groups_per_step` groups are ready: claim, commit (groups trained), then publish the step's
    version, like trainer/worker/loop.py without the model. Remembers each step's groups with their calls' versions."""

    def __init__(self, engine: Engine, gateways: list[RunningGateway], groups_per_step: int, steps: int) -> None:
        self.engine, self.gateways, self.per_step, self.steps = engine, gateways, groups_per_step, steps
        self.trained: dict[int, dict[str, set[int]]] = {}  # step -> group -> versions of its calls
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            for step in range(1, self.steps + 1):
                wait_until(self._can_step, 60, "ready groups")
                claimed = claim_ready_groups(self.engine, RUN, TRAINER, self.per_step, 600)
                loaded = load_groups(self.engine, claimed)
                self.trained[step] = {
                    g["group_id"]: {c["policy_version"] for t in g["trajectories"] for c in t["calls"]} for g in loaded
                }
                trajectories = [t["trajectory_id"] for g in loaded for t in g["trajectories"]]
                commit_step(self.engine, RUN, step, TRAINER, claimed, {"step_seconds": 0.01},
                            trajectory_ids=trajectories, lease_holder=TRAINER)  # fmt: skip
                publish_version(self.engine, RUN, step, "smollm2", f"/adapters/{step}")
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.error = exc

    def _can_step(self) -> bool:
        """trainer/worker/loop.py's condition: enough ready groups, and none due this step still playing."""
        due = due_groups(self.engine, RUN)
        ready = count_ready_groups(self.engine, RUN) >= self.per_step
        return ready and (due.playing == 0 or due.ready >= self.per_step)

    def start(self) -> ScriptedTrainer:
        self.thread.start()
        return self

    def join(self) -> None:
        self.thread.join(120)
        assert not self.thread.is_alive(), "the scripted trainer did not finish"
        if self.error is not None:
            raise self.error


def play(gw: RunningGateway, upstream: FakeUpstream, group: str, trajectory: str, size: int, turns: int,
         value: float, later: list[float]) -> None:  # fmt: skip
    """One episode: `turns` calls, then its reward. The time each call after the first took goes to `later`."""
    for turn in range(turns):
        started = time.monotonic()
        response = call(gw, upstream, group, trajectory, size=size)
        assert response.status_code == 200, response.text
        if turn:
            later.append(time.monotonic() - started)
    reward(gw, trajectory, value)


def watch_bound(db_url: str, stop: threading.Event, seen: list[tuple[int, int, int]]) -> None:
    """Sample (in flight as admission counts it, groups recorded and not taken by the trainer yet, slots) from
    consistent snapshots of the database while the episodes run. The second is admission's bookkeeping checked from
    the other side: what the gateway recorded and the trainer has not claimed (it lags the first, never leads it)."""
    with engine_on(db_url) as engine:
        while not stop.is_set():
            with engine.connect() as conn:
                if conn.dialect.name == "postgresql":
                    conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
                config = conn.execute(select(Run.config).where(Run.name == RUN)).scalar_one()
                bound = _bound(conn, RUN, config, datetime.now(UTC))
                recorded = conn.execute(
                    select(func.count()).where(Group.run == RUN, Group.state.not_in(("claimed", "trained", "dropped")))
                ).scalar_one()
            seen.append((bound.in_flight, recorded, bound.slots))
            stop.wait(0.02)


def test_64_concurrent_episodes_never_exceed_the_bound(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    """16 groups x 4 episodes of 2 turns, all started at once; groups_per_step 2 and max_staleness 1 allow 4
    groups in flight. The bound holds in every snapshot, fills, and nothing the trainer takes is stale."""
    create_run(gateway, groups_per_step=2, max_staleness=1)
    with engine_on(db_url) as engine:
        take_run(engine, gateway)
        trainer = ScriptedTrainer(engine, [gateway], groups_per_step=2, steps=8).start()
        seen: list[tuple[int, int, int]] = []
        stop = threading.Event()
        watcher = threading.Thread(target=watch_bound, args=(db_url, stop, seen), daemon=True)
        watcher.start()
        later: list[float] = []
        with ThreadPoolExecutor(64) as pool:
            episodes = [
                pool.submit(play, gateway, upstream, f"grp-{g}", f"grp-{g}-t{t}", 4, 2, float(t), later)
                for g in range(16)
                for t in range(4)
            ]
            for episode in episodes:
                episode.result(timeout=120)
        trainer.join()
        stop.set()
        watcher.join(10)
        with engine.connect() as conn:
            admitted_at = dict(conn.execute(select(Admission.group_id, Admission.policy_version)).all())
    assert seen and all(recorded <= slots for _, recorded, slots in seen), max(seen, key=lambda s: s[1])
    assert all(in_flight <= slots for in_flight, _, slots in seen), max(seen)
    assert max(in_flight for in_flight, _, _ in seen) == 4  # the bound was reached: admission did throttle
    assert len(admitted_at) == 16  # one admission per group, not per episode
    for step, groups in trainer.trained.items():
        for group, versions in groups.items():
            assert step - 1 - min(versions) <= 1, (step, group, versions)  # never staler than max_staleness
    view = httpx.get(f"{gateway.base_url}/runs/{RUN}", timeout=30).json()["admission"]
    assert (view["admitted_groups"], view["groups_dropped_stale"], view["in_flight"]) == (16, 0, 0)
    assert view["wait_s_max"] > 0  # some groups waited for room
    assert later and len(later) == 64  # every episode's second call went through


def test_a_fleet_paced_only_by_admission_stays_within_the_bound(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    """The demo's `--fleet` (examples/harness.py `fleet`): 32 episodes kept in flight, each starting the next the moment
    it ends, no rounds. Only admission paces it: the bound holds in every snapshot, the run reaches its steps, and
    nothing trained was staler than max_staleness."""
    harness = load_example("harness")
    kwargs = sdk_kwargs(upstream.fixture("chat"))

    def episode(client: openai.OpenAI, run: str, question: int) -> Any:
        reply = client.chat.completions.create(**{**kwargs, "model": run})
        return harness.Outcome(float(question % 2), bool(question % 2), reply.choices[0].message.content or "", 0)

    task = harness.Task(train=list(range(8)), held_out=[], episode=episode, describe=lambda q: {"q": q})
    agent = harness.Agent(task, gateway.url, RUN)
    # Once the run has its steps, the episodes still waiting for room give up after a second (429, then the SDK's
    # retries) instead of holding the gateway's shutdown.
    create_run(gateway, groups_per_step=2, max_staleness=1, admission_timeout_s=1)
    with engine_on(db_url) as engine:
        take_run(engine, gateway)
        trainer = ScriptedTrainer(engine, [gateway], groups_per_step=2, steps=3).start()
        seen: list[tuple[int, int, int]] = []
        stop = threading.Event()
        watcher = threading.Thread(target=watch_bound, args=(db_url, stop, seen), daemon=True)
        watcher.start()
        try:
            assert harness.fleet(agent, steps=3, size=4, seed=0, episodes=32, poll_s=0.2)
            trainer.join()
        finally:
            stop.set()
            watcher.join(10)
    assert seen and all(in_flight <= slots for in_flight, _, slots in seen), max(seen)
    assert max(in_flight for in_flight, _, _ in seen) == 4  # 32 episodes want 8 groups: admission held them to 4
    for step, groups in trainer.trained.items():
        for group, versions in groups.items():
            assert step - 1 - min(versions) <= 1, (step, group, versions)
    assert len(trainer.trained) == 3


def test_later_calls_of_an_admitted_group_never_wait(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    """The bound is full and a new group is waiting: the admitted group's next turn, and a new trajectory joining
    it, are answered while the newcomer still waits; eval calls and calls with no trajectory id pass too."""
    create_run(gateway, groups_per_step=1, max_staleness=0, admission_timeout_s=60)
    with engine_on(db_url) as engine:
        take_run(engine, gateway)
        assert call(gateway, upstream, "first", "first-t0").status_code == 200
        with ThreadPoolExecutor(1) as pool:
            newcomer = pool.submit(call, gateway, upstream, "second", "second-t0")
            wait_until(lambda: _waiting(gateway) == 1, 10, "the newcomer to wait")
            assert call(gateway, upstream, "first", "first-t0").status_code == 200  # its next turn
            assert call(gateway, upstream, "first", "first-t1").status_code == 200  # a new trajectory of the group
            assert call(gateway, upstream, "ev", "ev-t0", mode="eval").status_code == 200  # eval: never throttled
            anonymous = httpx.post(gateway.base_url + "/chat/completions", json=_body(upstream), timeout=30)
            assert anonymous.status_code == 200  # no trajectory id: a group of one that never trains
            assert not newcomer.done() and _waiting(gateway) == 1
            for trajectory in ("first-t0", "first-t1"):
                reward(gateway, trajectory, 1.0)
            httpx.post(f"{gateway.base_url}/groups/first/close", timeout=30)
            trainer = ScriptedTrainer(engine, [gateway], groups_per_step=1, steps=1).start()
            trainer.join()
            assert newcomer.result(timeout=30).status_code == 200  # room freed by the step: admitted


def test_reject_mode_is_a_429_with_retry_after(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    create_run(gateway, groups_per_step=1, max_staleness=0, admission="reject")
    with engine_on(db_url) as engine:
        take_run(engine, gateway)
        assert call(gateway, upstream, "a", "a-t0").status_code == 200
        refused = call(gateway, upstream, "b", "b-t0")
        error = assert_openai_error(refused, 429)
        assert (error["type"], error["code"]) == ("rate_limit_error", "admission_full")
        assert int(refused.headers["retry-after"]) >= 1
        assert "max_staleness" in error["message"]
        assert call(gateway, upstream, "a", "a-t0").status_code == 200
    view = httpx.get(f"{gateway.base_url}/runs/{RUN}", timeout=30).json()["admission"]
    assert (view["mode"], view["slots"], view["in_flight"], view["rejected"]) == ("reject", 1, 1, 1)
    metrics = httpx.get(gateway.url + "/metrics", timeout=30).text
    assert f'trajgate_admission_refused_total{{reason="rejected",run="{RUN}"}} 1.0' in metrics


def test_wait_mode_times_out_cleanly(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    create_run(gateway, groups_per_step=1, max_staleness=0, admission_timeout_s=0.5)
    with engine_on(db_url) as engine:
        take_run(engine, gateway)
        assert call(gateway, upstream, "a", "a-t0").status_code == 200
        timed_out = call(gateway, upstream, "b", "b-t0")
    error = assert_openai_error(timed_out, 429)
    assert error["code"] == "admission_timeout" and "admission_timeout_s" in error["message"]
    assert timed_out.headers["retry-after"] == "1"
    assert _waiting(gateway) == 0
    view = httpx.get(f"{gateway.base_url}/runs/{RUN}", timeout=30).json()["admission"]
    assert (view["timed_out"], view["admitted_groups"]) == (1, 1)
    with engine_on(db_url) as engine, engine.connect() as conn:  # the refused call reached nobody: not recorded
        assert conn.execute(select(Trajectory.trajectory_id).where(Trajectory.group_id == "b")).first() is None


def test_a_step_not_served_yet_takes_its_room_and_drain_on_swap_all_of_it(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    """max_staleness 1, one group per step: room for 2 groups, 1 while a committed step is not served; none with
    drain_on_swap. Serving the step gives the room back."""
    create_run(gateway, groups_per_step=1, max_staleness=1, admission="reject")
    with engine_on(db_url) as engine:
        take_run(engine, gateway)
        assert call(gateway, upstream, "a", "a-t0", size=1).status_code == 200
        reward(gateway, "a-t0", 1.0)
        (claimed,) = claim_ready_groups(engine, RUN, TRAINER, 1, 600)
        commit_step(engine, RUN, 1, TRAINER, [claimed], {}, trajectory_ids=["a-t0"], lease_holder=TRAINER)
        assert call(gateway, upstream, "b", "b-t0").status_code == 200  # (1 + 1 - 1) x 1 = 1 slot, 0 in flight
        assert call(gateway, upstream, "c", "c-t0").status_code == 429
        create_run(gateway, drain_on_swap=True)
        assert call(gateway, upstream, "c", "c-t0").status_code == 429
        publish_version(engine, RUN, 1, "smollm2", "/adapters/1")
        assert call(gateway, upstream, "c", "c-t0").status_code == 200  # served: 2 slots, b in flight
        assert call(gateway, upstream, "d", "d-t0").status_code == 429


def test_a_group_dropped_by_the_step_in_training_frees_no_room(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    """The step being trained has chosen its groups: one it drops (equal rewards) leaves a hole in that step, not
    room for a new group, which could only be trained a step later (seen in the CPU demo: such groups went stale)."""
    create_run(gateway, groups_per_step=2, max_staleness=1, admission="reject")
    with engine_on(db_url) as engine:
        take_run(engine, gateway)
        for group in ("a", "b"):
            assert call(gateway, upstream, group, f"{group}-t0", size=1).status_code == 200
            reward(gateway, f"{group}-t0", 1.0)
        claimed = claim_ready_groups(engine, RUN, TRAINER, 2, 600)
        assert sorted(claimed) == ["a", "b"]
        for group in ("c", "d"):  # while step 1 trains: room for the one step after it
            assert call(gateway, upstream, group, f"{group}-t0").status_code == 200
        assert call(gateway, upstream, "e", "e-t0").status_code == 429
        drop_groups(engine, [("a", "zero reward variance")], TRAINER, trajectory_ids=["a-t0", "b-t0"])
        assert call(gateway, upstream, "e", "e-t0").status_code == 429
        commit_step(engine, RUN, 1, TRAINER, ["b"], {}, trajectory_ids=["b-t0"], lease_holder=TRAINER)
        publish_version(engine, RUN, 1, "smollm2", "/adapters/1")
        assert call(gateway, upstream, "e", "e-t0").status_code == 200


def test_a_client_that_hangs_up_gives_its_place_up(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    create_run(gateway, groups_per_step=1, max_staleness=0, admission_timeout_s=60)
    with engine_on(db_url) as engine:
        take_run(engine, gateway)
        assert call(gateway, upstream, "a", "a-t0").status_code == 200
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while its call waits for room
            httpx.post(gateway.base_url + "/chat/completions", json=_body(upstream), timeout=1,
                       headers={"X-Trajectory-Id": "b-t0", "X-Group-Id": "b"})  # fmt: skip
        wait_until(lambda: _waiting(gateway) == 0, 10, "the waiting call to be dropped")
        with engine.connect() as conn:
            assert conn.execute(select(Admission.group_id)).scalars().all() == ["a"]


def test_no_bound_before_a_trainer_takes_the_run(gateway: RunningGateway, upstream: FakeUpstream) -> None:
    """Capture without training is never throttled: there is nothing to pace the agents against."""
    create_run(gateway, groups_per_step=1, max_staleness=0, admission="reject")
    for g in range(3):
        assert call(gateway, upstream, f"free-{g}", f"free-{g}-t0").status_code == 200


def test_max_staleness_0_samples_each_step_from_the_previous_policy(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    """Synchronous on-policy: 8 groups x 2 episodes started at once; every group step k trains was sampled, every
    call of it, by policy k - 1, including the route switch right after each publication."""
    create_run(gateway, groups_per_step=2, max_staleness=0)
    with engine_on(db_url) as engine:
        take_run(engine, gateway)
        trainer = ScriptedTrainer(engine, [gateway], groups_per_step=2, steps=4).start()
        later: list[float] = []
        with ThreadPoolExecutor(16) as pool:
            episodes = [
                pool.submit(play, gateway, upstream, f"sync-{g}", f"sync-{g}-t{t}", 2, 2, float(t), later)
                for g in range(8)
                for t in range(2)
            ]
            for episode in episodes:
                episode.result(timeout=120)
        trainer.join()
        with engine.connect() as conn:
            versions = conn.execute(select(Call.policy_version).distinct()).scalars().all()
    assert sorted(versions) == [0, 1, 2, 3]
    assert len(trainer.trained) == 4
    for step, groups in trainer.trained.items():
        assert all(found == {step - 1} for found in groups.values()), (step, groups)


def test_two_gateways_share_one_bound(upstream: FakeUpstream, db_url: str, tmp_path: Any) -> None:
    settings = {"database_url": db_url, "upstream_url": upstream.base_url, "base_model": "smollm2"}
    with running_gateway(**settings, spool_dir=tmp_path / "a") as a, running_gateway(**settings, spool_dir=tmp_path / "b") as b:
        create_run(a, groups_per_step=2, max_staleness=0, admission="reject")
        with engine_on(db_url) as engine:
            take_run(engine, a, b)
            assert call(a, upstream, "g1", "g1-t0").status_code == 200
            assert call(b, upstream, "g2", "g2-t0").status_code == 200
            assert call(a, upstream, "g3", "g3-t0").status_code == 429
            assert call(b, upstream, "g3", "g3-t0").status_code == 429
            assert call(b, upstream, "g1", "g1-t1").status_code == 200  # admitted by the other gateway: proceeds
            assert call(a, upstream, "g2", "g2-t1").status_code == 200
            with engine.connect() as conn:
                assert conn.execute(select(Admission.group_id).order_by(Admission.group_id)).scalars().all() == [
                    "g1", "g2"
                ]  # fmt: skip


def test_a_group_is_served_by_its_admitted_version_on_every_gateway(
    upstream: FakeUpstream, db_url: str, tmp_path: Any
) -> None:
    """max_staleness 0 over two gateways, calls of one group alternating between them, and gateway B's route table
    left a version behind (its background reload stopped): group g, admitted on version 1, is served by exactly
    version 1 on both gateways after version 2 is published; group h, admitted on version 2 while B's table still
    says 1, makes B reload before routing, so h is served by version 2 everywhere."""
    settings = {"database_url": db_url, "upstream_url": upstream.base_url, "base_model": "smollm2"}
    with (
        running_gateway(**settings, spool_dir=tmp_path / "a") as a,
        running_gateway(**settings, spool_dir=tmp_path / "b") as b,
    ):
        create_run(a, groups_per_step=1, max_staleness=0, admission="reject")
        with engine_on(db_url) as engine:
            take_run(engine, a, b)
            publish_version(engine, RUN, 1, "smollm2", "/adapters/1")
            for gw in (a, b):
                wait_until(lambda gw=gw: _routed(gw) == 1, 10, "the gateway to route version 1")

            async def frozen() -> None:
                return None

            b.app._refresh_routes = frozen  # type: ignore[method-assign]  # B's table now only moves on demand
            assert _version(call(a, upstream, "g", "g-t0")) == 1
            publish_version(engine, RUN, 2, "smollm2", "/adapters/2")
            wait_until(lambda: _routed(a) == 2, 10, "gateway A to route version 2")
            served_g = [
                _version(call(b, upstream, "g", "g-t1")),  # new to B: asks the database, which says version 1
                _version(call(a, upstream, "g", "g-t0")),  # A's table says 2; g was admitted on 1
                _version(call(b, upstream, "g", "g-t1")),
            ]
            assert served_g == [1, 1, 1], served_g
            assert _routed(b) == 1  # B's cache is still stale
            served_h = [
                _version(call(b, upstream, "h", "h-t0")),  # admitted on 2: B reloads before routing it
                _version(call(a, upstream, "h", "h-t1")),
                _version(call(b, upstream, "h", "h-t0")),
            ]
            for gw in (a, b):
                gw.flush()
            with engine.connect() as conn:
                stored = conn.execute(
                    select(Trajectory.group_id, Call.policy_version).join(
                        Call, Call.trajectory_id == Trajectory.trajectory_id
                    )
                ).all()
    assert served_h == [2, 2, 2], served_h
    assert sorted(set(stored)) == [("g", 1), ("h", 2)]


def test_a_call_of_a_group_being_admitted_waits_for_its_version(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    """A group's first call is admitted on version 2 while this gateway's table says 1; its route reload is held.
    A second call of the same group arriving meanwhile must not be served by the stale table (version 1): it waits
    for the same reload, and both are served by version 2."""
    create_run(gateway, groups_per_step=1, max_staleness=0, admission="reject")
    router = gateway.app.state.router
    with engine_on(db_url) as engine:
        take_run(engine, gateway)
        publish_version(engine, RUN, 1, "smollm2", "/adapters/1")
        wait_until(lambda: _routed(gateway) == 1, 10, "the gateway to route version 1")

        async def frozen() -> None:
            return None

        gateway.app._refresh_routes = frozen  # type: ignore[method-assign]  # only admission reloads routes now
        entered, gate = threading.Event(), threading.Event()
        real_refresh = router.refresh

        def held_refresh(engine: Engine) -> None:
            entered.set()
            gate.wait(30)
            real_refresh(engine)

        router.refresh = held_refresh  # type: ignore[method-assign]
        publish_version(engine, RUN, 2, "smollm2", "/adapters/2")
        try:
            with ThreadPoolExecutor(2) as pool:
                first = pool.submit(call, gateway, upstream, "g", "g-t0")
                wait_until(entered.is_set, 10, "the first call's route reload")
                second = pool.submit(call, gateway, upstream, "g", "g-t1")
                metrics = gateway.app.state.metrics
                wait_until(lambda: second.done() or _counted(metrics, "route_catchups") >= 2, 10,
                           "the second call to be served or to wait for the reload")  # fmt: skip
                gate.set()
                versions = [_version(first.result(timeout=30)), _version(second.result(timeout=30))]
        finally:
            gate.set()
            router.refresh = real_refresh  # type: ignore[method-assign]
    assert versions == [2, 2], versions


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_routed_to_a_retired_adapter_is_served_by_the_run_version_now(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str, stream: bool
) -> None:
    """The trainer publishes version 2 and unloads version 1 while this gateway's route table still names version
    1's adapter: vLLM answers 404 for it, and the gateway, having generated nothing, reloads its routes and sends the
    call to version 2, recorded with and answered under the version that answered it."""
    create_run(gateway)
    old = f"{RUN}@1"
    with engine_on(db_url) as engine:
        publish_version(engine, RUN, 1, old, "/adapters/1")
        wait_until(lambda: _routed(gateway) == 1, 10, "the gateway to route version 1")

        async def frozen() -> None:
            return None

        gateway.app._refresh_routes = frozen  # type: ignore[method-assign]  # the table keeps naming version 1
        publish_version(engine, RUN, 2, "smollm2", "/adapters/2")
        mark_unloaded(engine, RUN, 1)
        upstream.retired.add(old)
        try:
            body = client_body(upstream.fixture("chat_stream" if stream else "chat"))
            response = httpx.post(f"{gateway.url}/g/r/t/r-t0/v1/chat/completions", json=body, timeout=30)
        finally:
            upstream.retired.discard(old)
        gateway.flush()
        with engine.connect() as conn:
            stored = conn.execute(select(Call.policy_version, Call.status_code)).all()
    assert response.status_code == 200, response.text
    assert response.headers["x-policy-version"] == "2"
    assert [tuple(row) for row in stored] == [(2, 200)]
    assert _counted(gateway.app.state.metrics, "retired_adapter_retries") == 1


def _routed(gw: RunningGateway) -> int:
    return gw.app.state.router.resolve(RUN, "smollm2").version


def _version(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.headers["x-policy-version"])


def _counted(metrics: Any, name: str) -> float:
    counter = getattr(metrics, name, None)  # absent before routes were caught up per group
    return counter._value.get() if counter is not None else 0.0


def test_staleness_figures_of_a_step() -> None:
    """build_samples reports how stale the groups it kept were; the run's figures weigh steps by groups used."""

    def group(gid: str, versions: list[int], rewards: tuple[float, float] = (0.0, 1.0)) -> GroupData:
        calls = [CallData(seq=i, choice_index=0, policy_version=v, prompt_token_ids=[1, 2], completion_token_ids=[3],
                          completion_logprobs=[-0.5], trainable=True) for i, v in enumerate(versions)]  # fmt: skip
        return GroupData(gid, [TrajectoryData(f"{gid}-{r}", r, calls) for r in rewards])

    batch = build_samples([group("a", [5, 6]), group("b", [6]), group("c", [2])], current_policy_version=6,
                          max_staleness=2)  # fmt: skip
    assert (batch.stats["staleness_mean"], batch.stats["staleness_max"]) == (0.5, 1)
    assert batch.stats["drop_reasons"] == {"stale policy": 1}
    figures = trainer_figures(
        [
            {**batch.stats, "wait_seconds": 3.0, "step_seconds": 1.0},
            {"groups_used": 2, "staleness_mean": 2.0, "staleness_max": 2, "wait_seconds": 0.0, "step_seconds": 4.0},
        ]
    )
    assert figures == {
        "trainer_idle_share": 3.0 / 8.0,
        "stale_dropped_per_step": [1, 0],
        "staleness_mean": 1.25,
        "staleness_max": 2,
    }


def _waiting(gw: RunningGateway) -> float:
    return gw.app.state.metrics.admission_waiting.labels(RUN)._value.get()


def _body(upstream: FakeUpstream) -> dict[str, Any]:
    kwargs = sdk_kwargs(upstream.fixture("chat"))
    return {**{k: v for k, v in kwargs.items() if k != "extra_body"}, **kwargs.get("extra_body", {})}


@pytest.fixture(autouse=True)
def _quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting calls ask for room every 0.1 s here (0.5 s by default)."""
    monkeypatch.setenv("TRAJGATE_ADMISSION_POLL_S", "0.1")
