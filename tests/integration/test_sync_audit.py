"""The audit trail agrees with the history (issue #15, item 4): a weight load whose attempt failed
and which Temporal retried leaves a row that says how the retry ended, written by the plain
library functions against the real Postgres. Each test works in a transaction it rolls back."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from rlpipe.storage.db import Database
from rlpipe.storage.syncs import SyncRecord, attempt_verdict, last_verified, record_superseded, record_sync

pytestmark = pytest.mark.stack

RUN = "sync-audit"
SERVER = "audit-server"
T0 = datetime(2026, 12, 5, tzinfo=UTC)


@pytest.fixture
def s(migrated_db: Database) -> Iterator[Session]:
    """A session on a run of its own, rolled back at the end."""
    session = migrated_db.session()
    session.execute(sa.text("insert into runs (id, workflow_id, mode, config, config_sha256) "
                            "values (:r, 'wf-sync-audit', 'async', '{}', :sha)"), {"r": RUN, "sha": "a" * 64})
    try:
        yield session
    finally:
        session.rollback()
        session.close()


def attempt(version: int, status: str, at: datetime) -> SyncRecord:
    return SyncRecord(RUN, version, SERVER, status, 10, {"total_s": 1.0}, None, None, None,
                      None if status == "ok" else "server went away", at, at + timedelta(seconds=1))


def row(s: Session, version: int) -> sa.Row:
    return s.execute(sa.text("select status, attempts, error, started_at from sync_events "
                             "where run_id = :r and version = :v and server = :s"),
                     {"r": RUN, "v": version, "s": SERVER}).one()


def test_a_retried_load_that_succeeds_turns_its_failed_row_ok(s: Session) -> None:
    record_sync(s, attempt(1, "failed", T0))
    record_sync(s, attempt(1, "ok", T0 + timedelta(seconds=30)))
    assert (row(s, 1).status, row(s, 1).attempts) == ("ok", 2)
    assert attempt_verdict(s, RUN, 1, SERVER, T0) == "rejected"  # the failed attempt's weights stay unvouched


def test_a_retry_that_finds_a_newer_version_supersedes_the_failed_row(s: Session) -> None:
    record_sync(s, attempt(1, "ok", T0))
    record_sync(s, attempt(2, "failed", T0 + timedelta(seconds=10)))  # the server died while loading 2
    record_sync(s, attempt(4, "ok", T0 + timedelta(seconds=60)))  # restored to the newest when it came back
    record_superseded(s, RUN, 2, SERVER, held=4, at=T0 + timedelta(seconds=70))  # the retry of 2 completes

    superseded = row(s, 2)
    assert (superseded.status, superseded.attempts) == ("superseded", 2)
    assert "version 4" in superseded.error and superseded.started_at == T0 + timedelta(seconds=70)
    assert attempt_verdict(s, RUN, 2, SERVER, T0 + timedelta(seconds=10)) == "rejected"
    verified = last_verified(s, SERVER)
    assert verified is not None and verified.version == 4  # the server's version is still the one it holds


def test_a_superseded_load_without_a_row_gets_one_and_verdicts_stay(s: Session) -> None:
    record_superseded(s, RUN, 3, SERVER, held=4, at=T0)
    assert (row(s, 3).status, row(s, 3).attempts) == ("superseded", 1)
    record_sync(s, attempt(1, "ok", T0))
    record_sync(s, attempt(2, "rolled_back", T0))
    for version in (1, 2):  # a verdict on weights is not a failed attempt: it stays
        record_superseded(s, RUN, version, SERVER, held=4, at=T0 + timedelta(seconds=5))
    assert [(row(s, v).status, row(s, v).attempts) for v in (1, 2)] == [("ok", 1), ("rolled_back", 1)]
