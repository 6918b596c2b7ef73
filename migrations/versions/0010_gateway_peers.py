"""gateway_peers: every live gateway process on the database and how far its record writer has caught up

Each gateway upserts its row every TRAJGATE_PEER_POLL_S: `seen_at` (liveness, seconds since the epoch on the database's
clock) and `flushed_through`, a moment such that every call the gateway answered before it is in the database. A
reward, close or judge request reaching any gateway waits until every other live gateway's `flushed_through` has
passed the moment the request arrived, so calls answered by another gateway are counted without sticky sessions
(gateway/recorder/heartbeat.py). Moments are values of the sequence `gateway_peers_moment` (Postgres): a later nextval is always
larger, so the order of moments is the order in which they were taken, with no clock to agree on or to step back.

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
        sa.Column("flushed_through", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("gateway_id", name=op.f("pk_gateway_peers")),
    )
    if op.get_bind().dialect.name == "postgresql":
        # CACHE 1 (the default, said explicitly): with values cached per session, a later nextval could be smaller.
        op.execute("CREATE SEQUENCE gateway_peers_moment CACHE 1")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP SEQUENCE gateway_peers_moment")
    op.drop_table("gateway_peers")
