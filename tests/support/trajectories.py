"""Helpers for tests of the rewards and read APIs: make recorded calls through the gateway, then poke the store."""

from __future__ import annotations

from typing import Any

import httpx
from sqlalchemy import update

from gateway.store.db import make_engine
from gateway.store.models import Group
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import RunningGateway
from tests.support.openai_calls import client_body


def make_calls(
    gw: RunningGateway,
    upstream: FakeUpstream,
    trajectories: list[str],
    group: str | None = None,
    size: int | None = None,
    fixture: str = "chat",
    **headers: str,
) -> None:
    """One recorded chat call per trajectory (attributed by headers), answered from a vLLM recording."""
    body = client_body(upstream.fixture(fixture))
    with httpx.Client(base_url=gw.base_url, timeout=30) as client:
        for trajectory in trajectories:
            sent = {"X-Trajectory-Id": trajectory, **headers}
            if group is not None:
                sent["X-Group-Id"] = group
            if size is not None:
                sent["X-Group-Size"] = str(size)
            response = client.post("/chat/completions", json=body, headers=sent)
            assert response.status_code == 200, response.text


def reward(gw: RunningGateway, trajectory: str, value: Any, **extra: Any) -> httpx.Response:
    return httpx.post(f"{gw.base_url}/trajectories/{trajectory}/reward", json={"reward": value, **extra}, timeout=30)


def group(gw: RunningGateway, group_id: str) -> dict[str, Any]:
    response = httpx.get(f"{gw.base_url}/groups/{group_id}", timeout=30)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def set_group_state(db_url: str, group_id: str, state: str) -> None:
    """Stand in for the trainer, which claims ready groups and marks them trained or dropped."""
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(update(Group).where(Group.group_id == group_id).values(state=state))
    finally:
        engine.dispose()
