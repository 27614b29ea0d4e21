"""Feeding the trackers: passes over a run's record, and the loop that runs them in the rollout worker.

Why there, and not an activity after each committed step: the trackers then sit on no path of the
run at all. No workflow waits on them (no history events, no replay concerns, no step that could be
retried because a tracker is slow), the trainer never imports them, and a tracker that is down costs
the run nothing: its cursor stays where it was and the loop tries again later with backoff. The
rollout worker already hosts the workflow queue's light Postgres bookkeeping; the writes run in a
thread, off its event loop. Any number of such workers may run: one pass per (run, tracker) at a
time holds a Postgres advisory lock, so two workers never write the same batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import sqlalchemy as sa

from rlpipe.schemas.config import RunConfig
from rlpipe.schemas.tracking import TrackerName
from rlpipe.storage.db import Database
from rlpipe.tracking import reading
from rlpipe.tracking.cursor import Plan, complete_batch, plan_batch, record_tracker_error
from rlpipe.tracking.records import (
    CONFIG_KEY,
    Batch,
    eval_key,
    eval_points,
    flat_params,
    step_points,
    sync_key,
    sync_points,
)
from rlpipe.tracking.sinks import Sink, open_sink

log = logging.getLogger("rlpipe.tracking")
MAX_STEPS_PER_BATCH = 64
POLL_S = 5.0
BACKOFF_S = (5.0, 15.0, 60.0, 300.0)
"""Waits before retrying a tracker that failed 1, 2, 3, 4+ times in a row."""
FOLLOW_FINISHED_FOR = "1 day"
"""Runs that ended longer ago than this are no longer followed: a tracker still down by then keeps
what it lacks on record (its cursor, its `failures` row, `rlpipe run status`)."""
Outcome = Literal["written", "idle", "busy", "failed"]


def read_batch(db: Database, run_id: str, plan: Plan) -> Batch:
    """The batch `plan` names, read from committed rows (the same rows on every try)."""
    batch = Batch(plan.number, plan.first_step, plan.last_step, plan.keys)
    keys = set(plan.keys)
    with db.begin() as s:
        for record in reading.steps(s, run_id, plan.first_step, plan.last_step):
            scalars, histograms = step_points(record)
            batch.scalars.extend(scalars)
            batch.histograms.extend(histograms)
        for sync in reading.syncs(s, run_id, run_active=False):
            if sync_key(sync.version, sync.server) in keys:
                batch.scalars.extend(sync_points(sync))
        for result in reading.evals(s, run_id):
            if eval_key(result.version, result.split) in keys:
                batch.scalars.extend(eval_points(result))
        if CONFIG_KEY in keys:
            batch.params.update(flat_params(reading.run_config(s, run_id) or {}))
    return batch


@contextmanager
def exclusive(db: Database, run_id: str, tracker: str, wait: bool) -> Iterator[bool]:
    """Hold the (run, tracker) advisory lock while inside; yields False if another pass holds it
    (and `wait` is False). A session lock: it goes with the connection if this process dies."""
    key = f"rlpipe-tracking:{run_id}:{tracker}"
    with db.engine.connect() as conn:
        if wait:
            conn.execute(sa.text("select pg_advisory_lock(hashtextextended(:k, 0))"), {"k": key})
        elif not conn.scalar(sa.text("select pg_try_advisory_lock(hashtextextended(:k, 0))"), {"k": key}):
            yield False
            return
        conn.commit()
        try:
            yield True
        finally:
            conn.execute(sa.text("select pg_advisory_unlock(hashtextextended(:k, 0))"), {"k": key})
            conn.commit()


def advance(db: Database, run_id: str, tracker: str, sink: Sink, *, wait: bool = False,
            max_steps: int = MAX_STEPS_PER_BATCH) -> Outcome:
    """One pass: plan the next batch, write it, move the cursor (cursor.py has the protocol)."""
    with exclusive(db, run_id, tracker, wait) as held:
        if not held:
            return "busy"
        with db.begin() as s:
            plan = plan_batch(s, run_id, tracker, max_steps)
        if plan is None:
            return "idle"
        try:
            sink.write(read_batch(db, run_id, plan), replay=plan.replay)
        except Exception as exc:  # noqa: BLE001 - any tracker error: the run goes on, the batch stays pending
            with db.begin() as s:
                if record_tracker_error(s, run_id, tracker, exc):
                    log.warning("tracker %s of run %s failed (retrying with backoff): %s", tracker, run_id, exc)
            return "failed"
        with db.begin() as s:
            complete_batch(s, run_id, tracker, plan)
        return "written"


def catch_up(db: Database, run_id: str, tracker: TrackerName, sink: Sink, wait: bool = True) -> Outcome:
    """Pass after pass until the tracker has everything committed ('idle') or fails."""
    while (outcome := advance(db, run_id, tracker, sink, wait=wait)) == "written":
        pass
    return outcome


def catch_up_run(db: Database, cfg: RunConfig) -> dict[TrackerName, Outcome]:
    """Bring every tracker of the run up to what Postgres committed now (the demo, after its run)."""
    outcomes: dict[TrackerName, Outcome] = {}
    for tracker in cfg.tracking:
        sink = open_sink(tracker, cfg.name, cfg.trackers)
        try:
            outcomes[tracker] = catch_up(db, cfg.name, tracker, sink)
        finally:
            sink.close()
    return outcomes


@dataclass
class _Follower:
    sink: Sink | None = None
    """Opened at the first pass that gets to it (opening can fail too: a tracker package not installed)."""
    failures: int = 0
    retry_at: float = 0.0


@dataclass
class TrackingLoop:
    """Follows every run with trackers that is active or ended recently, in the rollout worker."""

    db: Database
    poll_s: float = POLL_S
    followers: dict[tuple[str, TrackerName], _Follower] = field(default_factory=dict)

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.one_round)
            except Exception:  # noqa: BLE001 - e.g. Postgres down: the loop waits it out like the workers do
                log.warning("tracking round failed; trying again in %.0f s", self.poll_s, exc_info=True)
            await asyncio.sleep(self.poll_s)

    def one_round(self) -> None:
        followed: set[tuple[str, TrackerName]] = set()
        for run_id, config, active in self._runs():
            try:
                cfg = RunConfig.model_validate(config)
            except ValueError:  # a rejected run's config, as given: it never ran, nothing to track
                continue
            for tracker in cfg.tracking:
                followed.add((run_id, tracker))
                follower = self.followers.setdefault((run_id, tracker), _Follower())
                if time.monotonic() < follower.retry_at:
                    continue
                try:
                    if follower.sink is None:
                        follower.sink = open_sink(tracker, run_id, cfg.trackers)
                    outcome = catch_up(self.db, run_id, tracker, follower.sink, wait=False)
                except ImportError as exc:  # the `tracking` extra not installed: said like any tracker error
                    with self.db.begin() as s:
                        record_tracker_error(s, run_id, tracker, exc)
                    outcome = "failed"
                if outcome == "failed":
                    follower.failures += 1
                    follower.retry_at = time.monotonic() + BACKOFF_S[min(follower.failures, len(BACKOFF_S)) - 1]
                else:
                    follower.failures = 0
                if outcome == "idle" and not active and follower.sink is not None:
                    # an ended run that its tracker has whole: let the tracker close it (W&B marks the run
                    # finished); a late record (an evaluation) opens it again
                    follower.sink.close()
                    follower.sink = None
        for key in set(self.followers) - followed:  # runs no longer followed
            sink = self.followers.pop(key).sink
            if sink is not None:
                sink.close()

    def _runs(self) -> list[tuple[str, dict[str, object], bool]]:
        """(run id, config, whether it is still running or paused) of each run to follow."""
        with self.db.begin() as s:
            rows = s.execute(sa.text(f"""
                select id, config, status in ('running', 'paused') from runs
                where jsonb_typeof(config -> 'tracking') = 'array' and jsonb_array_length(config -> 'tracking') > 0
                  and (status in ('running', 'paused') or finished_at > now() - interval '{FOLLOW_FINISHED_FOR}')
                order by created_at"""))
            return [(run_id, config, active) for run_id, config, active in rows]
