"""Runs and failures: registering a run (idempotently), its status, and the failure log."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from rlpipe.schemas.config import RUN_NAME_PATTERN, RunConfig
from rlpipe.schemas.tables import Failure, Run


class DuplicateRunName(ValueError):
    """A run of that name exists with another config: starting it again would mix two runs."""


def config_sha256(config: RunConfig) -> str:
    return hashlib.sha256(json.dumps(config.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def register_run(s: Session, config: RunConfig, workflow_id: str | None = None) -> None:
    """Create the run's row; a second registration with the identical config is a no-op.
    `workflow_id` is the run workflow's own id, which differs from `run-<name>` when the run was
    started from the Web UI with another id (the sidecars signal the run by it)."""
    digest = config_sha256(config)
    s.execute(insert(Run).values(id=config.name, workflow_id=workflow_id or config.workflow_id, mode=config.mode,
                                 config=config.model_dump(mode="json"), config_sha256=digest)
              .on_conflict_do_nothing(index_elements=[Run.id]))
    existing = s.get(Run, config.name)
    assert existing is not None
    if existing.config_sha256 != digest:
        created = existing.created_at.strftime("%Y-%m-%d %H:%M")
        raise DuplicateRunName(f"a run named '{config.name}' already exists (created {created}) with a different "
                               "config; choose another name")


def record_rejected_run(s: Session, *, workflow_id: str, config: Any, reason: str) -> str:
    """Give a run whose config failed validation its row (status failed, the config as given), so
    that SQL sees every run that was started. Its id is the config's name when that is a valid,
    unused run name, else one made from the workflow id. Idempotent; returns the id."""
    existing = s.scalar(sa.select(Run.id).where(Run.workflow_id == workflow_id))
    if existing is not None:
        return existing
    raw = config if isinstance(config, dict) else {"given": repr(config)[:2000]}
    digest = hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()
    name = raw.get("name")
    candidates = [name] if isinstance(name, str) and re.fullmatch(RUN_NAME_PATTERN, name) else []
    candidates += [_slug(workflow_id), f"{_slug(workflow_id)[:54]}-{digest[:8]}"]
    for run_id in candidates:
        inserted = s.execute(insert(Run).values(id=run_id, workflow_id=workflow_id, mode="async", config=raw,
                                                config_sha256=digest, status="failed", status_reason=reason,
                                                finished_at=sa.func.now())
                             .on_conflict_do_nothing(index_elements=[Run.id]).returning(Run.id)).scalar()
        if inserted is not None:
            return run_id
    raise DuplicateRunName(f"runs {candidates} all exist; the rejected run of workflow {workflow_id} has no row")


def _slug(workflow_id: str) -> str:
    """A valid run id made from a workflow id (lowercase; other characters become '-')."""
    slug = re.sub(r"[^a-z0-9_.-]", "-", workflow_id.lower()).lstrip("_.-")[:63]
    return slug or "run"


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
