"""How the workflows call an activity: by its definition (activities/definitions.py), so that the
name, the payload types and the task queue are written once, and the result comes back typed."""

from __future__ import annotations

from typing import TypeVar, Unpack

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from rlpipe.activities.definitions import ActivityDefinition
    from rlpipe.workflows.policies import ActivityOptions

In = TypeVar("In")
Out = TypeVar("Out")


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
