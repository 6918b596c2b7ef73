"""trainer_leases (one trainer per run) and trajectories.trained_step (no trajectory trains twice)

A second `trajgate train` on a run used to compute the same next step as the first and collide on train_steps or
the checkpoint directory after a whole step of work; the run-level lease makes it wait. trained_step records which
step trained a trajectory, so a group reopened by a late trajectory trains only the trajectories no step has had.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "trainer_leases",
        sa.Column("run", sa.String(128), nullable=False),
        sa.Column("holder", sa.String(256), nullable=False),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run"], ["runs.name"], name=op.f("fk_trainer_leases_run_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run", name=op.f("pk_trainer_leases")),
    )
    with op.batch_alter_table("trajectories") as batch:
        batch.add_column(sa.Column("trained_step", sa.Integer(), nullable=True))
    # Trajectories of groups trained before this revision were trained by that step.
    op.execute(
        "UPDATE trajectories SET trained_step = (SELECT g.trained_step FROM groups g "
        "WHERE g.group_id = trajectories.group_id) "
        "WHERE reward IS NOT NULL AND group_id IN (SELECT group_id FROM groups WHERE state = 'trained')"
    )


def downgrade() -> None:
    with op.batch_alter_table("trajectories") as batch:
        batch.drop_column("trained_step")
    op.drop_table("trainer_leases")
