"""The tolerance each verified sync was judged by (`sync_events.probe_tolerance`): derived from the
dtypes of the trainer and the server (weights/tolerance.py) unless a run sets sync.verify_tolerance,
so an audit compares each probe difference with its own bound. Null for loads not verified.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07 03:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('sync_events', sa.Column('probe_tolerance', sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column('sync_events', 'probe_tolerance')
