"""calls: linear storage of request messages (messages_parent_seq, messages_prefix_len)

A call whose request messages start with its predecessor's request messages now stores only the messages past that
shared prefix and names the predecessor's seq; reads and export rebuild the full request (gateway.store.messages).
Existing rows keep their whole requests (messages_parent_seq null, messages_prefix_len 0), which reads pass through
unchanged, so no data is rewritten; later calls of those trajectories are stored compact against them.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("messages_parent_seq", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("messages_prefix_len", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    # Compact rows hold only the messages past their parent's: put whole requests back before the columns go.
    from gateway.store.records import materialize_requests

    materialize_requests(op.get_bind())
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("messages_prefix_len")
        batch.drop_column("messages_parent_seq")
