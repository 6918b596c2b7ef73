"""admissions and admission_refusals: the gateway's bound on groups in flight per run, shared by every gateway

A train-mode call that starts a group is admitted once per group (a row in admissions); what counts against the
run's bound is the admitted groups not yet trained or dropped. admission_refusals counts the calls turned away.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "admissions",
        sa.Column("group_id", sa.String(128), nullable=False),
        sa.Column("run", sa.String(128), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("admitted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("wait_s", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["run"], ["runs.name"], name=op.f("fk_admissions_run_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("group_id", name=op.f("pk_admissions")),
    )
    op.create_index(op.f("ix_admissions_run_policy_version"), "admissions", ["run", "policy_version"])
    op.create_table(
        "admission_refusals",
        sa.Column("run", sa.String(128), nullable=False),
        sa.Column("rejected", sa.Integer(), nullable=False),
        sa.Column("timed_out", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run"], ["runs.name"], name=op.f("fk_admission_refusals_run_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run", name=op.f("pk_admission_refusals")),
    )


def downgrade() -> None:
    op.drop_table("admission_refusals")
    op.drop_index(op.f("ix_admissions_run_policy_version"), table_name="admissions")
    op.drop_table("admissions")
