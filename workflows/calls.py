"""How the workflows call an activity: by its definition (activities/definitions.py), so that the
name, the payload types and the task queue are written once, and the result comes back typed."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TypeVar, Unpack

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from rlpipe.activities.definitions import ActivityDefinition
    from rlpipe.workflows.policies import OUTAGE, ActivityOptions

In = TypeVar("In")
Out = TypeVar("Out")

OUTAGE_BACKOFF_S = (1.0, 30.0)
"""The first wait after a call failed for an outage, and the longest (it doubles in between)."""


async def execute(activity: ActivityDefinition[In, Out], arg: In, *, task_queue: str | None = None,
                  **options: Unpack[ActivityOptions]) -> Out:
    """Run `activity` on `arg` and return its result. `task_queue` is for definitions without one
    (a sync goes to the queue of its server's sidecar); `options` are the timeouts and retry policy
    (workflows/policies.py)."""
    queue = task_queue or activity.task_queue
    if queue is None:
        raise ValueError(f"activity {activity.name!r} needs a task_queue at the call")
    result: Out = await workflow.execute_activity(activity.name, arg, result_type=activity.output, task_queue=queue,
                                                  **options)
    return result


@dataclass
class Outages:
    """A workflow's outage budget, and the calls that failed for an outage and were run again
    (recorded in `failures` once the database is back)."""

    budget_s: float
    waited: list[str] = field(default_factory=list)


async def execute_through_outages(activity: ActivityDefinition[In, Out], arg: In, outages: Outages, *,
                                  task_queue: str | None = None, **options: Unpack[ActivityOptions]) -> Out:
    """`execute`, run again while it fails because a service is unreachable (an `OUTAGE` error;
    its retry policy hands those to the workflow), with backoff, until `outages.budget_s` has passed
    since its first such failure: then the outage error is raised. The task's own errors are
    retried by the policy, and only those spend its attempts."""
    first_outage: datetime | None = None
    wait_s, longest_s = OUTAGE_BACKOFF_S
    while True:
        try:
            return await execute(activity, arg, task_queue=task_queue, **options)
        except ActivityError as err:
            if not (isinstance(err.cause, ApplicationError) and err.cause.type == OUTAGE):
                raise
            first_outage = first_outage or workflow.now()
            outages.waited.append(f"{workflow.now():%H:%M:%S} {activity.name}: {err.cause.message}")
            if (workflow.now() - first_outage).total_seconds() >= outages.budget_s:
                raise
            await workflow.sleep(wait_s)
            wait_s = min(2 * wait_s, longest_s)
