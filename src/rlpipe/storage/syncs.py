"""Sync events: one row per (run, version, server), updated by retries (attempts counts them).

The row is also the verdict of the latest attempt: its `started_at` names the attempt (a server
labels unverified weights `verifying-<version>-<started_at>`, see weights/labels.py), its
`status` says whether those weights were verified. `attempt_verdict` reads it for a rollout
whose tokens carry such a label.

A load whose attempt failed is retried; a retry that finds the server already on a newer verified
version (restored while the server was down) completes without loading, and its row says
`superseded` (record_superseded), so the table agrees with the history, where the load completed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from rlpipe.schemas.tables import PolicyVersion, Run, SyncEvent

Verdict = Literal["ok", "rejected", "pending"]
ACTIVE_RUN_STATUSES = ("running", "paused")


@dataclass(frozen=True)
class SyncRecord:
    """What one sync attempt on one server did, as stored in `sync_events`."""

    run_id: str
    version: int
    server: str
    status: str
    bytes: int
    timings: dict[str, float]
    probe_max_abs_diff: float | None
    probe_tolerance: float | None
    greedy_match: bool | None
    error: str | None
    started_at: datetime
    finished_at: datetime
    transport: str | None = None
    """file | stream (weights/stream.py); None when no load started."""


def version_row(s: Session, run_id: str, version: int) -> PolicyVersion:
    row = s.scalar(sa.select(PolicyVersion).where(PolicyVersion.run_id == run_id, PolicyVersion.version == version))
    if row is None:
        raise LookupError(f"run {run_id} has no published version {version}")
    return row


def latest_version(s: Session, run_id: str) -> int | None:
    """The newest published version of the run (None before the base policy is published)."""
    return s.scalar(sa.select(sa.func.max(PolicyVersion.version)).where(PolicyVersion.run_id == run_id))


def record_sync(s: Session, record: SyncRecord) -> int:
    """Upsert the attempt's row; returns the attempt count of (run, version, server). A second
    write of the same attempt (same started_at: a rollback that broke off) does not count again."""
    values = dict(run_id=record.run_id, version=record.version, server=record.server, status=record.status,
                  bytes=record.bytes, download_s=record.timings.get("download_s"),
                  pause_s=record.timings.get("pause_s"), reload_s=record.timings.get("reload_s"),
                  verify_s=record.timings.get("verify_s"), total_s=record.timings.get("total_s"),
                  transport=record.transport,
                  probe_max_abs_diff=record.probe_max_abs_diff, probe_tolerance=record.probe_tolerance,
                  greedy_match=record.greedy_match,
                  error=record.error, started_at=record.started_at, finished_at=record.finished_at)
    statement = insert(SyncEvent).values(**values)
    return s.execute(statement.on_conflict_do_update(
        constraint="uq_sync_events_run_id_version_server",
        set_={**{k: statement.excluded[k] for k in values if k not in ("run_id", "version", "server")},
              "attempts": sa.case((SyncEvent.started_at == statement.excluded.started_at, SyncEvent.attempts),
                                  else_=SyncEvent.attempts + 1)}).returning(SyncEvent.attempts)).scalar_one()


def record_superseded(s: Session, run_id: str, version: int, server: str, held: int, at: datetime) -> None:
    """Record an attempt to load `version` that found the server on the newer verified version `held`.

    The load is over (the server will never go back to `version`), but it did not verify
    `version`, so the row says `superseded`, not `ok`: the readers of ok rows (the server's last
    verified version, versions only moving forward) stay right. It replaces a failed attempt's
    row (whose weights it never vouches for: its `started_at` moves on) or is added when no
    attempt wrote one; a verdict on weights (ok, rolled_back, refused) is left as it is."""
    error = f"superseded: server {server} already held verified version {held}, so {version} was never loaded"
    statement = insert(SyncEvent).values(run_id=run_id, version=version, server=server, status="superseded",
                                         bytes=0, error=error, started_at=at, finished_at=at)
    cleared = ("download_s", "pause_s", "reload_s", "verify_s", "total_s", "probe_max_abs_diff", "probe_tolerance",
               "greedy_match")
    s.execute(statement.on_conflict_do_update(
        constraint="uq_sync_events_run_id_version_server",
        set_={"status": "superseded", "bytes": 0, "error": error, "started_at": at, "finished_at": at,
              "attempts": SyncEvent.attempts + 1, **{column: None for column in cleared}},
        where=SyncEvent.status == "failed"))


def finish_sync(s: Session, run_id: str, version: int, server: str, total_s: float, finished_at: datetime) -> None:
    """Extend the attempt already recorded (a rollback runs after its verdict was written)."""
    s.execute(sa.update(SyncEvent).where(SyncEvent.run_id == run_id, SyncEvent.version == version,
                                         SyncEvent.server == server)
              .values(total_s=total_s, finished_at=finished_at))


def attempt_verdict(s: Session, run_id: str, version: int, server: str, started_at: datetime) -> Verdict:
    """Were the weights that the attempt started at `started_at` loaded verified?

    pending: that attempt has not recorded its verdict yet (the row is older or absent);
    ok / rejected: its own row says so; a newer row means the attempt was abandoned (a crashed
    sidecar, a restarted server) or superseded, which never vouches for its weights.
    """
    row = s.execute(sa.select(SyncEvent.status, SyncEvent.started_at).where(
        SyncEvent.run_id == run_id, SyncEvent.version == version, SyncEvent.server == server)).first()
    if row is None or row.started_at < started_at:
        return "pending"
    return "ok" if row.started_at == started_at and row.status == "ok" else "rejected"


@dataclass(frozen=True)
class Verified:
    run_id: str
    version: int


def last_verified(s: Session, server: str) -> Verified | None:
    """The version this server last verified, of the active run that synced it last."""
    row = s.execute(
        sa.select(SyncEvent.run_id, SyncEvent.version).join(Run, Run.id == SyncEvent.run_id)
        .where(SyncEvent.server == server, SyncEvent.status == "ok", Run.status.in_(ACTIVE_RUN_STATUSES))
        .order_by(SyncEvent.started_at.desc()).limit(1)).first()
    return Verified(row.run_id, row.version) if row else None


def served_run(s: Session, server: str) -> str | None:
    """The active run this server serves: the one whose latest sync attempt on it is the newest."""
    return s.scalar(
        sa.select(SyncEvent.run_id).join(Run, Run.id == SyncEvent.run_id)
        .where(SyncEvent.server == server, Run.status.in_(ACTIVE_RUN_STATUSES))
        .order_by(SyncEvent.started_at.desc()).limit(1))


def run_workflow_id(s: Session, run_id: str) -> str:
    workflow_id = s.scalar(sa.select(Run.workflow_id).where(Run.id == run_id))
    if workflow_id is None:
        raise LookupError(f"no run named '{run_id}'")
    return workflow_id
