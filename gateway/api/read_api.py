"""Reading back trajectories and groups (admin key): what was recorded and how far each group has got."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from gateway.http.deps import gateway_state, json_response, require_admin
from gateway.http.errors import GatewayError
from gateway.proxy.attribution import check_id
from gateway.store.reads import group_view, trajectory_view

router = APIRouter(dependencies=[Depends(require_admin)])


@router.get("/v1/trajectories/{trajectory_id}")
async def get_trajectory(trajectory_id: str, request: Request, include_tokens: bool = False) -> Response:
    """The trajectory's calls in order (messages, completion, token counts) and its reward; with
    `?include_tokens=true` also the exact token ids and logprobs."""
    check_id(trajectory_id, "trajectory id")
    view = await asyncio.to_thread(trajectory_view, gateway_state(request).engine, trajectory_id, include_tokens)
    if view is None:
        raise GatewayError(404, f"no trajectory {trajectory_id!r}", code="trajectory_not_found")
    return json_response(view)


@router.get("/v1/groups/{group_id}")
async def get_group(group_id: str, request: Request) -> dict[str, Any]:
    """The group's state, expected size, trajectories with rewards, and the trainer's claim on it."""
    check_id(group_id, "group id")
    view = await asyncio.to_thread(group_view, gateway_state(request).engine, group_id)
    if view is None:
        raise GatewayError(404, f"no group {group_id!r}", code="group_not_found")
    return view
