"""initial schema: runs, policy_versions, groups, trajectories, calls, train_steps

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _json() -> sa.types.TypeEngine:
    return sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def _timestamp(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("base_model", sa.String(512), nullable=False),
        sa.Column("base_weights", sa.String(1024), nullable=True),
        sa.Column("config", _json(), nullable=False),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_runs")),
    )
    op.create_table(
        "groups",
        sa.Column("group_id", sa.String(128), nullable=False),
        sa.Column("run", sa.String(128), nullable=False),
        sa.Column("mode", sa.String(8), nullable=False),
        sa.Column("expected_size", sa.Integer(), nullable=True),
        sa.Column("closed", sa.Boolean(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("claimed_by", sa.String(256), nullable=True),
        _timestamp("lease_until", nullable=True),
        sa.Column("trained_step", sa.Integer(), nullable=True),
        sa.Column("drop_reason", sa.Text(), nullable=True),
        _timestamp("created_at"),
        _timestamp("ready_at", nullable=True),
        sa.ForeignKeyConstraint(["run"], ["runs.name"], name=op.f("fk_groups_run_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("group_id", name=op.f("pk_groups")),
    )
    op.create_index(op.f("ix_groups_run_state_ready_at"), "groups", ["run", "state", "ready_at"])
    op.create_table(
        "policy_versions",
        sa.Column("run", sa.String(128), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("served_name", sa.String(512), nullable=False),
        sa.Column("adapter_path", sa.String(1024), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        _timestamp("created_at"),
        sa.ForeignKeyConstraint(
            ["run"], ["runs.name"], name=op.f("fk_policy_versions_run_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run", "step", name=op.f("pk_policy_versions")),
    )
    op.create_table(
        "train_steps",
        sa.Column("run", sa.String(128), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("metrics", _json(), nullable=False),
        _timestamp("created_at"),
        sa.ForeignKeyConstraint(["run"], ["runs.name"], name=op.f("fk_train_steps_run_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run", "step", name=op.f("pk_train_steps")),
    )
    op.create_table(
        "trajectories",
        sa.Column("trajectory_id", sa.String(128), nullable=False),
        sa.Column("run", sa.String(128), nullable=False),
        sa.Column("group_id", sa.String(128), nullable=False),
        sa.Column("mode", sa.String(8), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("metrics", _json(), nullable=True),
        sa.Column("metadata", _json(), nullable=True),
        sa.Column("untrainable_calls", sa.Integer(), nullable=False),
        _timestamp("created_at"),
        _timestamp("rewarded_at", nullable=True),
        sa.ForeignKeyConstraint(
            ["group_id"], ["groups.group_id"], name=op.f("fk_trajectories_group_id_groups"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(["run"], ["runs.name"], name=op.f("fk_trajectories_run_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("trajectory_id", name=op.f("pk_trajectories")),
    )
    op.create_index(op.f("ix_trajectories_group_id"), "trajectories", ["group_id"])
    op.create_index(op.f("ix_trajectories_run_created_at"), "trajectories", ["run", "created_at"])
    op.create_table(
        "calls",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("trajectory_id", sa.String(128), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("choice_index", sa.Integer(), nullable=False),
        sa.Column("run", sa.String(128), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("request", _json(), nullable=True),
        sa.Column("response", _json(), nullable=True),
        sa.Column("prompt_token_ids", sa.LargeBinary(), nullable=True),
        sa.Column("completion_token_ids", sa.LargeBinary(), nullable=True),
        sa.Column("completion_logprobs", sa.LargeBinary(), nullable=True),
        sa.Column("finish_reason", sa.String(32), nullable=True),
        sa.Column("usage", _json(), nullable=True),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("trainable", sa.Boolean(), nullable=False),
        sa.Column("untrainable_reason", sa.Text(), nullable=True),
        sa.Column("latency_ms", sa.Float(), nullable=True),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("retry_count", sa.Integer(), nullable=False),
        sa.Column("idempotency_key", sa.String(256), nullable=True),
        _timestamp("created_at"),
        sa.ForeignKeyConstraint(
            ["trajectory_id"],
            ["trajectories.trajectory_id"],
            name=op.f("fk_calls_trajectory_id_trajectories"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_calls")),
        # Doubles as the index for reading a trajectory's calls in order.
        sa.UniqueConstraint(
            "trajectory_id", "seq", "choice_index", name=op.f("uq_calls_trajectory_id_seq_choice_index")
        ),
    )


def downgrade() -> None:
    op.drop_table("calls")
    op.drop_index(op.f("ix_trajectories_run_created_at"), table_name="trajectories")
    op.drop_index(op.f("ix_trajectories_group_id"), table_name="trajectories")
    op.drop_table("trajectories")
    op.drop_table("train_steps")
    op.drop_table("policy_versions")
    op.drop_index(op.f("ix_groups_run_state_ready_at"), table_name="groups")
    op.drop_table("groups")
    op.drop_table("runs")
