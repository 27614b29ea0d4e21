"""What every activity shares: busy tracking, the activity-span log, failure recording, and
heartbeats while waiting."""

from __future__ import annotations

import asyncio
import functools
import os
import socket
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, ParamSpec, TypeVar

from sqlalchemy.dialects.postgresql import insert
from temporalio import activity
from temporalio.exceptions import ApplicationError

from rlpipe.activities.outages import unreachable_service
from rlpipe.observe.metrics import METRICS
from rlpipe.schemas.tables import ActivitySpan
from rlpipe.storage.db import Database
from rlpipe.storage.runs import record_failure
from rlpipe.workflows.policies import OUTAGE

P = ParamSpec("P")
R = TypeVar("R")
WORKER = f"{socket.gethostname()}:{os.getpid()}"


def instrumented(box: str, kind: str) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """Decorate an async activity method (of a class with `self.db`): the `box` counts as busy
    while it runs, its span is logged in `activity_spans` (the pipeline's timeline), and any
    exception is written to `failures` as `kind`, with the attempt number, before Temporal retries.
    An error that says a service is unreachable is raised again as an `OUTAGE` error."""

    def decorate(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        @functools.wraps(fn)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            owner: Any = args[0]
            run_id = getattr(args[1] if len(args) > 1 else None, "run_id", None)
            started, ok = datetime.now(UTC), False
            try:
                with METRICS.tracker.busy(box):
                    result = await fn(*args, **kwargs)
                ok = True
                return result
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                METRICS.observe_failure(kind, activity.info().activity_type)
                await asyncio.to_thread(_record_failure, owner.db, kind, run_id, exc)
                service = unreachable_service(exc)
                if service is not None:  # the workflow waits the outage out (workflows/policies.py)
                    raise ApplicationError(f"{service} unreachable: {type(exc).__name__}: {exc}", type=OUTAGE) \
                        from exc
                raise
            finally:
                await asyncio.to_thread(_record_span, owner.db, box, run_id, ok, started)

        return wrapper

    return decorate


def _record_failure(db: Database, kind: str, run_id: str | None, exc: BaseException) -> None:
    info = activity.info()
    try:
        with db.begin() as s:
            record_failure(s, run_id=run_id, kind=kind, error_type=type(exc).__name__, message=str(exc) or repr(exc),
                           activity=info.activity_type, workflow_id=info.workflow_id, activity_id=info.activity_id,
                           attempt=info.attempt)
    except Exception:  # noqa: BLE001 - the database may be what failed; the error still reaches Temporal
        activity.logger.warning("could not record a %s failure in the database", kind, exc_info=True)


def _record_span(db: Database, box: str, run_id: str | None, ok: bool, started: datetime) -> None:
    info = activity.info()
    try:
        with db.begin() as s:
            s.execute(insert(ActivitySpan).values(
                run_id=run_id, box=box, activity=info.activity_type, workflow_id=info.workflow_id or "",
                activity_id=info.activity_id, attempt=info.attempt, worker=WORKER, ok=ok, started_at=started,
                finished_at=datetime.now(UTC)).on_conflict_do_nothing(
                constraint="uq_activity_spans_workflow_id_activity_id_attempt"))
    except Exception:  # noqa: BLE001 - the timeline is best effort; the activity's outcome stands
        activity.logger.warning("could not record the activity span", exc_info=True)


async def heartbeating(awaitable: Awaitable[R], every_s: float = 5.0) -> R:
    """Await `awaitable` while heartbeating, so a lost worker is noticed by its heartbeat timeout
    and a cancelled activity learns of it."""
    task = asyncio.ensure_future(awaitable)
    while True:
        done, _ = await asyncio.wait({task}, timeout=every_s)
        if done:
            return task.result()
        activity.heartbeat()
