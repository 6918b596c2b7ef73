"""Judging a group: one prompt, the model's answer validated, retried with backoff, and the rewards stored all at
once through `store_rewards` (or not at all).

Where things go: the score is the reward; `metrics` (numbers only, like any reward's) get `judge_score`,
`judge_attempts`, `judge_truncated` (0/1) and `judge_chars_removed`; `metadata.judge` gets the text: the one-line
explanation, the model, the attempts, what was truncated and when it was judged. Other keys of metrics and metadata
are kept.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine

from gateway.judge import providers
from gateway.judge.answer import InvalidAnswer, Score, parse_scores
from gateway.judge.prompt import RETRY_RESERVE, JudgePrompt, Truncation, build_prompt, truncate_middle
from gateway.runs.config import JudgeConfig
from gateway.store.judging import GroupToJudge, load_group
from gateway.store.rewards import FROZEN_STATES, RewardItem, RewardResult, store_rewards

log = logging.getLogger("trajgate.judge")

MAX_BACKOFF_S = 30.0
# Tokens the answer may take per trajectory (an id, a score, a one-line explanation), plus the JSON around them.
TOKENS_PER_TRAJECTORY = 128
TOKENS_OVERHEAD = 32


class JudgeFailed(RuntimeError):
    """No valid answer after every attempt; nothing was stored. `kind`: provider | invalid_answer | unavailable."""

    def __init__(self, kind: str, message: str, attempts: list[str]) -> None:
        super().__init__(message)
        self.kind = kind
        self.attempts = attempts


class GroupNotFound(LookupError):
    pass


class GroupFrozen(RuntimeError):
    """The trainer has claimed (or finished with) the group: its rewards can no longer change."""


@dataclass(slots=True)
class Judgement:
    model: str
    client: str
    scores: list[Score]
    attempts: int
    seconds: float
    truncation: Truncation
    errors: list[str] = field(default_factory=list)  # what went wrong in the attempts before the good one


@dataclass(slots=True)
class GroupJudgement:
    group_id: str
    run: str
    judgement: Judgement
    results: list[RewardResult]

    @property
    def group_state(self) -> str:
        return self.results[0].group_state if self.results else "open"


Sleep = Callable[[float], Awaitable[None]]


def _backoff(config: JudgeConfig, attempt: int) -> float:
    """Exponential: backoff_s, 2x, 4x... capped, with a little jitter so parallel judges spread out."""
    base = min(MAX_BACKOFF_S, config.backoff_s * 2 ** (attempt - 1))
    return base * (1 + 0.1 * random.random()) if base else 0.0


def _corrective(prompt: JudgePrompt, answer: str | None, problem: str) -> list[dict[str, str]]:
    """The prompt plus the bad answer and what was wrong with it: asking the same question again would get the same
    answer at temperature 0 (and a guided decoder would follow the same path). Fits in RETRY_RESERVE."""
    feedback = (
        f"That answer cannot be used: {truncate_middle(problem, 300)}. Reply again with JSON only: exactly one entry "
        "per trajectory id listed above, in that order, each with a score from 0 to 1 and a one-sentence explanation."
    )
    echo = truncate_middle(answer or "(empty)", RETRY_RESERVE - len(feedback))
    return [*prompt.messages, {"role": "assistant", "content": echo}, {"role": "user", "content": feedback}]


def max_tokens_for(config: JudgeConfig, n: int) -> int:
    return config.max_tokens or TOKENS_OVERHEAD + TOKENS_PER_TRAJECTORY * n


async def judge_trajectories(
    trajectories: list[dict[str, Any]], config: JudgeConfig, *, sleep: Sleep = asyncio.sleep
) -> Judgement:
    """Score the trajectories (trajectory_view dicts) against each other. Raises JudgeFailed after
    `config.max_attempts` provider errors or malformed answers (a non-retryable provider error fails at once), and
    PromptTooLong if max_context_chars cannot hold the group."""
    started = time.perf_counter()
    prompt = build_prompt(trajectories, config.rubric, config.max_context_chars)
    messages = prompt.messages
    max_tokens = max_tokens_for(config, len(prompt.trajectory_ids))
    errors: list[str] = []
    kind = "provider"
    for attempt in range(1, config.max_attempts + 1):
        try:
            completion = await providers.complete(config, messages, prompt.schema, max_tokens)
        except providers.JudgeUnavailable as exc:
            raise JudgeFailed("unavailable", str(exc), errors) from None
        except providers.ProviderError as exc:
            kind = "provider"
            errors.append(f"attempt {attempt}: provider error: {exc}")
            log.warning("judge %s: attempt %d/%d: provider error: %s", config.model, attempt, config.max_attempts, exc)
            if not exc.retryable:
                break
        else:
            try:
                scores = parse_scores(completion.text, prompt.trajectory_ids)
            except InvalidAnswer as exc:
                kind = "invalid_answer"
                cut = " (cut off at max_tokens)" if completion.finish_reason == "length" else ""
                errors.append(f"attempt {attempt}: invalid answer{cut}: {exc}")
                log.warning(
                    "judge %s: attempt %d/%d: invalid answer%s: %s",
                    config.model, attempt, config.max_attempts, cut, exc,
                )  # fmt: skip
                messages = _corrective(prompt, completion.text, str(exc))
            else:
                return Judgement(
                    config.model,
                    completion.client,
                    scores,
                    attempt,
                    time.perf_counter() - started,
                    prompt.truncation,
                    errors,
                )
        if attempt < config.max_attempts:
            await sleep(_backoff(config, attempt))
    what = "provider error" if kind == "provider" else "no valid answer"
    raise JudgeFailed(kind, f"judge {config.model}: {what} after {len(errors)} attempt(s); last: {errors[-1]}", errors)


def reward_items(group: GroupToJudge, judgement: Judgement) -> list[RewardItem]:
    """One reward per trajectory; metrics and metadata merged over what the trajectory already carries."""
    judged_at = datetime.now(UTC).isoformat()
    truncation = judgement.truncation
    by_id = {t["trajectory_id"]: t for t in group.trajectories}
    items = []
    for score in judgement.scores:
        trajectory = by_id[score.trajectory_id]
        metrics = {
            **(trajectory.get("metrics") or {}),
            "judge_score": score.score,
            "judge_attempts": float(judgement.attempts),
            "judge_truncated": 1.0 if truncation.truncated else 0.0,
            "judge_chars_removed": float(truncation.chars_removed),
        }
        metadata = {
            **(trajectory.get("metadata") or {}),
            "judge": {
                "score": score.score,
                "explanation": score.explanation,
                "model": judgement.model,
                "attempts": judgement.attempts,
                "truncation": truncation.as_dict(),
                "judged_at": judged_at,
            },
        }
        items.append(RewardItem(score.trajectory_id, score.score, metrics, metadata))
    return items


def human_rewarded(group: GroupToJudge) -> list[str]:
    """Trajectories whose reward did not come from the judge."""
    return [
        t["trajectory_id"]
        for t in group.trajectories
        if t.get("reward") is not None and "judge" not in (t.get("metadata") or {})
    ]


async def judge_group(
    engine: Engine,
    group_id: str,
    config: JudgeConfig,
    *,
    keep_human_rewards: bool = False,
    loaded: GroupToJudge | None = None,
    sleep: Sleep = asyncio.sleep,
) -> GroupJudgement | None:
    """Judge every trajectory of the group and store the rewards in one `store_rewards` call.

    With `keep_human_rewards` (the worker), a group where someone else has rewarded a trajectory is left alone,
    checked before judging and again just before storing; returns None then. Raises GroupNotFound, GroupFrozen,
    JudgeFailed, PromptTooLong and RewardsRejected (e.g. the trainer claimed the group meanwhile). `loaded`: the
    group as the caller just read it with `load_group`, to save reading it again.
    """
    group = loaded or await asyncio.to_thread(load_group, engine, group_id)
    if group is None or not group.trajectories:
        raise GroupNotFound(group_id)
    if group.state in FROZEN_STATES:
        raise GroupFrozen(f"group {group_id!r} is {group.state}: its rewards can no longer change")
    if keep_human_rewards and human_rewarded(group):
        return None
    judgement = await judge_trajectories(group.trajectories, config, sleep=sleep)
    if keep_human_rewards:
        again = await asyncio.to_thread(load_group, engine, group_id)
        if again is None or human_rewarded(again):
            return None
    results = await asyncio.to_thread(store_rewards, engine, reward_items(group, judgement))
    return GroupJudgement(group.group_id, group.run, judgement, results)
