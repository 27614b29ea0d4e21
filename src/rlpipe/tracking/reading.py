"""Reading a run's committed record for the trackers: train steps, sync events, evaluations, its config."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from rlpipe.tracking.records import STEP_COLUMNS, SYNC_TIMINGS, EvalRecord, StepRecord, SyncRecord

FINAL_SYNC_STATUSES = ("ok", "rolled_back", "refused", "superseded")
"""A 'failed' attempt is retried (its row is overwritten) while the run is active: logged only once the run ends."""


def last_step(s: Session, run_id: str) -> int:
    return s.scalar(sa.text("select coalesce(max(step), 0) from train_steps where run_id = :r"), {"r": run_id})


def run_config(s: Session, run_id: str) -> dict[str, Any] | None:
    return s.scalar(sa.text("select config from runs where id = :r"), {"r": run_id})


def steps(s: Session, run_id: str, first: int, last: int) -> list[StepRecord]:
    rows = s.execute(sa.text(f"""
        select step, {', '.join(STEP_COLUMNS)}, coalesce(metrics, '{{}}'::jsonb) as metrics, started_at, finished_at
        from train_steps where run_id = :r and step between :first and :last order by step"""),
        {"r": run_id, "first": first, "last": last}).mappings().all()
    rewards = _by_step([(row[0], row[1]) for row in s.execute(sa.text("""
        select g.claimed_step, t.reward from trajectories t join rollout_groups g on g.id = t.group_id
        where t.run_id = :r and g.claimed_step between :first and :last and t.status = 'completed'
          and t.reward is not null order by g.claimed_step, g.group_index, t.sample_index"""),
        {"r": run_id, "first": first, "last": last})])
    staleness: dict[int, dict[int, int]] = {}
    for step, lag, n in s.execute(sa.text("""
            select step, staleness, count(*) from v_version_lag where run_id = :r and step between :first and :last
            group by step, staleness"""), {"r": run_id, "first": first, "last": last}):
        staleness.setdefault(step, {})[int(lag)] = n
    return [StepRecord(step=row["step"], columns={c: row[c] for c in STEP_COLUMNS}, metrics=row["metrics"],
                       rewards=rewards.get(row["step"], []), staleness=staleness.get(row["step"], {}),
                       grader_share=_grader_share(s, run_id, row["finished_at"]),
                       started_at=row["started_at"], finished_at=row["finished_at"])
            for row in rows]


def _by_step(rows: Sequence[tuple[int, float]]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for step, value in rows:
        out.setdefault(step, []).append(float(value))
    return out


def _grader_share(s: Session, run_id: str, until: Any) -> float | None:
    """Grader busy seconds over all boxes' busy seconds, activities finished by `until` (a step's end)."""
    row = s.execute(sa.text("""
        select sum(extract(epoch from finished_at - started_at)) filter (where box = 'grader'),
               sum(extract(epoch from finished_at - started_at))
        from activity_spans where run_id = :r and finished_at <= :until"""), {"r": run_id, "until": until}).one()
    grader, total = row
    return float(grader or 0) / float(total) if total else None


def syncs(s: Session, run_id: str, run_active: bool) -> list[SyncRecord]:
    """Sync events whose outcome is final (any outcome once the run has ended)."""
    rows = s.execute(sa.text(f"""
        select e.version, v.trained_steps, e.server, e.status, {', '.join('e.' + c for c in SYNC_TIMINGS)},
               e.probe_max_abs_diff, e.finished_at
        from sync_events e join policy_versions v on v.run_id = e.run_id and v.version = e.version
        where e.run_id = :r order by e.version, e.server"""), {"r": run_id}).mappings().all()
    return [SyncRecord(version=r["version"], step=r["trained_steps"], server=r["server"], status=r["status"],
                       timings={c: r[c] for c in SYNC_TIMINGS}, probe_max_abs_diff=r["probe_max_abs_diff"],
                       finished_at=r["finished_at"])
            for r in rows if r["status"] in FINAL_SYNC_STATUSES or not run_active]


def evals(s: Session, run_id: str) -> list[EvalRecord]:
    rows = s.execute(sa.text("""
        select e.version, v.trained_steps, e.split, e.accuracy, e.mean_reward, e.n_prompts, e.created_at
        from eval_results e join policy_versions v on v.run_id = e.run_id and v.version = e.version
        where e.run_id = :r order by e.version, e.split"""), {"r": run_id}).all()
    return [EvalRecord(*row) for row in rows]


def run_active(s: Session, run_id: str) -> bool:
    return s.scalar(sa.text("select status in ('running', 'paused') from runs where id = :r"), {"r": run_id}) or False
