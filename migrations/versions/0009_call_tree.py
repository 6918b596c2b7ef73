"""calls: a trajectory is a tree of calls (tree_parent_seq, tree_parent_choice, tokens_len, tokens_key)

A call's tree parent is the recorded call of its trajectory whose prompt + completion ids its prompt extends the
furthest (gateway.store.tree), not the previous call by arrival, so a supervisor resuming after a sub-agent, parallel
branches and a retried turn each hang off the call they continue. `tokens_key` is a hash of a call's prompt +
completion ids and `tokens_len` their count: a new call hashes its own prompt at those lengths to find its parent in
one pass over its own ids, whichever gateway process wrote the candidates. `parent_seq` keeps its meaning (where the
stored prompt's prefix comes from); the tree parent has its own pair of columns because that prefix is chosen for
storage and may differ. Rows written before this revision have none (null): they are roots, and never candidates.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("tree_parent_seq", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("tree_parent_choice", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("tokens_len", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("tokens_key", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("tokens_key")
        batch.drop_column("tokens_len")
        batch.drop_column("tree_parent_choice")
        batch.drop_column("tree_parent_seq")
