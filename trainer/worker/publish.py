"""Serving a committed step: load the adapter into vLLM as `run@step`, check it answers, then publish the version.

Publishing is what closes the loop: once the policy_versions row exists, gateways route the run's calls to the new
adapter within a second. Order matters: the row is written only after vLLM answers with the adapter, so no call is
ever routed to a name vLLM doesn't serve. The same code repairs a restarted vLLM, which forgets runtime adapters.
Unloading goes the other way round: an old version is retired in the database first (gateways stop routing to it at
their next route reload, once a second) and unloaded from vLLM only once every live gateway's heartbeat says it has
reloaded its routes since (Postgres; gateways on SQLite do not beat, and a call that still meets an unloaded adapter
is sent again to the run's version by the gateway, gateway/proxy/hot_path.py).

vLLM has a fixed number of adapter slots (`--max-loras`, TRAJGATE_VLLM_MAX_LORAS) shared by every run, and loading
one more adapter than it holds pushes out the least recently used one, in-flight calls or not. So a version first
claims a slot in the database (gateway/store/adapter_slots.py, counted over all runs and trainer processes); while
none is free its publication waits (`publish_waiting` on the step) and the trainer keeps unloading retired versions
until one is. A load that fails anywhere is taken back from every replica and its slot given back.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from gateway.store.adapter_slots import (
    SlotClaim,
    adapters_held,
    claim_slot,
    pending_claims,
    release_slot,
    retiring_count,
)
from gateway.store.training import (
    LoadedVersion,
    annotate_step,
    last_step,
    loaded_versions,
    mark_unloaded,
    publish_version,
    retire_version,
    unloadable_versions,
)

log = logging.getLogger("trajgate.publish")


class PublishError(RuntimeError):
    """vLLM refused or failed to serve an adapter; the message carries its answer."""


class Unreachable(PublishError):
    """vLLM could not be reached at all (down, restarting): with several replicas, one to skip, not a refusal."""


def served_name(run: str, step: int) -> str:
    return f"{run}@{step}"


class VllmAdmin:
    """The few vLLM endpoints the trainer needs (stdlib HTTP: the trainer has no async loop)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 120.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
        headers = {"content-type": "application/json"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.status, response.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError) as exc:
            raise Unreachable(f"vLLM unreachable at {self.base_url}: {exc}") from None

    def models(self) -> set[str]:
        status, text = self._call("GET", "/models")
        if status != 200:
            raise PublishError(f"vLLM /models answered {status}: {text[:300]}")
        return {model["id"] for model in json.loads(text).get("data", [])}

    def load(self, name: str, path: Path | str) -> None:
        # vLLM answers 200 with a plain-text body (no content-type); a name loaded twice is a 400, a bad path a 404.
        body = {"lora_name": name, "lora_path": str(path)}
        status, text = self._call("POST", "/load_lora_adapter", body)
        if status == 400 and name in self.models():
            # Already loaded, maybe from other weights (a step retried after a crash, a reset database):
            # reload so vLLM serves exactly this checkpoint.
            self.unload(name)
            status, text = self._call("POST", "/load_lora_adapter", body)
        if status != 200:
            raise PublishError(f"vLLM refused to load {name} from {path} ({status}): {text[:300]}")

    def unload(self, name: str) -> None:
        status, text = self._call("POST", "/unload_lora_adapter", {"lora_name": name})
        if status not in (200, 404) and name in self.models():
            raise PublishError(f"vLLM refused to unload {name} ({status}): {text[:300]}")

    def check_answers(self, name: str) -> float:
        """One token from the adapter: it is really usable, not just registered. Returns seconds taken."""
        started = time.perf_counter()
        status, text = self._call("POST", "/completions", {"model": name, "prompt": "Hi", "max_tokens": 1})
        if status != 200:
            raise PublishError(f"{name} is loaded but does not answer ({status}): {text[:300]}")
        return time.perf_counter() - started

    def replicas(self) -> list[VllmAdmin]:
        return [self]


class VllmReplicas:
    """Several vLLM replicas behind VllmAdmin's interface, so a version is published only once every replica that
    can be reached serves it: a load or check refused by any replica fails the publication (the publisher unloads it
    from every replica and retries with backoff); an unreachable replica is skipped, and gets the run's adapters from
    `Publisher.reconcile` when it is back (the gateway keeps it out of that run's rotation until its /models lists
    them). None reachable is a failure."""

    def __init__(self, admins: list[VllmAdmin]) -> None:
        self.admins = admins

    def _on_each(self, action: Callable[[VllmAdmin], float | None]) -> list[float | None]:
        results: list[float | None] = []
        unreachable: list[str] = []
        for admin in self.admins:
            try:
                results.append(action(admin))
            except Unreachable as exc:
                log.warning("skipping a replica: %s", exc)
                unreachable.append(str(exc))
        if not results:
            raise Unreachable("no vLLM replica reachable: " + "; ".join(unreachable))
        return results

    def models(self) -> set[str]:
        """What every reachable replica serves (a name one of them lacks is missing)."""
        served = [admin.models() for admin in self.admins if _reachable(admin)]
        if not served:
            raise Unreachable("no vLLM replica reachable")
        return set.intersection(*served)

    def load(self, name: str, path: Path | str) -> None:
        self._on_each(lambda admin: admin.load(name, path))

    def unload(self, name: str) -> None:
        """Unload from every reachable replica, even past one that refuses (then raises its refusal): taking a half
        loaded version back must leave no replica holding a slot for it."""
        refused: list[PublishError] = []

        def unload_one(admin: VllmAdmin) -> None:
            try:
                admin.unload(name)
            except Unreachable:
                raise
            except PublishError as exc:
                refused.append(exc)

        self._on_each(unload_one)
        if refused:
            raise refused[0]

    def check_answers(self, name: str) -> float:
        """The slowest replica's first answer with the adapter."""
        return max(t for t in self._on_each(lambda admin: admin.check_answers(name)) if t is not None)

    def replicas(self) -> list[VllmAdmin]:
        return list(self.admins)


def _reachable(admin: VllmAdmin) -> bool:
    try:
        admin.models()
    except Unreachable:
        return False
    return True


def vllm_admin(urls: list[str], api_key: str | None = None) -> VllmAdmin | VllmReplicas:
    """The admin for TRAJGATE_UPSTREAM_URL: one vLLM, or all of its replicas."""
    if len(urls) == 1:
        return VllmAdmin(urls[0], api_key)
    return VllmReplicas([VllmAdmin(url, api_key) for url in urls])


def slots_refusal(engine: Engine, runs: Sequence[str], keep: int, max_loras: int) -> str | None:
    """Why `runs` cannot all be published into a vLLM of `max_loras` adapter slots, or None if they can: each
    needs `keep` loaded plus one being published, and the runs not among them hold what they hold now (a run whose
    trainer exited keeps its last versions loaded; another trainer's runs theirs)."""
    need = len(runs) * (keep + 1)
    others = {run: len(names) for run, names in adapters_held(engine).items() if run not in runs}
    total = need + sum(others.values())
    if total <= max_loras:
        return None
    count = f"{len(runs)} runs need" if len(runs) > 1 else "1 run needs"
    held = "".join(f" and run {run} holds {n}" for run, n in sorted(others.items()))
    return (
        f"{count} {need} adapter slots (keep-adapters {keep} + 1 being published, each){held}; vLLM has "
        f"--max-loras {max_loras} (TRAJGATE_VLLM_MAX_LORAS): raise it to {total} or lower --keep-adapters"
    )


class Publisher:
    """Keeps vLLM serving each committed step of one run, newest `keep` adapters loaded, never more adapters (all
    runs) than `max_loras` (None: unknown, not checked)."""

    def __init__(
        self,
        engine: Engine,
        admin: VllmAdmin | VllmReplicas,
        run: str,
        checkpoint_path: Callable[[int], Path],
        keep: int = 2,
        echo: Callable[[str], None] = print,
        alive_s: float = 10.0,
        max_loras: int | None = None,
    ) -> None:
        self.engine = engine
        self.admin = admin
        self.run = run
        self.checkpoint_path = checkpoint_path
        self.keep = keep
        self.echo = echo
        self.alive_s = alive_s  # TRAJGATE_PEER_ALIVE_S: a gateway silent this long no longer holds an adapter loaded
        self.max_loras = max_loras
        self._backoff_s = 1.0
        self._next_try = 0.0
        self._waiting: int | None = None  # the step whose publication waits for a slot (said once)

    def publish(self, step: int, committed_at: float) -> bool:
        """Claim a slot, load, check, publish step `step`; with no slot free, wait (False, tried again by
        `reconcile`); on failure take the adapter back, record why on the step and retry later (with backoff)."""
        name = served_name(self.run, step)
        path = self.checkpoint_path(step)
        claim = claim_slot(self.engine, self.run, step, name, str(path), self.max_loras)
        if not claim.claimed:
            self._wait(step, claim)
            self._make_room()
            return False
        try:
            self.admin.load(name, path)
            first_answer_s = self.admin.check_answers(name)
        except PublishError as exc:
            self._take_back(step, name)
            self._failed(step, str(exc))
            return False
        publish_version(self.engine, self.run, step, name, str(path))
        swap_s = time.perf_counter() - committed_at
        extra: dict[str, Any] = {"publish_error": None, "swap_seconds": swap_s, "first_answer_s": first_answer_s}
        if self._waiting == step:
            extra["publish_waiting"] = None
        annotate_step(self.engine, self.run, step, extra)
        self.echo(f"published {name}: vLLM answers with it {swap_s:.1f}s after the step was committed")
        self._backoff_s, self._next_try, self._waiting = 1.0, 0.0, None
        self._unload_old(step)
        return True

    def _wait(self, step: int, claim: SlotClaim) -> None:
        """Say once per step (and on the step, for the read API) that its publication waits for a slot, and who
        holds them."""
        if self._waiting == step:
            return
        held = ", ".join(f"{run} {len(names)}" for run, names in adapters_held(self.engine).items())
        why = (
            f"adapter slots {claim.used}/{claim.total} in use ({held}; TRAJGATE_VLLM_MAX_LORAS): waiting for a "
            "retired adapter to be unloaded"
        )
        self._waiting = step
        log.warning("publishing step %d of %s waits: %s", step, self.run, why)
        self.echo(f"publish of step {step} waits: {why}")
        annotate_step(self.engine, self.run, step, {"publish_waiting": why})

    def _make_room(self) -> None:
        """Every slot is taken and none is on its way out (no retired version anywhere): more runs than the slots
        hold (trainers that started together, each seeing room). Waiting would never end, so the run holding the
        most versions gives up its oldest early (retired as usual: unloaded once gateways route away from it), as
        long as it keeps a newer one."""
        if retiring_count(self.engine):
            return
        held = {run: names for run, names in adapters_held(self.engine).items() if len(names) >= 2}
        if not held:
            return
        run = max(held, key=lambda name: (len(held[name]), name == self.run))
        versions = loaded_versions(self.engine, run)
        if len(versions) >= 2:
            retire_version(self.engine, run, versions[0].step)
            self.echo(f"retired {versions[0].served_name} early: no adapter slot would free up otherwise")

    def _take_back(self, step: int, name: str) -> None:
        """Unload a version that failed to publish from every replica that may hold it, and give its slot back;
        if a replica refused the unload, the claim stays (its slot is still taken) until `reconcile` manages it."""
        try:
            self.admin.unload(name)
        except Unreachable:
            pass  # no replica reachable: a vLLM that comes back has forgotten its runtime adapters
        except PublishError as exc:
            log.warning("could not take %s back: %s", name, exc)
            return
        release_slot(self.engine, self.run, step)

    def _failed(self, step: int, why: str) -> None:
        log.error("publishing step %d of %s failed: %s (retry in %.0fs)", step, self.run, why, self._backoff_s)
        self.echo(f"publish of step {step} failed: {why}")
        annotate_step(self.engine, self.run, step, {"publish_error": why})
        self._next_try = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, 60.0)

    def _unload_old(self, newest: int) -> None:
        """Retire the versions past the newest `keep`, and unload those no gateway can route to any more."""
        for version in loaded_versions(self.engine, self.run):
            if version.step <= newest - self.keep:
                retire_version(self.engine, self.run, version.step)
        self._unload_retired()

    def _unload_retired(self) -> None:
        """Unload from vLLM the retired versions every live gateway has stopped routing to; the others stay loaded
        until a later call (reconcile runs while the trainer waits for groups). While a publication waits for a
        slot, every run's: a run whose trainer has exited leaves its last retired versions to whoever needs room."""
        for version in unloadable_versions(self.engine, None if self._waiting is not None else self.run, self.alive_s):
            try:
                self.admin.unload(version.served_name)
            except PublishError as exc:
                log.warning("could not unload %s: %s", version.served_name, exc)
                continue
            mark_unloaded(self.engine, version.run, version.step)

    def pending(self) -> int | None:
        """The newest committed step if it is not published yet (its publication failed), else None."""
        return self._unpublished(loaded_versions(self.engine, self.run))

    def _unpublished(self, versions: list[LoadedVersion]) -> int | None:
        committed = last_step(self.engine, self.run)
        return committed if committed > (versions[-1].step if versions else 0) else None

    def reconcile(self) -> None:
        """Publish a committed step that isn't served yet, and reload adapters a restarted vLLM forgot."""
        if time.monotonic() < self._next_try:
            return
        self._unload_retired()
        versions = loaded_versions(self.engine, self.run)
        step = self._unpublished(versions)
        for claimed, name in pending_claims(self.engine, self.run):
            if claimed != step:  # a superseded step's claim, or one a crashed trainer left
                self._take_back(claimed, name)
        if step is not None:
            self.publish(step, time.perf_counter())
            return
        for admin in self.admin.replicas():  # each replica on its own: one that restarted lacks what others serve
            try:
                served = admin.models()
            except PublishError as exc:
                log.warning("cannot check vLLM's adapters: %s", exc)
                continue
            for version in versions:
                if version.served_name not in served and version.adapter_path:
                    try:
                        admin.load(version.served_name, version.adapter_path)
                        self.echo(f"re-loaded {version.served_name} into vLLM at {admin.base_url} (it had restarted)")
                    except PublishError as exc:
                        log.error("re-loading %s failed: %s", version.served_name, exc)
