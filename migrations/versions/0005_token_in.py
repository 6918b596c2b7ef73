"""calls: history_key and segment_reason for the token_in run mode

A token_in call records, per choice, a hash of the messages it answered plus the assistant message it returned
(`history_key`); the next call of the trajectory finds its predecessor by hashing the client's history, in any
gateway process, through the (trajectory_id, history_key) index. `segment_reason` says why a token_in call started a
new token sequence instead of continuing one (null when it continued one, and on chat-mode calls).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("history_key", sa.String(64), nullable=True))
        batch.add_column(sa.Column("segment_reason", sa.String(32), nullable=True))
        batch.create_index("ix_calls_trajectory_id_history_key", ["trajectory_id", "history_key"])


def downgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.drop_index("ix_calls_trajectory_id_history_key")
        batch.drop_column("segment_reason")
        batch.drop_column("history_key")
