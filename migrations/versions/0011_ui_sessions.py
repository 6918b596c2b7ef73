"""ui_sessions: web UI logins, one row per login; calls.finish_reason unbounded

A login gets a random session id (the cookie); the row holds only its SHA-256, when it was made, when it expires,
when it was revoked (logout) and a fingerprint of the admin key it was made with, so a session ends at logout, at its
expiry or when the admin key changes, on every gateway that shares the database (gateway/store/ui_sessions.py).

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
    op.create_table(
        "ui_sessions",
        sa.Column("id_hash", sa.String(64), nullable=False),
        sa.Column("admin_key_hash", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id_hash", name=op.f("pk_ui_sessions")),
    )
    op.create_index(op.f("ix_ui_sessions_expires_at"), "ui_sessions", ["expires_at"])
    with op.batch_alter_table("calls") as batch:
        batch.alter_column("finish_reason", type_=sa.Text(), existing_type=sa.String(32), existing_nullable=True)


def downgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.alter_column("finish_reason", type_=sa.String(32), existing_type=sa.Text(), existing_nullable=True)
    op.drop_index(op.f("ix_ui_sessions_expires_at"), table_name="ui_sessions")
    op.drop_table("ui_sessions")
