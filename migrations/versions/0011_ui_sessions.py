"""calls.finish_reason unbounded

`calls.finish_reason` was varchar(32): an upstream that sent a longer one had its call answered and then refused by
the store. It is the upstream's word, kept as sent, so the column is unbounded (on Postgres varchar to text changes no
stored row).

Revision ID: 0011_ui_sessions
Revises: 0010
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_ui_sessions"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.alter_column("finish_reason", type_=sa.Text(), existing_type=sa.String(32), existing_nullable=True)


def downgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.alter_column("finish_reason", type_=sa.String(32), existing_type=sa.Text(), existing_nullable=True)
