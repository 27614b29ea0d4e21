"""Runs and failures: registering a run (idempotently), its status, and the failure log."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from rlpipe.schemas.config import RunConfig
from rlpipe.schemas.tables import Failure, Run


class DuplicateRunName(ValueError):
    """A run of that name exists with another config: starting it again would mix two runs."""


def config_sha256(config: RunConfig) -> str:
    return hashlib.sha256(json.dumps(config.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def register_run(s: Session, config: RunConfig) -> None:
    """Create the run's row; a second registration with the identical config is a no-op."""
    digest = config_sha256(config)
    s.execute(insert(Run).values(id=config.name, workflow_id=config.workflow_id, mode=config.mode,
                                 config=config.model_dump(mode="json"), config_sha256=digest)
              .on_conflict_do_nothing(index_elements=[Run.id]))
    existing = s.get(Run, config.name)
    assert existing is not None
    if existing.config_sha256 != digest:
        created = existing.created_at.strftime("%Y-%m-%d %H:%M")
        raise DuplicateRunName(f"a run named '{config.name}' already exists (created {created}) with a different "
                               "config; choose another name")


def load_run_config(s: Session, run_id: str) -> RunConfig:
    run = s.get(Run, run_id)
    if run is None:
        raise LookupError(f"no run named '{run_id}'")
    return RunConfig.model_validate(run.config)


def set_run_status(s: Session, run_id: str, status: str, reason: str | None) -> None:
    finished = sa.func.now() if status in ("completed", "failed", "cancelled") else None
    s.execute(sa.update(Run).where(Run.id == run_id)
              .values(status=status, status_reason=reason, updated_at=sa.func.now(), finished_at=finished))


def record_failure(s: Session, *, run_id: str | None, kind: str, error_type: str, message: str,
                   activity: str | None = None, workflow_id: str | None = None, activity_id: str | None = None,
                   attempt: int = 1, details: dict[str, Any] | None = None) -> None:
    """Append to the failure log; the same (workflow, activity, attempt) is recorded once."""
    s.execute(insert(Failure).values(run_id=run_id, kind=kind, activity=activity, workflow_id=workflow_id,
                                     activity_id=activity_id, attempt=attempt, error_type=error_type,
                                     message=message[:4000], details=details)
              .on_conflict_do_nothing(constraint="uq_failures_workflow_id_activity_id_attempt"))
