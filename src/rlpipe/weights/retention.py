"""Checkpoint retention: which published versions keep their bytes, and deleting the others.

    plan_retention   pure: the versions to keep (each with why) and those to delete
    prune_run        applies it to a run: rows marked, then objects, optimizer states, manifests
    forget_deleted   a machine's own copies of deleted versions (trainer cache, sidecar downloads)

Whatever the policy (`retention` in the run config), a version still needed keeps its bytes: the
newest (servers are loading it), each one a server holds (its sidecar rolls a failed load back to
it), and the one a restarted trainer restores from (`recovery_base`). Optimizer states older than
that base are deleted: no restore reads them again.

Deleting mirrors uploading in reverse. The row is marked first (`policy_versions.deleted_at`: from
then on no restore or sync starts reading the version), then the version's own objects (a file
another kept version also names stays), and the manifest last: a pass that stops half-way leaves
the manifest, and the next pass, which finishes every marked version still stored, completes it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa

from rlpipe.policy.checkpoint import WEIGHTS_FILE
from rlpipe.schemas.config import RetentionConfig
from rlpipe.schemas.tables import PolicyVersion, SyncEvent, TrainStep
from rlpipe.storage.db import Database
from rlpipe.storage.object_store import ObjectStore, content_key
from rlpipe.weights.checkpoints import (
    delete_train_state,
    load_manifest,
    local_version_dir,
    manifest_key,
    objects_prefix,
    recovery_base,
    stored_train_states,
    stored_versions,
)


@dataclass(frozen=True)
class RetentionPlan:
    keep: dict[int, str]
    """Version -> why it keeps its bytes."""
    delete: list[int]


def plan_retention(versions: Iterable[int], policy: RetentionConfig, needed: Mapping[int, str]) -> RetentionPlan:
    """Split `versions` (stored, not deleted) by `policy`; `needed` (version -> why) are kept whatever it says."""
    ordered = sorted(versions)
    if policy.keep_last is None:
        return RetentionPlan({v: "no retention policy" for v in ordered}, [])
    keep = {v: f"one of the newest {policy.keep_last}" for v in ordered[-policy.keep_last:]}
    if policy.keep_every is not None:
        keep |= {v: f"a multiple of {policy.keep_every}" for v in ordered
                 if v % policy.keep_every == 0 and v not in keep}
    keep |= {v: why for v, why in needed.items() if v in ordered and v not in keep}
    return RetentionPlan(dict(sorted(keep.items())), [v for v in ordered if v not in keep])


@dataclass(frozen=True)
class Pruned:
    """What one pass deleted."""

    versions: list[int]
    """Versions whose bytes this pass deleted (marked now or by an unfinished earlier pass)."""
    train_states: list[int]
    """Steps whose optimizer state this pass deleted."""
    bytes_freed: int


@dataclass(frozen=True)
class Survey:
    """A run's versions as retention sees them: what is stored, what is needed, the plan."""

    rows: list[PolicyVersion]
    durable: set[int]
    """Versions whose manifest is stored."""
    train_states: set[int]
    """Steps whose optimizer state is stored."""
    base: PolicyVersion | None
    """The version a restarted trainer would restore from."""
    plan: RetentionPlan


def survey(db: Database, store: ObjectStore, run_id: str, policy: RetentionConfig) -> Survey:
    durable, states = stored_versions(store, run_id), stored_train_states(store, run_id)
    with db.begin() as s:
        rows = list(s.scalars(sa.select(PolicyVersion).where(PolicyVersion.run_id == run_id)
                              .order_by(PolicyVersion.version)))
        held = s.execute(sa.select(SyncEvent.server, sa.func.max(SyncEvent.version))
                         .where(SyncEvent.run_id == run_id, SyncEvent.status == "ok")
                         .group_by(SyncEvent.server)).all()
        last_step = s.scalar(sa.select(sa.func.max(TrainStep.step)).where(TrainStep.run_id == run_id)) or 0
    live = [r for r in rows if r.deleted_at is None]
    base = recovery_base(live, durable, states, last_step)
    needed = {live[-1].version: "the newest"} if live else {}
    needed |= {version: f"held by server {server}" for server, version in held if version not in needed}
    if base is not None:
        needed.setdefault(base.version, "a restarted trainer restores from it")
    plan = plan_retention([r.version for r in live if r.version in durable], policy, needed)
    return Survey(rows, durable, states, base, plan)


def prune_run(db: Database, store: ObjectStore, run_id: str, policy: RetentionConfig) -> Pruned:
    """Apply `policy` to the run's stored versions; idempotent (a second pass deletes nothing more)."""
    found = survey(db, store, run_id, policy)
    plan = found.plan
    if plan.delete:
        with db.begin() as s:
            s.execute(sa.update(PolicyVersion).where(PolicyVersion.run_id == run_id,
                                                     PolicyVersion.version.in_(plan.delete),
                                                     PolicyVersion.deleted_at.is_(None))
                      .values(deleted_at=datetime.now(UTC)))
    marked = sorted(({r.version for r in found.rows if r.deleted_at is not None} | set(plan.delete)) & found.durable)
    still_named = {content_key(objects_prefix(run_id), r.sha256, WEIGHTS_FILE)  # versions still uploading too
                   for r in found.rows if r.deleted_at is None and r.version not in plan.delete}
    for version in plan.keep:
        still_named |= {f.key for f in load_manifest(store, manifest_key(run_id, version)).files.values()}
    freed = 0
    for version in marked:
        manifest = load_manifest(store, manifest_key(run_id, version))
        for stored in manifest.files.values():
            if stored.key not in still_named and store.exists(stored.key):
                store.delete(stored.key)
                freed += stored.size
        store.delete(manifest_key(run_id, version))
    old_states = sorted(k for k in found.train_states if found.base is not None and k < found.base.trained_steps)
    for step in old_states:
        freed += delete_train_state(store, run_id, step)
    return Pruned(marked, old_states, freed)


def retention_rows(found: Survey) -> list[tuple[str, ...]]:
    """(version, trained steps, MB, optimizer state, status) per version, for `rlpipe run checkpoints`."""
    table: list[tuple[str, ...]] = []
    for row in found.rows:
        if row.deleted_at is not None:
            status = f"deleted {row.deleted_at:%Y-%m-%d %H:%M:%S}"
        elif row.version not in found.durable:
            status = "uploading (or its upload was lost: the trainer re-creates it)"
        elif row.version in found.plan.keep:
            status = f"kept: {found.plan.keep[row.version]}"
        else:
            status = "deleted at the next pass"
        state = "stored" if row.trained_steps in found.train_states else ""
        table.append((str(row.version), str(row.trained_steps), f"{row.size_bytes / 1e6:.1f}", state, status))
    return table


def forget_deleted(db: Database, root: Path, run_id: str) -> int:
    """Remove this machine's copies (under `root`) of the run's versions that retention deleted;
    returns the bytes freed."""
    with db.begin() as s:
        deleted = list(s.scalars(sa.select(PolicyVersion.version).where(PolicyVersion.run_id == run_id,
                                                                        PolicyVersion.deleted_at.is_not(None))))
    freed = 0
    for version in deleted:
        directory = local_version_dir(root, run_id, version)
        if directory.is_dir():
            freed += sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
            shutil.rmtree(directory, ignore_errors=True)
    return freed
