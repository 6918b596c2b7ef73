"""Read back what the gateway stored, straight from the database, for assertions."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, MetaData, func, select

from gateway.store.arrays import decode_ids, decode_logprobs
from gateway.store.db import make_engine
from gateway.store.lineage import Rebuilder
from gateway.store.models import Call, Group, Trajectory

if TYPE_CHECKING:
    from trainer.samples import TrajectoryData


def stored_calls(db_url: str, trajectory_id: str) -> list[dict[str, Any]]:
    """The trajectory's calls in order, arrays decoded, with the group they landed in. `prompt_token_ids` is the
    full prompt (rebuilt from the predecessor's ids, gateway.store.lineage) and `request` the full request (rebuilt
    from the predecessor's messages, gateway.store.messages); what the row itself holds is `stored_prompt_token_ids`
    and `stored_request`."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                select(
                    Call.__table__,
                    Group.group_id.label("g_id"),
                    Group.expected_size.label("g_size"),
                    Group.mode.label("g_mode"),
                )
                .join(Trajectory, Trajectory.trajectory_id == Call.trajectory_id)
                .join(Group, Group.group_id == Trajectory.group_id)
                .where(Call.trajectory_id == trajectory_id)
                .order_by(Call.seq, Call.choice_index)
            ).all()
    finally:
        engine.dispose()
    out = []
    rebuilder = Rebuilder()
    for row in rows:
        call = {column.name: row._mapping[column] for column in Call.__table__.columns}
        call["stored_prompt_token_ids"] = decode_ids(call["prompt_token_ids"])
        call["completion_token_ids"] = decode_ids(call["completion_token_ids"])
        call["prompt_token_ids"] = rebuilder.prompt(
            call["seq"],
            call["choice_index"],
            call["stored_prompt_token_ids"],
            call["completion_token_ids"],
            call["parent_seq"],
            call["prefix_len"],
        )
        call["stored_request"] = call["request"]
        call["request"] = rebuilder.request(
            call["seq"], call["choice_index"], call["request"], call["messages_parent_seq"], call["messages_prefix_len"]
        )
        call["completion_logprobs"] = decode_logprobs(call["completion_logprobs"])
        call["group"] = {"group_id": row.g_id, "expected_size": row.g_size, "mode": row.g_mode}
        out.append(call)
    return out


def insert_old_calls(engine: Engine, rows: list[dict[str, Any]]) -> None:
    """Calls as an older schema revision stored them, with the run, group and trajectory they name (run-a, group-1,
    traj-1): the tables are reflected from the database, so each row is typed the way that revision stored it and
    keeps only the columns it had."""
    created = rows[0]["created_at"]
    with engine.begin() as conn:
        tables = MetaData()
        tables.reflect(conn, only=["runs", "groups", "trajectories", "calls"])
        conn.execute(
            tables.tables["runs"].insert(),
            {"name": "run-a", "base_model": "base-model", "config": {}, "created_at": created, "updated_at": created},
        )
        conn.execute(
            tables.tables["groups"].insert(),
            {"group_id": "group-1", "run": "run-a", "mode": "train", "closed": False, "state": "open",
             "created_at": created},
        )
        conn.execute(
            tables.tables["trajectories"].insert(),
            {"trajectory_id": "traj-1", "run": "run-a", "group_id": "group-1", "mode": "train",
             "untrainable_calls": 0, "created_at": created},
        )
        calls = tables.tables["calls"]
        conn.execute(calls.insert(), [{k: v for k, v in row.items() if k in calls.c} for row in rows])


def count_calls(db_url: str) -> int:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return conn.execute(select(func.count()).select_from(Call)).scalar_one()
    finally:
        engine.dispose()


def tree_rows(calls: list[dict[str, Any]]) -> int:
    """Rows the trainer makes of a trajectory (trainer.samples): a call opens one when it is a root of the call tree,
    or when its tree parent was already continued by an earlier call (a cut or re-serialised tool call sends the next
    turn back to the call before it: a fork). The gateway recorded each call's tree parent."""
    continued: set[tuple[int, int]] = set()
    rows = 0
    for call in calls:
        if call["tree_parent_seq"] is None:
            rows += 1
            continue
        parent = (call["tree_parent_seq"], call["tree_parent_choice"] or 0)
        rows += parent in continued
        continued.add(parent)
    return rows


def as_trajectory_data(trajectory_id: str, reward: float, calls: list[dict[str, Any]]) -> TrajectoryData:
    """Stored calls (stored_calls) as the trainer's input, trainer.samples.TrajectoryData, to lay them out as rows."""
    from trainer.samples import CallData, TrajectoryData  # torch: only for the tests that build samples

    names = [f.name for f in fields(CallData)]
    return TrajectoryData(trajectory_id, reward, [CallData(**{name: call[name] for name in names}) for call in calls])
