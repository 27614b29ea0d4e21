"""tracker_cursors: how far each experiment tracker has received each run's record (issue #23).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05 17:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'tracker_cursors',
        sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column('run_id', sa.Text(), nullable=False),
        sa.Column('tracker', sa.Text(), nullable=False),
        sa.Column('step', sa.Integer(), server_default='0', nullable=False),
        sa.Column('logged', postgresql.JSONB(astext_type=sa.Text()), server_default='[]', nullable=False),
        sa.Column('batches', sa.Integer(), server_default='0', nullable=False),
        sa.Column('pending', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column('error', sa.Text(), nullable=True),
        sa.Column('failing_since', sa.DateTime(timezone=True), nullable=True),
        sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.CheckConstraint('step >= 0', name=op.f('ck_tracker_cursors_step_non_negative')),
        sa.CheckConstraint('batches >= 0', name=op.f('ck_tracker_cursors_batches_non_negative')),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_tracker_cursors_run_id_runs'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_tracker_cursors')),
        sa.UniqueConstraint('run_id', 'tracker', name=op.f('uq_tracker_cursors_run_id_tracker')),
    )
    op.create_index(op.f('ix_tracker_cursors_run_id'), 'tracker_cursors', ['run_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_tracker_cursors_run_id'), table_name='tracker_cursors')
    op.drop_table('tracker_cursors')
