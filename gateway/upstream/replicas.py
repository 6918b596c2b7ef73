"""Several vLLM replicas behind one gateway: which replica a call goes to, and which replicas are usable.

A trajectory's calls stick to one replica (its KV prefix cache holds the trajectory's earlier turns); a new
trajectory goes to the least-loaded usable replica (fewest calls in flight). A replica is usable for a call when it
is healthy and, with several replicas, when its last `/models` listed the run's current served name: a replica that
came back without an adapter gets no traffic for that run until the trainer's reconcile has re-loaded it
(trainer/worker/publish.py), nor for the versions published since (until a probe lists them, only replicas that list
an earlier version of the run take them). A failed connect or a 5xx marks a replica down; the background probe of
`/models` brings it back. With one replica nothing is filtered or probed: the gateway behaves exactly as with a
single upstream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from gateway.upstream.client import ConnectFailed, UpstreamPool, UpstreamResponse

log = logging.getLogger("trajgate.replicas")

# Trajectories whose replica is remembered; the least recently used are forgotten first (a forgotten trajectory is
# placed again like a new one: correct, only its prefix cache is lost).
STICKY_MAX = 100_000


@dataclass(slots=True, eq=False)
class Replica:
    url: str  # the OpenAI base URL, ending in /v1 (the proxy appends /chat/completions)
    healthy: bool = True
    in_flight: int = 0
    placed: int = 0  # trajectories placed here; breaks ties between equally loaded replicas
    served: set[str] | None = None  # model names its last /models listed; None until probed

    @property
    def root_url(self) -> str:
        """vLLM's root, for its endpoints outside /v1 (token_in's /inference/v1/generate)."""
        return self.url.removesuffix("/v1")


class Replicas:
    def __init__(self, urls: list[str], sticky_max: int = STICKY_MAX) -> None:
        if not urls:
            raise ValueError("at least one upstream URL is needed")
        self.all = [Replica(url) for url in urls]
        # When a call last gave back a replica (time.monotonic). With none in flight every call that started has
        # ended, so this tells how long the gateway has been quiet (the record writer stops giving way to an event
        # loop that has had nothing to do); stamped on release only, once per call on the hot path.
        self.touched = 0.0
        self._sticky: OrderedDict[str, Replica] = OrderedDict()
        self._sticky_max = sticky_max

    @property
    def several(self) -> bool:
        return len(self.all) > 1

    def usable(self, served_name: str | None, avoid: Replica | None = None) -> list[Replica]:
        """Healthy replicas that serve `served_name`; if none lists it yet (a version published since the last probe),
        those that list an earlier version of its run (the trainer publishes a version only once every replica it
        reached loaded it; a replica that lists none of the run's restarted and may lack it too), else the healthy
        ones; if none is healthy, all (a call then fails as it would with one upstream)."""
        others = [r for r in self.all if r is not avoid] or self.all
        healthy = [r for r in others if r.healthy] or others
        if not self.several or served_name is None:
            return healthy
        serving = [r for r in healthy if r.served is None or served_name in r.served]
        if serving:
            return serving
        run, at, _ = served_name.rpartition("@")
        if at:
            prefix = run + "@"
            serving = [r for r in healthy if r.served is not None and any(n.startswith(prefix) for n in r.served)]
        return serving or healthy

    def pick(self, trajectory_id: str | None, served_name: str | None, avoid: Replica | None = None) -> Replica:
        """The trajectory's replica if it is still usable for this served name, else the least-loaded usable one
        (which the trajectory then sticks to). With one replica there is nothing to choose or remember."""
        if not self.several:
            return self.all[0]
        candidates = self.usable(served_name, avoid)
        if trajectory_id is not None:
            current = self._sticky.get(trajectory_id)
            if current is not None and current in candidates:
                self._sticky.move_to_end(trajectory_id)
                return current
        replica = min(candidates, key=lambda r: (r.in_flight, r.placed))
        if trajectory_id is not None:
            replica.placed += 1
            self._sticky[trajectory_id] = replica
            self._sticky.move_to_end(trajectory_id)
            while len(self._sticky) > self._sticky_max:
                self._sticky.popitem(last=False)
        return replica

    def lease(self, trajectory_id: str | None, served_name: str | None) -> Lease:
        return Lease(self, trajectory_id, served_name, self.pick(trajectory_id, served_name))

    def mark_down(self, replica: Replica, why: str) -> None:
        if replica.healthy and self.several:
            log.warning("replica %s out of rotation: %s", replica.url, why)
        replica.healthy = False

    async def probe(self, session: aiohttp.ClientSession, headers: dict[str, str]) -> None:
        """Ask every replica's `/models` once: answering brings a replica back, failing takes it out; what it lists
        decides which runs it may serve."""
        await asyncio.gather(*(self._probe_one(session, headers, replica) for replica in self.all))

    async def _probe_one(self, session: aiohttp.ClientSession, headers: dict[str, str], replica: Replica) -> None:
        try:
            models = await fetch_models(session, headers, replica)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            self.mark_down(replica, f"/models failed ({type(exc).__name__})")
            return
        if models is None:
            self.mark_down(replica, "/models did not answer 200")
            return
        replica.served = {str(model.get("id")) for model in models if isinstance(model, dict)}
        if not replica.healthy:
            log.info("replica %s back in rotation", replica.url)
        replica.healthy = True

    async def probe_forever(self, session: aiohttp.ClientSession, headers: dict[str, str], every_s: float) -> None:
        while True:
            await self.probe(session, headers)
            await asyncio.sleep(every_s)


async def fetch_models(
    session: aiohttp.ClientSession, headers: dict[str, str], replica: Replica
) -> list[dict[str, Any]] | None:
    """A replica's `/models` list, or None if it answered another status; raises on connect errors and bad JSON."""
    async with session.get(replica.url + "/models", headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as r:
        if r.status != 200:
            return None
        return orjson.loads(await r.read()).get("data") or []


@dataclass(slots=True)
class Lease:
    """The replica one call uses, counted in flight until released; it moves at most once, when connecting fails
    (nothing reached vLLM, so nothing was generated or lost)."""

    replicas: Replicas
    trajectory_id: str | None
    served_name: str | None
    replica: Replica
    moved: bool = False
    released: bool = field(default=False)

    def __post_init__(self) -> None:
        self.replica.in_flight += 1

    async def post(self, pool: UpstreamPool, url_path: str, data: bytes, root: bool = False) -> UpstreamResponse:
        """POST to the leased replica (`root`: under vLLM's root rather than its /v1 base). A refused connection
        marks the replica down and tries one other usable replica; the second failure is the caller's to report."""
        while True:
            base = self.replica.root_url if root else self.replica.url
            try:
                return await pool.post(base + url_path, data)
            except ConnectFailed as exc:
                self.replicas.mark_down(self.replica, f"connect failed ({exc})")
                if self.moved or not self._move():
                    raise

    def _move(self) -> bool:
        other = self.replicas.pick(self.trajectory_id, self.served_name, avoid=self.replica)
        if other is self.replica or not other.healthy:
            return False
        self.replica.in_flight -= 1
        other.in_flight += 1
        self.replica, self.moved = other, True
        return True

    def answered(self, status: int) -> None:
        """A 5xx takes the replica out of rotation until its `/models` answers again."""
        if status >= 500:
            self.replicas.mark_down(self.replica, f"answered {status}")

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.replica.in_flight -= 1
            self.replicas.touched = time.monotonic()
