"""Activity spans (the busy/idle timeline of each box), eval results per published version, and
whether a sync's greedy probe matched.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 11:56:23.011201
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('activity_spans',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('run_id', sa.Text(), nullable=True),
    sa.Column('box', sa.Text(), nullable=False),
    sa.Column('activity', sa.Text(), nullable=False),
    sa.Column('workflow_id', sa.Text(), nullable=False),
    sa.Column('activity_id', sa.Text(), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('worker', sa.Text(), nullable=False),
    sa.Column('ok', sa.Boolean(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint('attempt >= 1', name=op.f('ck_activity_spans_attempt_positive')),
    sa.CheckConstraint('finished_at >= started_at', name=op.f('ck_activity_spans_time_order')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_activity_spans_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_activity_spans')),
    sa.UniqueConstraint('workflow_id', 'activity_id', 'attempt', name=op.f('uq_activity_spans_workflow_id_activity_id_attempt'))
    )
    op.create_index('ix_activity_spans_run_box', 'activity_spans', ['run_id', 'box', 'started_at'], unique=False)
    op.create_table('eval_results',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('run_id', sa.Text(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('split', sa.Text(), nullable=False),
    sa.Column('n_prompts', sa.Integer(), nullable=False),
    sa.Column('n_correct', sa.Integer(), nullable=False),
    sa.Column('accuracy', sa.Float(), nullable=False),
    sa.Column('mean_reward', sa.Float(), nullable=True),
    sa.Column('details', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint('accuracy >= 0 and accuracy <= 1', name=op.f('ck_eval_results_accuracy_range')),
    sa.CheckConstraint('n_prompts >= 1 and n_correct >= 0 and n_correct <= n_prompts', name=op.f('ck_eval_results_counts_valid')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_eval_results_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_eval_results')),
    sa.UniqueConstraint('run_id', 'version', 'split', name=op.f('uq_eval_results_run_id_version_split'))
    )
    op.create_index(op.f('ix_eval_results_run_id'), 'eval_results', ['run_id'], unique=False)


    op.add_column("sync_events", sa.Column("greedy_match", sa.Boolean(), nullable=True))


def downgrade() -> None:
    op.drop_column("sync_events", "greedy_match")
    op.drop_index(op.f('ix_eval_results_run_id'), table_name='eval_results')
    op.drop_table('eval_results')
    op.drop_index('ix_activity_spans_run_box', table_name='activity_spans')
    op.drop_table('activity_spans')
