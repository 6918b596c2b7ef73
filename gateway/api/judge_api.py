"""Judging a group on demand (admin key): `POST /v1/groups/{id}/judge` scores the group's trajectories with the run's
LLM judge now, stores the scores as their rewards and returns them.

The body, optional, overrides keys of the run's `judge` config block for this call (e.g. another `rubric`, or a
`model` when the run has no judge block). The judge call can take a while (a model answering, retries with backoff);
it runs on the event loop without blocking model traffic, and litellm is imported on the first call only, in a
thread.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request, Response
from pydantic import ValidationError

from gateway.http.deps import gateway_state, json_response, read_json, require_admin, validation_message
from gateway.http.errors import GatewayError
from gateway.judge.core import GroupFrozen, GroupJudgement, GroupNotFound, JudgeFailed, judge_group
from gateway.judge.policy import JudgeNotAllowed, JudgePolicy
from gateway.judge.prompt import PromptTooLong
from gateway.proxy.attribution import check_id
from gateway.runs.config import JudgeConfig
from gateway.store.judging import load_group, run_judge_block
from gateway.store.rewards import RewardsRejected

log = logging.getLogger("trajgate.judge")
router = APIRouter(dependencies=[Depends(require_admin)])


def judgement_body(outcome: GroupJudgement) -> dict[str, Any]:
    judgement = outcome.judgement
    return {
        "object": "group.judgement",
        "group_id": outcome.group_id,
        "run": outcome.run,
        "model": judgement.model,
        "client": judgement.client,
        "group_state": outcome.group_state,
        "group_ready": outcome.group_state == "ready",
        "attempts": judgement.attempts,
        "failed_attempts": judgement.errors,
        "seconds": round(judgement.seconds, 3),
        "truncation": judgement.truncation.as_dict(),
        "data": [
            {"trajectory_id": s.trajectory_id, "reward": s.score, "explanation": s.explanation}
            for s in judgement.scores
        ],
    }


def _judge_error(status: int, message: str, code: str, attempts: list[str] | None = None) -> Response:
    """An OpenAI-style error; a failed judge also lists what went wrong in each attempt."""
    body = orjson.loads(GatewayError(status, message, type_="judge_error", code=code).body())
    if attempts is not None:
        body["attempts"] = attempts
    return json_response(body, status)


@router.post("/v1/groups/{group_id}/judge")
async def judge_now(group_id: str, request: Request) -> Response:
    """Score every trajectory of the group with the LLM judge and store the scores as rewards (all or none).
    400 a key variable or api_base the operator has not allowed (gateway/judge/policy.py); 404 unknown group; 409
    the trainer has claimed it; 422 no judge configured or a bad override; 502 the judge
    model failed or never answered validly (nothing stored; `attempts` says why); 501 the model needs litellm."""
    check_id(group_id, "group id")
    overrides = await read_json(request)
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, dict):
        raise GatewayError(422, "body: expected a JSON object of judge settings (or no body)", code="invalid_value")
    gw = gateway_state(request)
    await gw.peers.settled()  # the group's last calls may still be queued, here or elsewhere
    group = await asyncio.to_thread(load_group, gw.engine, group_id)
    if group is None or not group.trajectories:
        message = f"no group {group_id!r}: no call of this group has been recorded"
        raise GatewayError(404, message, code="group_not_found")
    _, block = await asyncio.to_thread(run_judge_block, gw.engine, group.run)
    settings = {**(block or {}), **overrides}
    if "model" not in settings:
        message = (
            f"run {group.run!r} has no judge configured: set config.judge with POST /v1/runs, or pass at least "
            '{"model": "provider/name"} in the body'
        )
        raise GatewayError(422, message, code="judge_not_configured")
    try:
        config = JudgeConfig.model_validate(settings)
    except ValidationError as exc:
        raise GatewayError(422, validation_message(exc, "judge"), code="invalid_value") from None
    try:
        JudgePolicy.from_settings(gw.settings).check(config.api_key_env, config.api_base)
    except JudgeNotAllowed as exc:
        raise GatewayError(400, str(exc), code="judge_not_allowed") from None
    try:
        outcome = await judge_group(gw.engine, group_id, config, loaded=group)
    except GroupNotFound:
        raise GatewayError(404, f"no group {group_id!r}", code="group_not_found") from None
    except GroupFrozen as exc:
        raise GatewayError(409, str(exc), code="reward_conflict") from None
    except RewardsRejected as exc:
        raise GatewayError(409, f"rewards refused, none stored: {exc}", code="reward_conflict") from None
    except PromptTooLong as exc:
        raise GatewayError(422, f"judge.max_context_chars: {exc}", code="judge_context_too_small") from None
    except JudgeFailed as exc:
        log.warning("judge of group %r failed: %s", group_id, exc)
        if exc.kind == "unavailable":
            return _judge_error(501, str(exc), "judge_unavailable")
        code = "judge_provider_error" if exc.kind == "provider" else "judge_invalid_answer"
        return _judge_error(502, f"{exc} (no reward stored)", code, exc.attempts)
    assert outcome is not None  # only the worker asks to keep human rewards
    return json_response(judgement_body(outcome))
