"""The staleness bound each train step claimed under (`train_steps.max_staleness`), also in
`v_version_lag`: a run's max_staleness can change while it runs (`rlpipe run schedule
--max-staleness`), so the audit compares each step's data with the bound of that step.

Steps committed before this revision keep a null bound (it was not recorded): the checks read
the run's configured bound for them.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05 08:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

VERSION_LAG_COLUMNS = '''
select t.id as trajectory_id, t.run_id, g.claimed_step as step,
       t.policy_version as generated_by_version, gen.trained_steps as generated_at_step,
       (g.claimed_step - 1) - gen.trained_steps as staleness'''
VERSION_LAG_SOURCE = '''
from trajectories t
join rollout_groups g on g.id = t.group_id
join policy_versions gen on gen.run_id = t.run_id and gen.version = t.policy_version'''
VERSION_LAG_WHERE = '''
where g.claimed_step is not null and t.status = 'completed';'''

# the bound of the consuming step: null while that step is not committed yet, or when it was
# committed before the bound was recorded (a left join: a claimed batch shows before its commit)
VERSION_LAG_WITH_BOUND = (
    "create or replace view v_version_lag as" + VERSION_LAG_COLUMNS + ",\n       st.max_staleness"
    + VERSION_LAG_SOURCE + "\nleft join train_steps st on st.run_id = t.run_id and st.step = g.claimed_step"
    + VERSION_LAG_WHERE)
VERSION_LAG_BEFORE = "create view v_version_lag as" + VERSION_LAG_COLUMNS + VERSION_LAG_SOURCE + VERSION_LAG_WHERE


def upgrade() -> None:
    op.add_column('train_steps', sa.Column('max_staleness', sa.Integer(), nullable=True))
    op.create_check_constraint(op.f('ck_train_steps_max_staleness_non_negative'), 'train_steps',
                               'max_staleness is null or max_staleness >= 0')
    op.execute(VERSION_LAG_WITH_BOUND)  # a column added at the end: `create or replace` keeps the rest


def downgrade() -> None:
    # a view cannot lose a column in place: back to the view of 0001, then the column can go
    op.execute("drop view v_version_lag")
    op.execute(VERSION_LAG_BEFORE)
    op.drop_constraint(op.f('ck_train_steps_max_staleness_non_negative'), 'train_steps', type_='check')
    op.drop_column('train_steps', 'max_staleness')
