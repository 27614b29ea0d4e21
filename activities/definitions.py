"""Every activity the workflows call, named once with its payload types and its task queue.

The workflows call activities through these definitions (`workflows.calls.execute`), the real
implementations register under `definition.name`, and so do the in-memory fakes of the workflow-logic
tests. A unit test (tests/unit/test_activity_definitions.py) checks that each implementation's
signature takes `input` and returns `output`. This module imports payloads only: the workflow
sandbox and the fakes load it without torch, SQLAlchemy or any client library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from rlpipe.schemas.config import RunConfig
from rlpipe.schemas.payloads import (
    GRADER_QUEUE,
    ROLLOUT_QUEUE,
    SANDBOX_QUEUE,
    TRAINER_QUEUE,
    WORKFLOW_QUEUE,
    EvalInput,
    EvalSummary,
    FailureRecord,
    FinishGroupInput,
    GenerateInput,
    GenerateResult,
    GradeGroupInput,
    GradeGroupResult,
    GroupSummary,
    InitPolicyInput,
    JoinRequest,
    PublishedVersion,
    RegisterRunResult,
    RejectedRun,
    RunCheckInput,
    RunStatusUpdate,
    StartGroupInput,
    StartGroupResult,
    StepSummary,
    SyncInput,
    SyncResult,
    ToolInput,
    ToolResult,
    TrainStepInput,
)

In = TypeVar("In")
Out = TypeVar("Out")


@dataclass(frozen=True)
class ActivityDefinition(Generic[In, Out]):
    name: str
    """The activity type name in Temporal's history (never rename: histories replay by it)."""
    input: type[In]
    output: type[Out] | None
    """None for activities that return nothing."""
    task_queue: str | None
    """The queue of the workers that run it; None where the caller picks it (one queue per server)."""


# -- bookkeeping (workflow queue: light Postgres writes) ------------------------------------------
REGISTER_RUN = ActivityDefinition("register_run", RunConfig, RegisterRunResult, WORKFLOW_QUEUE)
SET_RUN_STATUS: ActivityDefinition[RunStatusUpdate, None] = ActivityDefinition(
    "set_run_status", RunStatusUpdate, None, WORKFLOW_QUEUE)
RECORD_FAILURE: ActivityDefinition[FailureRecord, None] = ActivityDefinition(
    "record_failure", FailureRecord, None, WORKFLOW_QUEUE)
RECORD_REJECTED_RUN: ActivityDefinition[RejectedRun, None] = ActivityDefinition(
    "record_rejected_run", RejectedRun, None, WORKFLOW_QUEUE)
CHECK_SERVER: ActivityDefinition[JoinRequest, None] = ActivityDefinition(
    "check_server", JoinRequest, None, WORKFLOW_QUEUE)
"""A server joining a running run is one the workers can reach by name (configured or registered)."""

# -- rollout -----------------------------------------------------------------------------------------
CHECK_TASKS: ActivityDefinition[RunCheckInput, None] = ActivityDefinition(
    "check_tasks", RunCheckInput, None, ROLLOUT_QUEUE)
"""Before the first group: the run's environment can produce its train and eval tasks."""
START_GROUP = ActivityDefinition("start_group", StartGroupInput, StartGroupResult, ROLLOUT_QUEUE)
GENERATE = ActivityDefinition("generate", GenerateInput, GenerateResult, ROLLOUT_QUEUE)
FINISH_GROUP = ActivityDefinition("finish_group", FinishGroupInput, GroupSummary, ROLLOUT_QUEUE)
RUN_TOOL = ActivityDefinition("run_tool", ToolInput, ToolResult, SANDBOX_QUEUE)

# -- grading and evaluation -------------------------------------------------------------------------
GRADE_GROUP = ActivityDefinition("grade_group", GradeGroupInput, GradeGroupResult, GRADER_QUEUE)
EVALUATE = ActivityDefinition("evaluate", EvalInput, EvalSummary, GRADER_QUEUE)

# -- trainer and weight sync ------------------------------------------------------------------------
INIT_POLICY = ActivityDefinition("init_policy", InitPolicyInput, PublishedVersion, TRAINER_QUEUE)
TRAIN_STEP = ActivityDefinition("train_step", TrainStepInput, StepSummary, TRAINER_QUEUE)
SYNC_WEIGHTS = ActivityDefinition("sync_weights", SyncInput, SyncResult, None)
"""On `payloads.sync_queue(server)`: the sidecar beside that server."""

ALL_ACTIVITIES: tuple[ActivityDefinition[Any, Any], ...] = (
    REGISTER_RUN, SET_RUN_STATUS, RECORD_FAILURE, RECORD_REJECTED_RUN, CHECK_SERVER, CHECK_TASKS, START_GROUP, GENERATE,
    FINISH_GROUP, RUN_TOOL, GRADE_GROUP, EVALUATE, INIT_POLICY, TRAIN_STEP, SYNC_WEIGHTS)
