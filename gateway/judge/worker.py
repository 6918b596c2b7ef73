"""`trajgate judge --run R`: score a run's complete but unrewarded groups with the run's LLM judge, for as long as it
runs (or once, with `--once`).

Every poll it reads the run's `judge` config (so changes apply without a restart) and the groups waiting for a
judge (`gateway.store.judging.judgeable_groups`), waits until every gateway has written the calls it answered before
then (gateway.recorder.heartbeat: several gateways on one Postgres), and judges them one at a time. A group someone else has
rewarded (even partly) is left to them. A group the judge fails on stays unrewarded and is tried again later with
growing delays; the error is logged. One worker per run: two would judge the same groups twice (harmless, but wasted).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from pydantic import ValidationError
from sqlalchemy.exc import SQLAlchemyError

from gateway.judge.core import GroupFrozen, GroupNotFound, JudgeFailed, judge_group
from gateway.judge.policy import JudgeNotAllowed, JudgePolicy
from gateway.judge.prompt import PromptTooLong
from gateway.recorder.heartbeat import others_caught_up
from gateway.runs.config import JudgeConfig
from gateway.runs.settings import Settings
from gateway.store.db import make_engine
from gateway.store.judging import judgeable_groups, run_judge_block
from gateway.store.rewards import RewardsRejected

log = logging.getLogger("trajgate.judge")

RETRY_FIRST_S = 30.0  # first wait before judging a failed group again; doubles up to RETRY_MAX_S
RETRY_MAX_S = 900.0
SKIP_HUMAN_S = 300.0  # how long a group with someone else's rewards is left alone before looking again


class JudgeSetupError(RuntimeError):
    """The worker cannot start: no such run, or the run has no valid judge config."""


@dataclass(slots=True)
class Backoff:
    until: float
    failures: int


@dataclass(slots=True)
class PassResult:
    judged: int = 0
    failed: int = 0
    skipped: int = 0


class JudgeWorker:
    def __init__(self, settings: Settings, run: str, *, poll_s: float = 2.0, batch: int = 16) -> None:
        self.run = run
        self.poll_s = poll_s
        self.batch = batch
        self.engine = make_engine(settings.database_url)
        self.policy = JudgePolicy.from_settings(settings)
        self._peers = (settings.peer_poll_s, settings.peer_alive_s, settings.peer_wait_s)
        self._later: dict[str, Backoff] = {}
        self.judged = 0
        self.failed = 0

    def close(self) -> None:
        self.engine.dispose()

    def config(self) -> JudgeConfig:
        exists, block = run_judge_block(self.engine, self.run)
        if not exists:
            raise JudgeSetupError(f"no run named {self.run!r}")
        if block is None:
            raise JudgeSetupError(
                f"run {self.run!r} has no judge configured: POST /v1/runs "
                f'{{"name": "{self.run}", "config": {{"judge": {{"model": "provider/name", ...}}}}}}'
            )
        try:
            config = JudgeConfig.model_validate(block)
        except ValidationError as exc:
            raise JudgeSetupError(f"run {self.run!r}: invalid judge config: {exc.errors()[0]['msg']}") from None
        try:  # (a config stored before the operator's lists existed, or changed since, is checked here too)
            self.policy.check(config.api_key_env, config.api_base)
        except JudgeNotAllowed as exc:
            raise JudgeSetupError(f"run {self.run!r}: {exc}") from None
        return config

    def _defer(self, group_id: str, seconds: float | None = None) -> float:
        failures = self._later[group_id].failures + 1 if group_id in self._later else 1
        delay = seconds if seconds is not None else min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (failures - 1))
        self._later[group_id] = Backoff(time.monotonic() + delay, failures)
        return delay

    async def judge_pending(self, config: JudgeConfig | None = None) -> PassResult:
        """One pass: judge every group waiting now (up to `batch`), each on its own."""
        config = config or self.config()
        now = time.monotonic()
        waiting = {g for g, b in self._later.items() if b.until > now}
        groups = await asyncio.to_thread(
            judgeable_groups,
            self.engine,
            self.run,
            min_size=config.min_group_size,
            settle_s=config.settle_s,
            limit=self.batch,
            exclude=waiting,
        )
        result = PassResult()
        # Their last calls may still wait in some gateway's writer: judge only once those are written, else next pass.
        if groups and await others_caught_up(self.engine, "", *self._peers):
            result.skipped = len(groups)
            return result
        for group_id in groups:
            try:
                outcome = await judge_group(self.engine, group_id, config, keep_human_rewards=True)
            except (GroupNotFound, GroupFrozen, RewardsRejected) as exc:
                log.info("judge: group %r: skipped: %s", group_id, exc)  # gone, or claimed meanwhile
                result.skipped += 1
                continue
            except (JudgeFailed, PromptTooLong) as exc:
                delay = self._defer(group_id)
                log.error("judge: group %r not judged, left unrewarded (retry in %.0fs): %s", group_id, delay, exc)
                result.failed += 1
                self.failed += 1
                continue
            if outcome is None:
                self._defer(group_id, SKIP_HUMAN_S)
                log.info("judge: group %r has rewards from someone else: left to them", group_id)
                result.skipped += 1
                continue
            self._later.pop(group_id, None)
            judgement = outcome.judgement
            scores = " ".join(f"{s.trajectory_id}={s.score:.2f}" for s in judgement.scores)
            cut = f", truncated {judgement.truncation.chars_removed} chars" if judgement.truncation.truncated else ""
            log.info(
                "judge: group %r: %s (%d attempt(s), %.1fs%s) -> %s",
                group_id, scores, judgement.attempts, judgement.seconds, cut, outcome.group_state,
            )  # fmt: skip
            result.judged += 1
            self.judged += 1
        return result

    async def serve(self, stop: threading.Event, once: bool = False) -> int:
        """Poll and judge until `stop` is set (or after one pass with `once`); returns the groups judged."""
        self.config()  # fail at start on a missing run or judge config
        log.info("judge worker for run %r started", self.run)
        reported: str | None = None
        while not stop.is_set():
            try:
                config = await asyncio.to_thread(self.config)
                result = await self.judge_pending(config)
                reported = None
            except JudgeSetupError as exc:  # the judge block was removed or broken meanwhile: wait for a fix
                if str(exc) != reported:
                    log.error("judge: %s", exc)
                    reported = str(exc)
                result = PassResult()
            except SQLAlchemyError as exc:
                log.warning("judge: database unavailable: %s", type(exc).__name__)
                result = PassResult()
            if once:
                break
            if not result.judged:
                await asyncio.to_thread(stop.wait, self.poll_s)
        return self.judged
