"""calls: merge diagnostics (merge_reason, divergence) and linear storage (parent_seq, prefix_len)

A call whose prompt extends its predecessor's prompt + completion now stores only the ids past that shared prefix and
names the predecessor's seq; reads, export and the trainer rebuild the full prompt (gateway.store.lineage). Existing
rows keep their full prompts (parent_seq null, prefix_len 0), which reads pass through unchanged, so no data is
rewritten; their merge_reason stays null (not computed). Only calls written from this revision on are compact.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("merge_reason", sa.String(32), nullable=True))
        batch.add_column(sa.Column("divergence", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("parent_seq", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("prefix_len", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    # Compact rows hold only their prompt's suffix: put the full prompt back before the columns that explain it go.
    from gateway.store.records import materialize_prompts

    materialize_prompts(op.get_bind())
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("prefix_len")
        batch.drop_column("parent_seq")
        batch.drop_column("divergence")
        batch.drop_column("merge_reason")
