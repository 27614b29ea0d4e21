"""A sync_events status for a retried load that found the server already on a newer verified
version: `superseded` (storage/syncs.py, record_superseded).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05 08:00:00
"""

from __future__ import annotations

from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    _allow_statuses("'ok', 'failed', 'rolled_back', 'refused', 'superseded'")


def downgrade() -> None:
    # the load's last attempt that did anything had failed: that is what the older schema can say
    op.execute("update sync_events set status = 'failed' where status = 'superseded'")
    _allow_statuses("'ok', 'failed', 'rolled_back', 'refused'")


def _allow_statuses(statuses: str) -> None:
    op.drop_constraint(op.f('ck_sync_events_status'), 'sync_events', type_='check')
    op.create_check_constraint(op.f('ck_sync_events_status'), 'sync_events', f"status in ({statuses})")
