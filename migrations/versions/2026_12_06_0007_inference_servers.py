"""inference_servers: the named fleet, so that a server can join a running run (issue #20).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06 20:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'inference_servers',
        sa.Column('name', sa.Text(), nullable=False),
        sa.Column('url', sa.Text(), nullable=False),
        sa.Column('registered_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column('seen_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.CheckConstraint("name <> ''", name=op.f('ck_inference_servers_name_not_empty')),
        sa.CheckConstraint("url like 'http://%' or url like 'https://%'", name=op.f('ck_inference_servers_url_is_http')),
        sa.PrimaryKeyConstraint('name', name=op.f('pk_inference_servers')),
    )


def downgrade() -> None:
    op.drop_table('inference_servers')
