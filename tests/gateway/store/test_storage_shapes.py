"""Stored prompt ids per trajectory shape, counted in bytes, on SQLite and Postgres: a trajectory stores about its
distinct ids whatever its shape (linear chat, supervisor with a sub-agent every 8th call, two alternating forks,
compaction), so storage (ids and request messages) grows linearly with its turns, and every reader rebuilds exactly
the prompts and requests written.

Before prompts were stored against the call-tree parent, each was stored against the call that arrived before it:
a supervisor resuming after its sub-agent's call stored its whole history again (x14 the bytes for x4 the turns)."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, Text, cast, func, select

from gateway.store.export import iter_trajectories
from gateway.store.models import Call
from gateway.store.reads import trajectory_view
from gateway.store.records import LineageCache, write_calls
from gateway.store.training import load_groups
from tests.support.lineage_writes import set_reward
from tests.support.trajectory_shapes import SHAPES, SUB_SYSTEM, SUB_SYSTEM_SHARED, shaped

TURNS = (16, 32, 64)


def _stored(engine: Engine, trajectory_id: str) -> tuple[int, int]:
    """Ids stored for the trajectory's prompts and completions (4 bytes an id), and its requests' JSON length."""
    with engine.connect() as conn:
        prompt, completion, request = conn.execute(
            select(
                func.sum(func.length(Call.prompt_token_ids)),
                func.sum(func.length(Call.completion_token_ids)),
                func.sum(func.length(cast(Call.request, Text))),
            ).where(Call.trajectory_id == trajectory_id)
        ).one()
    return (prompt + completion) // 4, request


@pytest.mark.parametrize("shape", SHAPES)
def test_stored_ids_stay_about_the_distinct_ids_whatever_the_shape(engine: Engine, shape: str) -> None:
    stored, requests = {}, {}
    for turns in TURNS:
        trajectory = shaped(shape, turns, seed=turns, trajectory_id=f"{shape}-{turns}")
        for record in trajectory.records:  # one call per batch, as the writer does at low traffic
            write_calls(engine, [record])
        stored[turns], requests[turns] = _stored(engine, trajectory.records[0].trajectory_id)
        # A sub-agent started again repeats its own system prompt (a root extends no recorded call).
        again = turns // 8 - 1 if shape == "supervisor" else 0
        repeated = again * (len(SUB_SYSTEM) - SUB_SYSTEM_SHARED)
        assert trajectory.distinct <= stored[turns] <= trajectory.distinct + repeated, (shape, turns, stored[turns])
        if shape == "linear":
            assert stored[turns] == trajectory.final  # exactly the final sequence, as before
    assert stored[64] <= 4.2 * stored[16], stored  # linear in the turns
    assert requests[64] <= 4.2 * requests[16], requests


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cold", [False, True])
def test_every_reader_rebuilds_the_prompts_of_every_shape(engine: Engine, shape: str, cold: bool) -> None:
    """Read API, export and the trainer's groups give back exactly the prompts written, also when each call was
    written by a process that had not seen the ones before it (`cold`: no predecessor cache)."""
    trajectory = shaped(shape, 24, seed=7, trajectory_id="traj-1")
    cache = None if cold else LineageCache()
    for record in trajectory.records:
        write_calls(engine, [record], cache)
    set_reward(engine, "traj-1")
    full = [record.prompt_token_ids for record in trajectory.records]
    view = trajectory_view(engine, "traj-1", include_tokens=True)
    assert view is not None
    [exported] = [t for t in iter_trajectories(engine, "run-a") if t["trajectory_id"] == "traj-1"]
    [group] = load_groups(engine, ["group-1"])
    [loaded] = group["trajectories"]
    assert [c["prompt_token_ids"] for c in view["calls"]] == full
    assert [c["prompt_token_ids"] for c in exported["calls"]] == full
    assert [c["prompt_token_ids"] for c in loaded["calls"]] == full
    messages = [record.request["messages"] for record in trajectory.records]  # type: ignore[index]
    assert [c["messages"] for c in view["calls"]] == messages
    assert [c["messages"] for c in exported["calls"]] == messages
