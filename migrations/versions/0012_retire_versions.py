"""policy_versions.retired_at, gateway_peers.routes_read_at: an adapter is unloaded only once no gateway can route to it

The trainer retires a version it no longer keeps (status `retiring`, `retired_at` on the database's clock, taken after
the status change committed): gateways stop routing to it at their next route reload. Each gateway publishes in its
heartbeat when it last read its route table (`routes_read_at`, the database's clock before the read), and the trainer
unloads the adapter from vLLM once every live gateway has read its routes after the retirement (gateway/store/peers.py
`routes_behind`), then marks it `unloaded`.

Revision ID: 0012
Revises: 0011_ui_sessions
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011_ui_sessions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("policy_versions") as batch:
        batch.add_column(sa.Column("retired_at", sa.Float(), nullable=True))
    with op.batch_alter_table("gateway_peers") as batch:
        batch.add_column(sa.Column("routes_read_at", sa.Float(), nullable=True))


def downgrade() -> None:
    # A version still retiring is served no more by any gateway that reloaded its routes: unloaded from here on.
    op.execute("UPDATE policy_versions SET status = 'unloaded' WHERE status = 'retiring'")
    with op.batch_alter_table("gateway_peers") as batch:
        batch.drop_column("routes_read_at")
    with op.batch_alter_table("policy_versions") as batch:
        batch.drop_column("retired_at")
