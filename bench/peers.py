"""What the wait for other gateways' writers (gateway/recorder/heartbeat.py) costs a reward: one gateway against two on one
Postgres, with each reward posted to the gateway that did NOT answer the episode's call.

Everything runs in this process, as the fast tests do (tests.support.gateway_harness.running_gateway, the replaying
tests.support.fake_upstream, a throwaway tests.support.pgcluster.PgCluster), so the figures are latencies of the reward path, not
of a tuned deployment. Per episode: one chat call, then its reward, at once; episodes run one after another (c=1) so
the latency is the reward's own. Reported: reward latency p50/p99 with one gateway (the reward finds the call in
this gateway's writer) and with two (the reward waits for the other gateway's next beat), plus the peer rows'
beat rate on Postgres.

    .venv/bin/python bench/peers.py [--episodes 200]
    .venv/bin/python bench/peers.py --beats 1000    # instead: the gateway's CPU per heartbeat

`--beats N` times N heartbeats (`gateway.store.peers.beat`, as the gateway sends ten a second whether busy or idle)
against the throwaway cluster: CPU (this thread's) and wall time per beat, for the beat as sent nine times in ten and
for the one per alive window that also deletes long-silent gateways' rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from gateway.store.db import make_engine, upgrade  # noqa: E402
from gateway.store.peers import beat  # noqa: E402
from tests.support.fake_upstream import FakeUpstream  # noqa: E402
from tests.support.gateway_harness import RunningGateway, running_gateway  # noqa: E402
from tests.support.openai_calls import client_body  # noqa: E402
from tests.support.pgcluster import PgCluster, create_database  # noqa: E402


def episodes(
    call_to: RunningGateway, reward_to: RunningGateway, body: dict[str, object], count: int, tag: str
) -> list[float]:
    """Reward latencies in ms, one episode (a call, then its reward) at a time."""
    latencies = []
    with httpx.Client(timeout=60) as client:
        for i in range(count):
            headers = {"X-Trajectory-Id": f"{tag}-{i}", "X-Group-Id": f"{tag}-g{i}", "X-Group-Size": "1"}
            answer = client.post(f"{call_to.base_url}/chat/completions", json=body, headers=headers)
            assert answer.status_code == 200, answer.text
            started = time.perf_counter()
            reward = client.post(f"{reward_to.base_url}/trajectories/{tag}-{i}/reward", json={"reward": 1.0})
            latencies.append((time.perf_counter() - started) * 1000)
            assert reward.status_code == 200 and reward.json()["group_ready"], reward.text
    return latencies


def summary(name: str, values: list[float]) -> str:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"{name:<44} p50 {statistics.median(ordered):7.1f} ms   p99 {p99:7.1f} ms   ({len(values)} rewards)"


def beats(url: str, count: int) -> None:
    """Print the CPU and wall time per heartbeat, best of three samples of `count` beats each."""
    upgrade(url)
    engine = make_engine(url)
    try:
        for forget, label in ((None, "a beat"), (1000.0, "a beat that also forgets silent gateways")):
            samples = []
            for _ in range(3):
                cpu, wall = time.thread_time(), time.perf_counter()
                for _ in range(count):
                    beat(engine, "bench", lambda moment: moment, forget)
                samples.append((time.thread_time() - cpu, time.perf_counter() - wall))
            cpu_s, wall_s = min(samples)
            print(f"{label:<44} {1e6 * cpu_s / count:6.0f} us CPU   {1e6 * wall_s / count:6.0f} us wall   "
                  f"(best of 3 x {count})")
    finally:
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--beats", type=int, metavar="N", help="instead: time N heartbeats (see above)")
    args = parser.parse_args()
    cluster = PgCluster()
    cluster.start()
    if args.beats:
        try:
            beats(create_database(cluster.url()), args.beats)
        finally:
            cluster.destroy()
        return
    upstream = FakeUpstream().start()
    try:
        url = create_database(cluster.url())
        body = client_body(upstream.fixture("chat"))
        settings = {"database_url": url, "upstream_url": upstream.base_url, "base_model": "smollm2"}
        with tempfile.TemporaryDirectory() as spool:
            with running_gateway(**settings, spool_dir=Path(spool) / "solo") as solo:
                one = episodes(solo, solo, body, args.episodes, "solo")
            with (
                running_gateway(**settings, spool_dir=Path(spool) / "a") as a,
                running_gateway(**settings, spool_dir=Path(spool) / "b") as b,
            ):
                same = episodes(a, a, body, args.episodes, "same")
                other = episodes(a, b, body, args.episodes, "other")
        print(summary("one gateway", one))
        print(summary("two gateways, reward to the same one", same))
        print(summary("two gateways, reward to the other one", other))
    finally:
        upstream.stop()
        cluster.destroy()


if __name__ == "__main__":
    main()
