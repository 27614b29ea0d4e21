"""The sync's hot path (weights/stream.py): which trainer endpoint served each version
(`policy_versions.stream_endpoint`) and how each load reached its server (`sync_events.transport`).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07 14:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('policy_versions', sa.Column('stream_endpoint', sa.Text(), nullable=True))
    op.add_column('sync_events', sa.Column('transport', sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column('sync_events', 'transport')
    op.drop_column('policy_versions', 'stream_endpoint')
