"""calls: what matches a client's retry to the attempt it repeats (request_hash, first_seq, first_retry_count)

A retry is matched by content in the store, not by a per-process turn counter: `request_hash` identifies the request
(or its Idempotency-Key) within the trajectory, and `first_seq` / `first_retry_count` say which earliest attempt a row
stands for, so attempts settle into the same rows whatever order they reach the database in (gateway.store.attempts).
Rows written before this revision have none (null) and are never matched; they keep what they hold.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("request_hash", sa.LargeBinary(), nullable=True))
        batch.add_column(sa.Column("first_seq", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("first_retry_count", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("first_retry_count")
        batch.drop_column("first_seq")
        batch.drop_column("request_hash")
