"""Sync events: one row per (run, version, server), updated by retries (attempts counts them)."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from schemas.tables import PolicyVersion, SyncEvent


def version_row(s: Session, run_id: str, version: int) -> PolicyVersion:
    row = s.scalar(sa.select(PolicyVersion).where(PolicyVersion.run_id == run_id, PolicyVersion.version == version))
    if row is None:
        raise LookupError(f"run {run_id} has no published version {version}")
    return row


def record_sync(s: Session, *, run_id: str, version: int, server: str, status: str, bytes: int,
                timings: dict[str, float], probe_max_abs_diff: float | None, greedy_match: bool | None,
                error: str | None,
                started_at: datetime, finished_at: datetime) -> None:
    values = dict(run_id=run_id, version=version, server=server, status=status, bytes=bytes,
                  download_s=timings.get("download_s"), pause_s=timings.get("pause_s"),
                  reload_s=timings.get("reload_s"), verify_s=timings.get("verify_s"),
                  total_s=timings.get("total_s"), probe_max_abs_diff=probe_max_abs_diff,
                  greedy_match=greedy_match, error=error,
                  started_at=started_at, finished_at=finished_at)
    statement = insert(SyncEvent).values(**values)
    s.execute(statement.on_conflict_do_update(
        constraint="uq_sync_events_run_id_version_server",
        set_={**{k: statement.excluded[k] for k in values if k not in ("run_id", "version", "server")},
              "attempts": SyncEvent.attempts + 1}))
