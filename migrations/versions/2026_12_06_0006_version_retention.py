"""policy_versions.deleted_at: when a retention policy deleted a version's bytes (issue #17).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06 02:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('policy_versions', sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column('policy_versions', 'deleted_at')
