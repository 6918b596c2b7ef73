"""Admission: a train-mode call that starts a new group runs only while the run's bound has room, so rollouts never
outrun the trainer by more than `max_staleness` versions (the rule is gateway/store/admission.py's).

The unit is the group, not the trajectory: a GRPO group is only trainable whole, so the first call of a group takes
its slot, and every later call of the group, whichever trajectory it belongs to, proceeds without asking. An episode
is never stranded half-way: once its group is admitted nothing here waits again.

Admission and routing are one decision: a group is admitted on the version serving the run when the database decides
(stored in its `admissions` row), and every call of it, on any gateway, is served by a version its bound allows:
the newest loaded one of V .. V + max_staleness for a group admitted on V (max_staleness 0: exactly V). A process
whose route table (reloaded once a second) is older than V reloads it before routing the call, so no stale cache can
serve a group a version older than the one it was admitted on.

The hot path stays off the database. A group this process admitted is remembered in memory, with its version, and
its calls pass with a dictionary lookup. Only a group this process has not seen asks the database, and the asks of
one run are batched: one task per run and process (the pump) decides every waiting group in one transaction, oldest
first, then sleeps until a new group arrives or `poll_s` passes (the trainer frees room by training or dropping
groups and by serving a new version, neither of which the gateway is told of). A later call of a group another
gateway admitted is answered by that same transaction as already admitted, with its version, without waiting for
room.

If the database cannot be asked, the group is admitted (and remembered): the bound exists to keep training
on-policy, and the trainer cannot train while the database is away either, whereas refusing would stop every agent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from starlette.types import Receive

from gateway.http.errors import GatewayError
from gateway.http.metrics import GatewayMetrics
from gateway.proxy.asgi_io import wait_for_disconnect
from gateway.proxy.attribution import Attribution
from gateway.proxy.routing import PolicyRouter, Route
from gateway.store.admission import Decision, admit_groups, count_refusal

log = logging.getLogger("trajgate.admission")

# Groups remembered as admitted per process; one forgotten asks the database again (and is found admitted).
REMEMBERED_GROUPS = 200_000


class Refused(GatewayError):
    """429 in the OpenAI error shape, with the seconds after which a retry may find room."""

    def __init__(self, message: str, code: str, retry_after_s: int) -> None:
        super().__init__(429, message, "rate_limit_error", code, retry_after_s=retry_after_s)


@dataclass(eq=False)
class _Ask:
    group_id: str
    reject: bool  # answer after the first decision, admitted or not
    since: float
    answer: asyncio.Future[Decision] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass(eq=False)
class _RunQueue:
    asks: list[_Ask] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    pump: asyncio.Task[None] | None = None


class Admission:
    def __init__(self, engine: Engine | None, router: PolicyRouter, metrics: GatewayMetrics, poll_s: float) -> None:
        self.engine = engine
        self.router = router
        self.metrics = metrics
        self.poll_s = poll_s
        # Group -> the version it was admitted on (None: unknown, e.g. decided without the database).
        self._admitted: OrderedDict[str, int | None] = OrderedDict()
        self._queues: dict[str, _RunQueue] = {}
        self._refresh_lock = asyncio.Lock()

    def applies(self, route: Route, attribution: Attribution) -> bool:
        """Whether this call is admitted and routed by its group: a train-mode call of a run with a bound. Eval
        calls and calls with no trajectory id of the client's (never trained) go to the newest version unasked."""
        return (
            route.admission is not None
            and attribution.mode == "train"
            and not attribution.generated
            and self.engine is not None
        )

    async def route(self, route: Route, attribution: Attribution, receive: Receive) -> Route:
        """The route to serve a call `applies` holds for: its group's first call on this process is admitted first
        (Refused as `admit` says); every call is served by a version its group's bound allows, after reloading the
        route table if the group was admitted on a version this process has not loaded yet."""
        group = attribution.group_id
        if group in self._admitted:
            admitted = self._admitted[group]
        else:
            admitted = await self.admit(route, attribution, receive)
            route = self.router.resolve(route.run, route.served_name)  # the wait may have seen a new version
        if admitted is None:
            return route
        if route.version < admitted:
            route = await self._catch_up(route, admitted)
        return route.for_group(admitted)

    async def admit(self, route: Route, attribution: Attribution, receive: Receive) -> int | None:
        """Wait until the call's group is admitted and return the version it was admitted on (None: unknown);
        raise Refused when the run says reject and there is no room, or the wait timed out. A client that hangs up
        while waiting gives up its place."""
        policy = route.admission
        assert policy is not None
        ask = _Ask(attribution.group_id, reject=policy.mode == "reject", since=time.monotonic())
        queue = self._queues.setdefault(route.run, _RunQueue())
        queue.asks.append(ask)
        queue.arrived.set()
        if queue.pump is None or queue.pump.done():
            queue.pump = asyncio.create_task(self._pump(route.run, queue))
        waiting = self.metrics.admission_waiting.labels(route.run)
        waiting.inc()
        hangup = asyncio.ensure_future(wait_for_disconnect(receive))
        waiters: set[asyncio.Future[Any]] = {ask.answer, hangup}
        try:
            await asyncio.wait(waiters, timeout=policy.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.dec()
            hangup.cancel()
        waited = time.monotonic() - ask.since
        if not ask.answer.done():
            ask.answer.cancel()
            if hangup.done():
                raise GatewayError(499, "client disconnected while waiting for admission", code="client_closed")
            await self._refused(route.run, "timed_out")
            raise Refused(
                f"run {route.run!r} had no room for a new group for {policy.timeout_s:g}s (admission_timeout_s): "
                "the trainer is behind; retry later",
                "admission_timeout",
                1,
            )
        decision = ask.answer.result()
        if ask.group_id not in decision.admitted:
            await self._refused(route.run, "rejected")
            raise Refused(
                f"run {route.run!r} has {decision.in_flight} groups in flight of the {decision.slots} its trainer can "
                "take before they go stale (max_staleness); retry later",
                "admission_full",
                decision.retry_after_s,
            )
        self.metrics.admission_wait.labels(route.run).observe(waited)
        version = decision.versions.get(ask.group_id)
        self._remember(ask.group_id, version)
        return version

    async def _pump(self, run: str, queue: _RunQueue) -> None:
        """Decide the run's waiting groups, oldest first, until none waits."""
        while True:
            queue.asks = [ask for ask in queue.asks if not ask.answer.done()]
            if not queue.asks:
                return
            queue.arrived.clear()
            asks = list(queue.asks)
            now = time.monotonic()
            decision = await self._decide(run, [(ask.group_id, now - ask.since) for ask in asks])
            self.metrics.admission_admitted.labels(run).inc(len(decision.newly_admitted))
            for ask in asks:
                if not ask.answer.done() and (ask.group_id in decision.admitted or ask.reject):
                    ask.answer.set_result(decision)
            if any(not ask.answer.done() for ask in queue.asks):
                try:
                    await asyncio.wait_for(queue.arrived.wait(), self.poll_s)
                except TimeoutError:
                    pass

    async def _decide(self, run: str, asks: list[tuple[str, float]]) -> Decision:
        assert self.engine is not None
        try:
            return await asyncio.to_thread(admit_groups, self.engine, run, asks)
        except SQLAlchemyError as exc:
            log.warning("admission for run %r cannot reach the database (%s): admitting", run, type(exc).__name__)
            self.metrics.admission_errors.inc()
            groups = {group for group, _ in asks}
            return Decision(groups, set(), 0, 0, 1)

    async def _refused(self, run: str, kind: str) -> None:
        self.metrics.admission_refused.labels(run, kind).inc()
        assert self.engine is not None
        try:
            await asyncio.to_thread(count_refusal, self.engine, run, kind)
        except SQLAlchemyError as exc:
            log.warning("could not count a refused call of run %r: %s", run, type(exc).__name__)

    def _remember(self, group_id: str, version: int | None) -> None:
        self._admitted[group_id] = version
        self._admitted.move_to_end(group_id)
        while len(self._admitted) > REMEMBERED_GROUPS:
            self._admitted.popitem(last=False)

    async def reloaded(self, route: Route) -> Route:
        """The run's route after reloading the table now (vLLM no longer serves `route`'s adapter); reloads already
        under way are waited for and count."""
        return await self._catch_up(route, route.version + 1, count=False)

    async def _catch_up(self, route: Route, version: int, count: bool = True) -> Route:
        """The run's route once this process's table holds `version` (a group was admitted on it, here or by another
        gateway): one reload at a time, which every call waiting here shares. If the database cannot be read, the
        table as it is (the group's call is then served by an older version and the trainer may drop the group)."""
        if count:
            self.metrics.route_catchups.inc()
        async with self._refresh_lock:
            current = self.router.resolve(route.run, route.served_name)
            if current.version >= version or self.engine is None:
                return current
            try:
                await asyncio.to_thread(self.router.refresh, self.engine)
            except SQLAlchemyError as exc:
                log.warning("could not reload routes for a group admitted on version %d: %s", version,
                            type(exc).__name__)  # fmt: skip
            return self.router.resolve(route.run, route.served_name)
