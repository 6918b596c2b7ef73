"""gateway_peers: every live gateway process on the database and how far its record writer has caught up

Each gateway upserts its row every TRAJGATE_PEER_POLL_S: `seen_at` (liveness) and `flushed_through`, a time on the
database's clock such that every call the gateway answered before it is in the database. A reward, close or judge
request reaching any gateway waits until every other live gateway's `flushed_through` has passed the moment the
request arrived, so calls answered by another gateway are counted without sticky sessions (gateway/peers.py).
Times are seconds since the epoch on the database's clock, so gateways on different hosts need no clock agreement.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gateway_peers",
        sa.Column("gateway_id", sa.String(128), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("seen_at", sa.Float(), nullable=False),
        sa.Column("flushed_through", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("gateway_id", name=op.f("pk_gateway_peers")),
    )


def downgrade() -> None:
    op.drop_table("gateway_peers")
