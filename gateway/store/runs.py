"""Runs: their configuration, what the gateway routes them to, their progress, and the trainer's step log."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from datetime import datetime
from typing import Any, NamedTuple, cast

from sqlalchemy import Connection, Engine, Table, case, func, select, update
from sqlalchemy.dialects import postgresql, sqlite

from gateway.runs.config import RunConfig, merged_config
from gateway.store.adapter_slots import adapters_held
from gateway.store.admission import admission_view
from gateway.store.db import write_transaction
from gateway.store.models import Call, PolicyVersion, Run, TrainerLease, TrainStep, Trajectory, utcnow
from gateway.store.peers import clock
from gateway.store.reads import iso
from gateway.store.run_activity import RunActivity, run_activity


class MissingBaseModel(ValueError):
    """A new run needs the name vLLM serves its base model under, and none was given or known."""


class RouteRow(NamedTuple):
    run: str
    base_model: str
    version: int | None  # newest loaded policy version; None when only the base model serves the run
    served_name: str | None
    sampling: dict[str, Any]
    on_policy_sampling: bool
    token_mode: str
    admission: str  # "wait", "reject" or "off" (gateway/runs/config.py)
    admission_timeout_s: float
    # A trainer holds the run or has committed a step: admission has something to pace against.
    trained: bool
    max_staleness: int
    # Every version vLLM serves the run by, oldest first, as (step, served name); step 0 is the base model.
    loaded: tuple[tuple[int, str], ...]


def _insert(conn: Connection) -> Callable[..., Any]:
    return postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert


def _current_versions() -> Any:
    """Per run, the newest loaded policy version and the name vLLM serves it under."""
    newest = (
        select(PolicyVersion.run, func.max(PolicyVersion.step).label("step"))
        .where(PolicyVersion.status == "loaded")
        .group_by(PolicyVersion.run)
        .subquery()
    )
    return (
        select(PolicyVersion.run, PolicyVersion.step, PolicyVersion.served_name)
        .join(newest, (newest.c.run == PolicyVersion.run) & (newest.c.step == PolicyVersion.step))
        .subquery()
    )


@functools.cache
def _route_query() -> Any:
    """Built once: its subqueries copy columns into reference cycles, and rebuilt every second they were most of
    the garbage the gateway's cyclic collector had to find (pauses of milliseconds on the hot path)."""
    current = _current_versions()
    trained = select(TrainerLease.run).where(TrainerLease.run == Run.name).exists() | (
        select(TrainStep.run).where(TrainStep.run == Run.name).exists()
    )
    return select(
        Run.name, Run.base_model, Run.config, current.c.step, current.c.served_name, trained.label("trained")
    ).outerjoin(current, current.c.run == Run.name)


@functools.cache
def _loaded_query() -> Any:
    return select(PolicyVersion.run, PolicyVersion.step, PolicyVersion.served_name).where(
        PolicyVersion.status == "loaded"
    )


def route_table(engine: Engine) -> tuple[list[RouteRow], float]:
    """Everything the gateway's in-memory router needs, in two queries on one connection (it runs every second):
    the runs, and every loaded version (a group is served by a version its staleness bound allows, which is not
    always the newest: gateway/proxy/admit.py); and the database's clock before they ran (a version retired before it
    is not in the table: the gateway's heartbeat says so, gateway/store/peers.py `routes_behind`)."""
    with engine.connect() as conn:
        read_at = clock(conn)
        rows = conn.execute(_route_query()).all()
        versions = conn.execute(_loaded_query()).all()
    loaded: dict[str, dict[int, str]] = {}
    for version in versions:
        loaded.setdefault(version.run, {})[version.step] = version.served_name
    defaults = RunConfig.model_fields
    routes = []
    for row in rows:
        config = row.config or {}  # a run the gateway created on a first call stores {}: the defaults apply
        served = {0: row.base_model, **loaded.get(row.name, {})}
        routes.append(
            RouteRow(
                row.name,
                row.base_model,
                row.step,
                row.served_name,
                config.get("sampling") or {},
                config.get("on_policy_sampling", True),
                config.get("token_mode", "chat"),
                config.get("admission", defaults["admission"].default),
                config.get("admission_timeout_s", defaults["admission_timeout_s"].default),
                bool(row.trained),
                config.get("max_staleness", defaults["max_staleness"].default),
                tuple(sorted(served.items())),
            )
        )
    return routes, read_at


def upsert_run(
    engine: Engine,
    name: str,
    partial_config: dict[str, Any],
    base_model: str | None = None,
    base_weights: str | None = None,
    default_base_model: str | None = None,
) -> bool:
    """Create the run or update it; `partial_config` is merged over the stored config (or the defaults).

    True if the run was created. Raises pydantic.ValidationError for a bad config and MissingBaseModel when a new
    run's base model is unknown. Runs the gateway created on a first call (config `{}`) are updated like any other.
    """
    with write_transaction(engine) as conn:
        locked = select(Run.config).where(Run.name == name).with_for_update()
        row = conn.execute(locked).first()
        if row is None:
            model = base_model or default_base_model
            if model is None:
                raise MissingBaseModel(f"run {name!r} is new: give its base_model (the name vLLM serves it under)")
            insert = _insert(conn)(Run).values(
                name=name,
                base_model=model,
                base_weights=base_weights,
                config=merged_config(None, partial_config).stored(),
                created_at=utcnow(),
                updated_at=utcnow(),
            )
            inserted = insert.on_conflict_do_nothing(index_elements=["name"]).returning(Run.name)
            if conn.execute(inserted).first() is not None:
                return True
            row = conn.execute(locked).one()  # created by a concurrent request since our first look
        values: dict[str, Any] = {"config": merged_config(row.config, partial_config).stored(), "updated_at": utcnow()}
        if base_model is not None:
            values["base_model"] = base_model
        if base_weights is not None:
            values["base_weights"] = base_weights
        conn.execute(update(Run).where(Run.name == name).values(**values))
        return False


def _run_summary(row: Any) -> dict[str, Any]:
    return {
        "name": row.name,
        "base_model": row.base_model,
        "base_weights": row.base_weights,
        "config": merged_config(row.config, {}).model_dump(mode="json"),
        "policy_version": row.step or 0,
        "served_name": row.served_name or row.base_model,
        "created_at": iso(row.created_at),
        "updated_at": iso(row.updated_at),
    }


def _runs_query() -> Any:
    current = _current_versions()
    return select(
        Run.name,
        Run.base_model,
        Run.base_weights,
        Run.config,
        Run.created_at,
        Run.updated_at,
        current.c.step,
        current.c.served_name,
    ).outerjoin(current, current.c.run == Run.name)


def list_runs(engine: Engine, name: str | None = None) -> list[dict[str, Any]]:
    """Every run (or only `name`) with its effective config (defaults filled in), current policy version, the adapters
    it holds in vLLM's slots, groups by state, and where training stands (gateway.store.run_activity): a fixed number
    of queries for any number of runs."""
    query = _runs_query().order_by(Run.name)
    if name is not None:
        query = query.where(Run.name == name)
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    activity = run_activity(engine, name)
    held = adapters_held(engine)
    now = utcnow()
    runs = []
    for row in rows:
        summary = {**_run_summary(row), "adapters": held.get(row.name, [])}
        runs.append({**summary, **_activity_fields(activity.get(row.name, RunActivity()), now)})
    return runs


def _activity_fields(activity: RunActivity, now: datetime) -> dict[str, Any]:
    return {
        "groups": activity.groups.get("train", {}),
        "eval_groups": activity.groups.get("eval", {}),
        **activity.as_json(now),
    }


def run_exists(engine: Engine, name: str) -> bool:
    with engine.connect() as conn:
        return conn.execute(select(Run.name).where(Run.name == name)).first() is not None


def trajectory_counts(conn: Connection, run: str) -> dict[str, dict[str, int]]:
    """Per mode (train, eval): the run's trajectories, how many have a reward, how many hold an untrainable call."""
    rows = conn.execute(
        select(
            Trajectory.mode,
            func.count(),
            func.count(Trajectory.reward),
            func.sum(case((Trajectory.untrainable_calls > 0, 1), else_=0)),
        )
        .where(Trajectory.run == run)
        .group_by(Trajectory.mode)
    ).all()
    counts = {
        mode: {"total": total, "rewarded": rewarded, "untrainable": int(untrainable or 0)}
        for mode, total, rewarded, untrainable in rows
    }
    return {mode: counts.get(mode, {"total": 0, "rewarded": 0, "untrainable": 0}) for mode in ("train", "eval")}


def run_view(engine: Engine, name: str) -> dict[str, Any] | None:
    """The run summary plus its progress: groups by state, where training stands (as in the runs list), trajectory
    counts, the last step with its metrics, admission, the eval curve."""
    first_version = (
        select(func.min(Call.policy_version)).where(Call.trajectory_id == Trajectory.trajectory_id).scalar_subquery()
    )
    eval_rewards = (
        select(Trajectory.reward, first_version.label("version"))
        .where(Trajectory.run == name, Trajectory.mode == "eval", Trajectory.reward.is_not(None))
        .subquery()
    )
    with engine.connect() as conn:
        row = conn.execute(_runs_query().where(Run.name == name)).first()
        if row is None:
            return None
        trajectories = trajectory_counts(conn, name)
        last = conn.execute(
            select(TrainStep.step, TrainStep.metrics, TrainStep.created_at)
            .where(TrainStep.run == name)
            .order_by(TrainStep.step.desc())
            .limit(1)
        ).first()
        reasons = conn.execute(
            # Through trajectories (indexed by run), not calls.run (not indexed).
            select(Call.merge_reason, func.count())
            .join(Trajectory, Trajectory.trajectory_id == Call.trajectory_id)
            .where(Trajectory.run == name, Call.choice_index == 0)
            .group_by(Call.merge_reason)
        ).all()
        curve = conn.execute(
            select(eval_rewards.c.version, func.avg(eval_rewards.c.reward), func.count())
            .where(eval_rewards.c.version.is_not(None))
            .group_by(eval_rewards.c.version)
            .order_by(eval_rewards.c.version)
        ).all()
        adapters = adapters_held(conn).get(name, [])
    activity = run_activity(engine, name).get(name, RunActivity())
    return {
        **_run_summary(row),
        "adapters": adapters,
        "merge": _merge_summary({reason: count for reason, count in reasons}),
        **_activity_fields(activity, utcnow()),
        "trajectories": trajectories,
        "last_step": None if last is None else _step(last),
        # The bound on groups in flight and what it cost each side (gateway.store.admission).
        "admission": admission_view(engine, name, row.config or {}),
        # Mean reward of evaluation trajectories per policy version that started them: the curve to watch.
        "eval_reward_by_version": [
            {"policy_version": version, "mean_reward": mean, "trajectories": count} for version, mean, count in curve
        ],
    }


def _merge_summary(by_reason: dict[str | None, int]) -> dict[str, Any]:
    """How the run's calls (choice 0) relate to their predecessors (gateway.store.lineage). `merge_ratio` is the
    share of calls with a predecessor that extend it; calls recorded before the reason was count as `unknown`."""
    counts = {reason or "unknown": count for reason, count in by_reason.items()}
    with_predecessor = sum(count for reason, count in counts.items() if reason not in ("first_call", "unknown"))
    return {
        "calls": sum(counts.values()),
        "by_reason": dict(sorted(counts.items())),
        "merge_ratio": counts.get("extends", 0) / with_predecessor if with_predecessor else None,
    }


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity (Postgres refuses them): such metrics are stored as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def record_train_step(bind: Engine | Connection, run: str, step: int, metrics: dict[str, Any]) -> None:
    """Log what optimizer step `step` of `run` did; the read API and the live progress stream show it.

    Pass a Connection to make it part of the trainer's step-commit transaction (policy version, groups trained,
    metrics: all or nothing), or an Engine to write it on its own. A NaN loss is stored as null, not refused.
    """
    statement = (
        cast(Table, TrainStep.__table__)
        .insert()
        .values(run=run, step=step, metrics=_finite(metrics), created_at=utcnow())
    )
    if isinstance(bind, Connection):
        bind.execute(statement)
        return
    with bind.begin() as conn:
        conn.execute(statement)


def _step(row: Any) -> dict[str, Any]:
    return {"step": row.step, "metrics": row.metrics, "created_at": iso(row.created_at)}


def steps_after(engine: Engine, run: str, after: int = -1, limit: int = 1000) -> list[dict[str, Any]]:
    """The run's training steps with step > `after`, oldest first: the read API's page and the stream's poll."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(TrainStep.step, TrainStep.metrics, TrainStep.created_at)
            .where(TrainStep.run == run, TrainStep.step > after)
            .order_by(TrainStep.step)
            .limit(limit)
        ).all()
    return [_step(row) for row in rows]
