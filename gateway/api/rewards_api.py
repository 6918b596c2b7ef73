"""Posting rewards and closing groups: what an agent does when an episode ends (agent key or admin key). A key bound
to runs (tenants) reaches only their trajectories and groups; any other is the same 404 as one never recorded.

Before touching the database, each handler waits until every call answered before the request arrived is written,
by this process's record writer and by every other live gateway's (gateway.recorder.heartbeat): the agent's last call may still
be in some writer's queue when its reward arrives, and the reward must find every call answered before it, or it
would be refused (unknown trajectory) or make a group ready without its last call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from gateway.http.deps import (
    FiniteNumber,
    JsonObject,
    agent_runs,
    gateway_state,
    json_response,
    read_json,
    require_agent,
    validated,
    validation_message,
)
from gateway.http.errors import GatewayError
from gateway.proxy.attribution import ID_RE, ID_RULE, check_id
from gateway.store.rewards import RewardItem, RewardResult, RewardsRejected, close_group, store_rewards

router = APIRouter(dependencies=[Depends(require_agent)])

_STATUS = {"not_found": 404, "conflict": 409}


class RewardBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: FiniteNumber
    metrics: dict[str, FiniteNumber] | None = None
    metadata: JsonObject | None = None


class BatchReward(RewardBody):
    trajectory_id: str

    @field_validator("trajectory_id")
    @classmethod
    def _id(cls, value: str) -> str:
        if not ID_RE.match(value):
            raise ValueError(f"use {ID_RULE}")
        return value


def _result(result: RewardResult) -> dict[str, Any]:
    return {
        "trajectory_id": result.trajectory_id,
        "group_id": result.group_id,
        "reward": result.reward,
        "group_state": result.group_state,
        "group_ready": result.group_state == "ready",
    }


async def _store(request: Request, items: Sequence[RewardItem]) -> list[RewardResult]:
    gw = gateway_state(request)
    await gw.peers.settled()
    return await asyncio.to_thread(store_rewards, gw.engine, items, agent_runs(request))


@router.post("/v1/trajectories/{trajectory_id}/reward")
async def post_reward(trajectory_id: str, request: Request) -> dict[str, Any]:
    """Reward one trajectory. 404 unknown trajectory, 409 a different reward once its group was claimed."""
    check_id(trajectory_id, "trajectory id")
    body = validated(RewardBody, await read_json(request, nul_ok=True))
    item = RewardItem(trajectory_id, body.reward, body.metrics, body.metadata)
    try:
        (result,) = await _store(request, [item])
    except RewardsRejected as exc:
        error = exc.errors[0]
        code = "trajectory_not_found" if error.reason == "not_found" else "reward_conflict"
        raise GatewayError(_STATUS[error.reason], error.message, code=code) from None
    return _result(result)


@router.post("/v1/rewards")
async def post_rewards(request: Request) -> Response:
    """Reward many trajectories, all or nothing: if any item is refused, nothing is stored and the response lists
    every refused item with its own status (422 invalid, 404 unknown, 409 conflict)."""
    data = await read_json(request, nul_ok=True)
    if not isinstance(data, list) or not data:
        raise GatewayError(422, "body: expected a non-empty JSON array of rewards", code="invalid_value")
    items: list[RewardItem] = []
    failures: list[dict[str, Any]] = []
    seen: dict[str, RewardItem] = {}
    for index, raw in enumerate(data):
        trajectory_id = raw.get("trajectory_id") if isinstance(raw, dict) else None
        try:
            parsed = BatchReward.model_validate(raw)
        except ValidationError as exc:
            failures.append(_failure(index, trajectory_id, 422, validation_message(exc, f"[{index}]")))
            continue
        item = RewardItem(parsed.trajectory_id, parsed.reward, parsed.metrics, parsed.metadata)
        if seen.setdefault(item.trajectory_id, item) != item:
            message = f"[{index}]: trajectory {item.trajectory_id!r} appears twice with different values"
            failures.append(_failure(index, item.trajectory_id, 422, message))
        items.append(item)
    if failures:
        return _rejected(422, failures)
    try:
        results = await _store(request, items)
    except RewardsRejected as exc:
        failures = [_failure(e.index, e.trajectory_id, _STATUS[e.reason], e.message) for e in exc.errors]
        return _rejected(404 if any(f["status"] == 404 for f in failures) else 409, failures)
    return json_response({"object": "list", "data": [_result(result) for result in results]})


def _failure(index: int, trajectory_id: Any, status: int, message: str) -> dict[str, Any]:
    return {"index": index, "trajectory_id": trajectory_id, "status": status, "message": message}


def _rejected(status: int, failures: list[dict[str, Any]]) -> Response:
    """An OpenAI-style error, plus the refused items so a client can fix exactly those."""
    summary = f"{len(failures)} reward(s) refused, none stored; first: {failures[0]['message']}"
    code = {422: "invalid_value", 404: "trajectory_not_found", 409: "reward_conflict"}[status]
    error = orjson.loads(GatewayError(status, summary, code=code).body())
    return json_response({**error, "items": failures}, status)


@router.post("/v1/groups/{group_id}/close")
async def close(group_id: str, request: Request) -> dict[str, Any]:
    """Declare the group complete: ready once every trajectory it has is rewarded, whatever its expected size."""
    check_id(group_id, "group id")
    gw = gateway_state(request)
    await gw.peers.settled()
    state = await asyncio.to_thread(close_group, gw.engine, group_id, agent_runs(request))
    if state is None:
        message = f"no group {group_id!r}: no call of this group has been recorded"
        raise GatewayError(404, message, code="group_not_found")
    return {"group_id": group_id, "closed": True, "group_state": state, "group_ready": state == "ready"}
