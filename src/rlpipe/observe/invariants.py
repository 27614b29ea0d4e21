"""What a finished run must satisfy, read back from Postgres (and the object store): the audit
trail as named checks, each with what was expected and what was observed. The integration tests
assert a subset (`tests/integration/runs.py`); the chaos harness (`rlpipe.cli.chaos`) checks them
all after a run under fire and prints them as a table.

Every check reads stored rows only, so it works on any run, from any process, after any crash.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.orm import Session

from rlpipe.observe.queries import (
    RunInfo,
    TextRow,
    describe_bounds,
    group_counts,
    run_info,
    staleness_by_step,
    version_anomalies,
)
from rlpipe.storage.object_store import ObjectStore
from rlpipe.weights.checkpoints import load_manifest

# the names, so that callers can pick checks without repeating strings
RUN_COMPLETED = "run completed its steps"
GROUPS_CLOSED = "every group closed with a reason"
CONSUMED_ONCE = "no trajectory consumed twice"
WITHIN_STALENESS = "consumed data within staleness bound"
VERSIONS_CONTIGUOUS = "policy_versions contiguous"
SYNCS_MONOTONIC = "synced versions monotonic per server"
VERSIONS_PUBLISHED = "every trajectory's version published"
CHECKPOINTS_MATCH = "checkpoint objects <-> version rows"
COUNTS_RECONCILE = "groups started = completed + dropped + failed"


@dataclass(frozen=True)
class Invariant:
    name: str
    expected: str
    observed: str
    ok: bool


def _scalar_rows(s: Session, sql: str, run: str) -> list[TextRow]:
    return list(s.execute(sa.text(sql), {"run": run}))


# -- the checks: one function each, (session, run) -> Invariant ---------------------------------------
def run_completed(s: Session, run: RunInfo) -> Invariant:
    """The run says completed and committed steps 1..N, each on exactly groups_per_step groups
    (as recorded by the step and as claimed in the buffer)."""
    steps = _scalar_rows(s, """
        select st.step, st.n_groups, (select count(*) from rollout_groups g
                                      where g.run_id = st.run_id and g.claimed_step = st.step) as claimed
        from train_steps st where st.run_id = :run order by st.step""", run.run_id)
    status = s.scalar(sa.text("select status from runs where id = :run"), {"run": run.run_id})
    wanted = [(i, run.groups_per_step, run.groups_per_step) for i in range(1, run.steps + 1)]
    bad = [f"step {r.step}: {r.n_groups} groups, {r.claimed} claimed" for r in steps
           if (r.n_groups, r.claimed) != (run.groups_per_step, run.groups_per_step)]
    return Invariant(RUN_COMPLETED, f"completed, steps 1..{run.steps} x {run.groups_per_step} groups",
                     f"{status}, {len(steps)} steps" + (f" ({'; '.join(bad)})" if bad else ""),
                     status == "completed" and [tuple(r) for r in steps] == wanted)


def groups_closed(s: Session, run: RunInfo) -> Invariant:
    """No group is left running (none vanished mid-flight); a dropped or failed one says why; group
    indices have no gap (a group the run started always has its row)."""
    row = _scalar_rows(s, """
        select count(*) filter (where status = 'running') as running,
               count(*) filter (where status in ('dropped', 'failed')
                                and coalesce(status_reason, '') = '') as unexplained,
               count(*) as n, coalesce(max(group_index) + 1, 0) as span
        from rollout_groups where run_id = :run""", run.run_id)[0]
    return Invariant(GROUPS_CLOSED, "0 running, 0 without reason, no index gap",
                     f"{row.running} running, {row.unexplained} without reason, {row.span - row.n} gaps",
                     row.running == 0 and row.unexplained == 0 and row.n == row.span)


def consumed_once(s: Session, run: RunInfo) -> Invariant:
    """A trajectory is trained on by one step at most, and no step took more than its batch."""
    row = _scalar_rows(s, "select count(*) as n, count(distinct trajectory_id) as distinct_n "
                          "from v_version_lag where run_id = :run", run.run_id)[0]
    most = run.steps * run.groups_per_step * run.group_size
    return Invariant(CONSUMED_ONCE, f"consumed = distinct <= {most}", f"{row.n} consumed, {row.distinct_n} distinct",
                     row.n == row.distinct_n and row.n <= most)


def within_staleness(s: Session, run: RunInfo) -> Invariant:
    """Every consumed trajectory is at most as stale as the bound of the step that trained on it:
    the max_staleness the step claimed under (a schedule update may raise or lower it mid-run), or
    the configured one for a step that recorded none."""
    steps = staleness_by_step(s, run.run_id, run.max_staleness)
    expected = f"staleness <= the consuming step's max_staleness: {describe_bounds(steps) or run.max_staleness}"
    if not steps:
        return Invariant(WITHIN_STALENESS, expected, "no consumed trajectories", False)
    over = [x for x in steps if x.over_bound]
    if not over:
        return Invariant(WITHIN_STALENESS, expected, f"max {max(x.max for x in steps)}, none over its step's bound",
                         True)
    worst = max(over, key=lambda x: (x.max - x.bound, x.max))
    return Invariant(WITHIN_STALENESS, expected,
                     f"{sum(x.over_bound for x in over)} trajectories over their step's bound in {len(over)} "
                     f"step(s); worst: step {worst.step} trained on data {worst.max} steps stale under bound "
                     f"{worst.bound} ({worst.max - worst.bound} over)", False)


def versions_contiguous(s: Session, run: RunInfo) -> Invariant:
    versions = _scalar_rows(s, "select version, trained_steps from policy_versions where run_id = :run "
                               "order by version", run.run_id)
    contiguous = [v.version for v in versions] == list(range(len(versions)))
    monotonic = all(a.trained_steps < b.trained_steps for a, b in zip(versions, versions[1:]))
    return Invariant(VERSIONS_CONTIGUOUS, "0..n, trained steps increasing",
                     f"{[v.version for v in versions]} at steps {[v.trained_steps for v in versions]}",
                     bool(versions) and contiguous and monotonic)


def syncs_monotonic(s: Session, run: RunInfo) -> Invariant:
    """In the order they were verified, the versions each server held only moved forward."""
    events = _scalar_rows(s, "select server, version from sync_events where run_id = :run and status = 'ok' "
                             "order by server, finished_at", run.run_id)
    by_server: dict[str, list[int]] = {}
    for e in events:
        by_server.setdefault(e.server, []).append(e.version)
    ok = bool(by_server) and all(a <= b for seq in by_server.values() for a, b in zip(seq, seq[1:]))
    return Invariant(SYNCS_MONOTONIC, "non-decreasing", "; ".join(f"server {k}: {v}" for k, v in by_server.items())
                     or "no verified sync", ok)


def versions_published(s: Session, run: RunInfo) -> Invariant:
    found = version_anomalies(s, run.run_id)
    return Invariant(VERSIONS_PUBLISHED, "0 unpublished", f"{found.trajectories_unpublished_version} unpublished",
                     found.trajectories_unpublished_version == 0)


def counts_reconcile(s: Session, run: RunInfo, started: int | None = None) -> Invariant:
    """`started`: the groups the orchestrator started (e.g. counted in Temporal); default: the rows."""
    c = group_counts(s, run.run_id)
    rows = c.running + c.completed + c.dropped + c.failed
    started = rows if started is None else started
    closed = c.completed + c.dropped + c.failed
    return Invariant(COUNTS_RECONCILE, f"{started} = {closed}",
                     f"{started} started ({rows} rows) = {c.completed} completed ({c.consumed} consumed) "
                     f"+ {c.dropped} dropped + {c.failed} failed", started == rows == closed)


def checkpoints_match(s: Session, run: RunInfo, store: ObjectStore) -> Invariant:
    """Every version manifest in the store has its `policy_versions` row and every row not deleted by
    the retention policy its manifest, whose weights object exists with the row's sha256."""
    rows = {r.checkpoint_key: (r.sha256, r.deleted) for r in _scalar_rows(
        s, "select checkpoint_key, sha256, deleted_at is not null as deleted from policy_versions "
           "where run_id = :run", run.run_id)}
    manifests = {o.key for o in store.list(f"runs/{run.run_id}/versions/")}
    kept = {key for key, (_, deleted) in rows.items() if not deleted}
    orphans, missing = sorted(manifests - rows.keys()), sorted(kept - manifests)
    broken = [key for key in sorted(kept & manifests) if not _weights_stored(store, key, rows[key][0])]
    return Invariant(CHECKPOINTS_MATCH, "0 orphans, 0 missing",
                     f"{len(manifests)} manifests, {len(rows)} rows ({len(rows) - len(kept)} deleted by retention); "
                     f"orphans {orphans or 0}, missing {missing or 0}, bad weights {broken or 0}",
                     not orphans and not missing and not broken)


def _weights_stored(store: ObjectStore, manifest_key: str, sha256: str) -> bool:
    weights = load_manifest(store, manifest_key).weights
    return weights.sha256 == sha256 and store.exists(weights.key)


Check = Callable[[Session, RunInfo], Invariant]
SQL_CHECKS: tuple[Check, ...] = (run_completed, groups_closed, consumed_once, within_staleness, versions_contiguous,
                                 syncs_monotonic, versions_published)


def check_run(s: Session, run_id: str, *, store: ObjectStore | None = None, groups_started: int | None = None,
              only: Iterable[str] | None = None) -> list[Invariant]:
    """The run's invariants (those named in `only`, default all). The checkpoint check needs `store`;
    `groups_started` lets the count check compare the rows against the orchestrator's own count."""
    run = run_info(s, run_id)
    found = [check(s, run) for check in SQL_CHECKS]
    found.append(counts_reconcile(s, run, groups_started))
    if store is not None:
        found.append(checkpoints_match(s, run, store))
    wanted = set(only) if only is not None else None
    return [inv for inv in found if wanted is None or inv.name in wanted]
