"""The schema: migrations run up/down/up on both backends, agree with the models, and `trajgate migrate` is idempotent."""

from __future__ import annotations

import os
import subprocess
import sys

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from gateway.store import db
from gateway.store.models import Base

TABLES = {
    "runs", "policy_versions", "groups", "trajectories", "calls", "train_steps", "trainer_leases", "admissions",
    "admission_refusals", "gateway_peers", "ui_sessions",
}
HEAD = "0012"


def _tables(url: str) -> set[str]:
    engine = db.make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_up_down_up(db_url: str) -> None:
    db.upgrade(db_url)
    assert _tables(db_url) == TABLES
    assert db.current_revision(db_url) == HEAD
    db.downgrade(db_url, "base")
    assert _tables(db_url) == set()
    assert db.current_revision(db_url) is None
    db.upgrade(db_url)
    assert _tables(db_url) == TABLES


def test_models_match_migrations(db_url: str) -> None:
    db.upgrade(db_url)
    engine = db.make_engine(db_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    finally:
        engine.dispose()
    assert diff == []


def test_indexes_for_later_queries(db_url: str) -> None:
    db.upgrade(db_url)
    engine = db.make_engine(db_url)
    try:
        insp = inspect(engine)
        group_ix = {tuple(ix["column_names"]) for ix in insp.get_indexes("groups")}
        traj_ix = {tuple(ix["column_names"]) for ix in insp.get_indexes("trajectories")}
        call_uq = {tuple(uq["column_names"]) for uq in insp.get_unique_constraints("calls")}
        call_ix = {tuple(ix["column_names"]) for ix in insp.get_indexes("calls")}
    finally:
        engine.dispose()
    assert ("run", "state", "ready_at") in group_ix
    assert ("group_id",) in traj_ix
    assert ("trajectory_id", "seq", "choice_index") in call_uq
    assert ("trajectory_id", "history_key") in call_ix  # token_in finds a call's predecessor by its history


def test_cli_migrate_twice(db_url: str) -> None:
    env = {**os.environ, "TRAJGATE_DATABASE_URL": db_url}
    first = subprocess.run([sys.executable, "-m", "gateway.cli", "migrate"], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert f"empty -> {HEAD}" in first.stdout
    second = subprocess.run([sys.executable, "-m", "gateway.cli", "migrate"], env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert f"already at {HEAD}" in second.stdout
    assert _tables(db_url) == TABLES


def test_large_call_columns_use_lz4_on_postgres(pg_url: str) -> None:
    db.upgrade(pg_url)
    engine = db.make_engine(pg_url)
    try:
        with engine.connect() as conn:
            methods = dict(
                conn.execute(
                    text(
                        "SELECT attname, attcompression FROM pg_attribute "
                        "WHERE attrelid = 'calls'::regclass AND attname IN "
                        "('prompt_token_ids', 'completion_token_ids', 'completion_logprobs', 'request', 'response')"
                    )
                ).all()
            )
    finally:
        engine.dispose()
    assert methods == dict.fromkeys(methods, "l") and len(methods) == 5  # 'l': lz4
    db.downgrade(pg_url, "0001")
    engine = db.make_engine(pg_url)
    try:
        with engine.connect() as conn:
            restored = conn.execute(
                text("SELECT attcompression FROM pg_attribute WHERE attrelid = 'calls'::regclass "
                     "AND attname = 'prompt_token_ids'")
            ).scalar_one()
    finally:
        engine.dispose()
    assert restored == "p"  # 'p': pglz
