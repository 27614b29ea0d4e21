"""Each tracker's cursor over a run's record (`tracker_cursors`), and the batch it writes next.

The protocol that makes a tracker's copy exactly-once, one batch at a time:
1. `plan_batch` announces the batch in `pending` and commits (train steps cursor+1.., the syncs,
   evaluations and config not logged yet);
2. the sink writes it to the tracker;
3. `complete_batch` moves the cursor past it and clears `pending`.
A sink that dies between 1 and 3 leaves the batch pending: the next pass writes that same batch again
as a replay, which each tracker makes harmless (sinks.py), so nothing is logged twice or skipped.
One writer per (run, tracker) at a time: passes hold a Postgres advisory lock (follow.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from rlpipe.schemas.tables import TrackerCursor
from rlpipe.storage.runs import record_failure
from rlpipe.tracking import reading
from rlpipe.tracking.records import CONFIG_KEY, eval_key, sync_key


@dataclass(frozen=True)
class Plan:
    number: int
    first_step: int
    last_step: int
    """Train steps first_step..last_step; none when first_step > last_step."""
    keys: tuple[str, ...]
    replay: bool = False
    """The batch was announced by an earlier pass that may have written some or all of it."""


@dataclass(frozen=True)
class CursorState:
    tracker: str
    step: int
    error: str | None
    failing_since: str | None


def _cursor(s: Session, run_id: str, tracker: str) -> TrackerCursor:
    s.execute(insert(TrackerCursor).values(run_id=run_id, tracker=tracker)
              .on_conflict_do_nothing(constraint="uq_tracker_cursors_run_id_tracker"))
    row = s.scalar(sa.select(TrackerCursor).where(TrackerCursor.run_id == run_id, TrackerCursor.tracker == tracker)
                   .with_for_update())
    assert row is not None
    return row


def plan_batch(s: Session, run_id: str, tracker: str, max_steps: int) -> Plan | None:
    """The batch to write next (announced in `pending`), or None when the tracker has everything."""
    cur = _cursor(s, run_id, tracker)
    if cur.pending is not None:
        p = cur.pending
        return Plan(p["number"], p["first_step"], p["last_step"], tuple(p["keys"]), replay=True)
    last = min(reading.last_step(s, run_id), cur.step + max_steps)
    active = reading.run_active(s, run_id)
    logged = set(cur.logged)
    # syncs and evaluations of versions whose publishing step is (being) logged: trackers that plot
    # by step then never get a point ahead of the steps they have
    keys = [CONFIG_KEY] if CONFIG_KEY not in logged else []
    keys += [sync_key(r.version, r.server) for r in reading.syncs(s, run_id, active) if r.step <= last]
    keys += [eval_key(r.version, r.split) for r in reading.evals(s, run_id) if r.step <= last]
    keys = [k for k in keys if k not in logged]
    if last <= cur.step and not keys:
        return None
    plan = Plan(cur.batches, cur.step + 1, last, tuple(keys))
    cur.pending = {k: v for k, v in asdict(plan).items() if k != "replay"}
    cur.updated_at = sa.func.now()
    return plan


def complete_batch(s: Session, run_id: str, tracker: str, plan: Plan) -> None:
    cur = _cursor(s, run_id, tracker)
    cur.step = max(cur.step, plan.last_step)
    cur.logged = [*cur.logged, *(k for k in plan.keys if k not in cur.logged)]
    cur.batches, cur.pending, cur.error, cur.failing_since = plan.number + 1, None, None, None
    cur.updated_at = sa.func.now()


def record_tracker_error(s: Session, run_id: str, tracker: str, error: BaseException) -> bool:
    """Note the tracker's error on its cursor; the first error after a success also goes to `failures`
    (kind 'tracking'), so a tracker that stays down is one row, not one per retry. True if it was the first."""
    cur = _cursor(s, run_id, tracker)
    message = f"{type(error).__name__}: {error}"[:2000]
    first = cur.failing_since is None
    cur.error, cur.updated_at = message, sa.func.now()
    if first:
        cur.failing_since = sa.func.now()
        record_failure(s, run_id=run_id, kind="tracking", error_type=type(error).__name__,
                       message=f"tracker {tracker} failed; the run goes on and the tracker catches up when it "
                               f"answers again: {message}", activity=f"tracking:{tracker}",
                       details={"tracker": tracker, "logged_through_step": cur.step})
    return first


def cursor_states(s: Session, run_id: str) -> list[CursorState]:
    rows = s.execute(sa.select(TrackerCursor.tracker, TrackerCursor.step, TrackerCursor.error,
                               TrackerCursor.failing_since)
                     .where(TrackerCursor.run_id == run_id).order_by(TrackerCursor.tracker)).all()
    return [CursorState(t, step, err, since.strftime("%Y-%m-%d %H:%M:%S") if since else None)
            for t, step, err, since in rows]


def describe_trackers(states: list[CursorState], committed_steps: int) -> list[tuple[str, bool]]:
    """One line per tracker for `rlpipe run status`, and whether it is a warning."""
    lines = []
    for c in states:
        behind = committed_steps - c.step
        if c.error is not None:
            lines.append((f"{c.tracker}: NOT RECEIVING since {c.failing_since} UTC, at step {c.step} of "
                          f"{committed_steps} (the run goes on; it catches up when the tracker answers): {c.error}",
                          True))
        else:
            lines.append((f"{c.tracker}: at step {c.step} of {committed_steps}" +
                          (f" ({behind} to send)" if behind else ""), False))
    return lines


def tracker_lines(s: Session, run_id: str) -> list[tuple[str, bool]]:
    return describe_trackers(cursor_states(s, run_id), reading.last_step(s, run_id))
