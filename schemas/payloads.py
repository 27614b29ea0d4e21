"""Workflow and activity payloads: small JSON-friendly dataclasses (ids, counts, versions, short
summaries). Token ids, tensors, weights and long text never travel here: activities store them in
Postgres or S3 and pass references (the claim-check pattern), keeping histories small.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Task queues, one per box. `inference-<server>` queues are per server (see `sync_queue`).
WORKFLOW_QUEUE = "rlpipe"
"""TrainingRun and RolloutGroup workflows, plus the light persistence activities."""
ROLLOUT_QUEUE = "rollout"
SANDBOX_QUEUE = "sandbox"
GRADER_QUEUE = "grader"
TRAINER_QUEUE = "trainer"


def sync_queue(server: str) -> str:
    """The task queue of the sync sidecar beside inference server `server`."""
    return f"inference-{server}"


# -- run ------------------------------------------------------------------------------------------
@dataclass
class RegisterRunResult:
    servers: list[str]
    """Ids of the inference servers the workers know (e.g. ["0", "1"])."""


@dataclass
class GroupSummary:
    """What the run keeps about a finished group while it waits in the buffer."""

    group_index: int
    status: str
    """completed | failed | dropped"""
    min_version: int | None = None
    n_samples: int = 0
    reward_mean: float | None = None
    reason: str | None = None


@dataclass
class RunState:
    """Everything the TrainingRun workflow carries across continue-as-new."""

    step: int = 0
    """Last committed optimiser step."""
    version: int = 0
    """Latest published policy version."""
    version_steps: list[int] = field(default_factory=lambda: [0])
    """trained_steps of each published version (index = version)."""
    server_versions: dict[str, int] = field(default_factory=dict)
    """Version each inference server verifiably holds; a server missing here (never loaded, or its
    sidecar reported it down) gets no groups."""
    servers: list[str] = field(default_factory=list)
    next_group_index: int = 0
    in_flight: list[int] = field(default_factory=list)
    in_flight_servers: dict[int, str] = field(default_factory=dict)
    """Group index -> the server it was started on, for the groups in flight (load-aware routing)."""
    ready: list[GroupSummary] = field(default_factory=list)
    """Completed groups not yet consumed by a step."""
    groups_completed: int = 0
    groups_consumed: int = 0
    groups_dropped: int = 0
    groups_failed: int = 0
    groups_failed_in_a_row: int = 0
    """Failed groups since the last completed one (or the last resume): the pause-on-failures count."""
    groups_rerouted: int = 0
    """Times a group in flight was moved off a server that went down (or was drained with move)."""
    draining: list[str] = field(default_factory=list)
    """Servers leaving the run: no new groups or loads; they leave once their groups have finished."""
    left: list[str] = field(default_factory=list)
    """Servers that were drained and left the run."""
    joining: list[str] = field(default_factory=list)
    """Servers that joined the running run and have not yet verified the version current when they
    joined: no groups go to them (whatever their sidecar reports they hold)."""
    paused: bool = False
    pause_reason: str | None = None
    phase: str = "starting"
    sync_interval: int = 1
    max_staleness: int = 1
    steps_this_run: int = 0
    """Steps since the last continue-as-new."""
    last_step_summary: StepSummary | None = None
    evals: list[EvalSummary] = field(default_factory=list)
    last_group_failure: str | None = None
    close_reason: str | None = None
    """Why the run failed or was cancelled (phase "failed" / "cancelled")."""
    evals_due: list[int] = field(default_factory=list)
    """Published versions to evaluate on the first server that verifies them."""
    """Why the latest failed or dropped group ended so (e.g. the inference server is unreachable)."""


@dataclass
class RunStatus:
    """Answer of the `status` query."""

    run: str
    mode: str
    phase: str
    step: int
    steps: int
    version: int
    server_versions: dict[str, int]
    in_flight: int
    buffered: int
    groups_completed: int
    groups_consumed: int
    groups_dropped: int
    groups_failed: int
    paused: bool
    pause_reason: str | None
    sync_interval: int
    max_staleness: int
    last_step: StepSummary | None
    evals: list[EvalSummary] = field(default_factory=list)
    last_group_failure: str | None = None
    unavailable_servers: list[str] = field(default_factory=list)
    """Servers that verifiably hold no published version (down, or restarted): no group goes to them."""
    groups_rerouted: int = 0
    """Times a group in flight was moved off a server that went down (its model calls went on elsewhere)."""
    in_flight_by_server: dict[str, int] = field(default_factory=dict)
    """Server -> groups in flight on it (runs with load-aware routing)."""
    draining_servers: list[str] = field(default_factory=list)
    """Servers being drained: their groups in flight finish, nothing new goes to them."""
    left_servers: list[str] = field(default_factory=list)
    """Servers drained out of the run (safe to stop)."""
    joining_servers: list[str] = field(default_factory=list)
    """Servers that joined and are loading the current version: they take groups once it is verified."""
    close_reason: str | None = None
    """Why the run failed or was cancelled."""


@dataclass
class ServerState:
    """A sync sidecar's report on its inference server (the `server_state` signal)."""

    server: str
    version: int | None
    """The published version the server verifiably holds again; None: it is down or holds
    unverified weights (a restart), so no group may be sent to it."""


@dataclass
class RunResult:
    run: str
    steps: int
    version: int
    groups_consumed: int
    groups_dropped: int
    groups_failed: int


@dataclass
class PauseRequest:
    reason: str = "paused by user"


@dataclass
class DrainRequest:
    """Take a server out of a running run (`drain_server` update)."""

    server: str
    move: bool = False
    """False: its groups in flight finish there; True: they move to the other servers at once."""


@dataclass
class JoinRequest:
    """Add a server to a running run (`join_server` update); its sidecar must be running."""

    server: str


@dataclass
class ScheduleUpdate:
    """A change to a running run's sync/staleness trade-off (validated by the workflow)."""

    sync_interval: int | None = None
    max_staleness: int | None = None


# -- rollout group ----------------------------------------------------------------------------------
@dataclass
class GroupInput:
    run_id: str
    run_workflow_id: str
    group_index: int
    server: str
    """Inference server this group's samples go to."""
    group_size: int
    hedge_samples: int
    max_turns: int
    group_deadline_s: float | None
    straggler_policy: str
    min_partial_samples: int
    generate_timeout_s: float
    generate_attempts: int
    tool_timeout_s: float
    tool_attempts: int
    grade_timeout_s: float
    grade_attempts: int
    outage_budget_s: float = 900.0
    max_history_events: int | None = None
    """Continue-as-new before the group's history passes this many events (or when Temporal
    suggests it); None (groups started before the bound existed) never does."""
    progress: GroupProgress | None = None
    """What earlier executions of this group finished; None in its first execution."""


@dataclass
class GroupProgress:
    """What a rollout group carries across continue-as-new: its trajectories and how far each
    sample got, so that no finished turn is played again."""

    trajectory_ids: list[int]
    next_turns: list[int]
    """Per sample: the first turn not yet played (a turn is its model call and its tool calls)."""
    finished: list[int] = field(default_factory=list)
    """Sample indices, in the order they finished (the first `group_size` are kept)."""
    failed: dict[int, str] = field(default_factory=dict)
    """Sample index -> why it failed."""
    deadline_at: float | None = None
    """When the group's deadline passes (workflow time, POSIX seconds); None without a deadline."""
    outages_waited: list[str] = field(default_factory=list)
    """Calls run again after an outage, not yet recorded in `failures` (the last 50)."""


@dataclass
class StartGroupInput:
    run_id: str
    group_index: int
    workflow_id: str
    n_samples: int


@dataclass
class StartGroupResult:
    trajectory_ids: list[int]
    task_id: str


@dataclass
class GenerateInput:
    run_id: str
    trajectory_id: int
    turn_index: int
    server: str


@dataclass
class GenerateResult:
    """A model turn's summary; the tokens are in `turns`."""

    n_tool_calls: int
    done: bool
    """True when the episode ended with this turn (final answer, length, or no turns left)."""
    n_tokens: int
    version: int | None
    finish_reason: str


@dataclass
class ToolInput:
    run_id: str
    trajectory_id: int
    turn_index: int
    call_index: int


@dataclass
class ToolResult:
    status: str
    latency_s: float


@dataclass
class GradeGroupInput:
    run_id: str
    group_index: int
    trajectory_ids: list[int]


@dataclass
class GradeGroupResult:
    rewards: list[float]
    cache_hits: int


@dataclass
class FinishGroupInput:
    run_id: str
    group_index: int
    trajectory_ids: list[int]
    """The samples kept (finished and graded), in sample order."""
    rewards: list[float]
    discarded_ids: list[int] = field(default_factory=list)
    """Hedged or straggling samples left out of the group."""
    status: str = "completed"
    reason: str | None = None


# -- trainer ----------------------------------------------------------------------------------------
@dataclass
class InitPolicyInput:
    run_id: str


@dataclass
class PublishedVersion:
    version: int
    trained_steps: int
    checkpoint_key: str
    sha256: str


@dataclass
class TrainStepInput:
    run_id: str
    step: int
    policy_version: int
    """Latest published version when the step starts."""
    min_trained_steps: int
    """Freshness rule: groups generated by weights with fewer steps are dropped, not trained on."""
    groups_per_step: int
    publish: bool
    """Publish a checkpoint after this step (every sync interval, and at the last step)."""

    @property
    def max_staleness(self) -> int:
        """The staleness bound this step claims under (the run's max_staleness when it was called,
        which a schedule update may have changed since the run started)."""
        return (self.step - 1) - self.min_trained_steps


@dataclass
class StepSummary:
    step: int
    loss: float
    reward_mean: float
    staleness_max: int
    n_tokens: int
    consumed_groups: list[int]
    dropped_groups: list[int]
    published: PublishedVersion | None
    duration_s: float
    staleness: list[int] = field(default_factory=list)
    """Per consumed trajectory: optimiser steps its weights lagged the step (for the metrics)."""
    entropy: float | None = None
    kl_sampler: float | None = None
    response_length: float | None = None


# -- weights ----------------------------------------------------------------------------------------
@dataclass
class SyncInput:
    run_id: str
    version: int


@dataclass
class SyncResult:
    server: str
    version: int
    status: str
    """ok | failed | rolled_back | refused"""
    total_s: float
    error: str | None = None


# -- evaluation ----------------------------------------------------------------------------------
@dataclass
class EvalInput:
    run_id: str
    version: int
    server: str


@dataclass
class EvalSummary:
    version: int
    n_prompts: int
    accuracy: float
    ci_low: float
    ci_high: float


# -- bookkeeping -----------------------------------------------------------------------------------
@dataclass
class RunStatusUpdate:
    run_id: str
    status: str
    reason: str | None = None


@dataclass
class RejectedRun:
    """A run whose config failed validation inside the workflow: it still gets a row in `runs`."""

    workflow_id: str
    config: Any
    """The config as given (usually the Web UI's JSON object)."""
    reason: str


@dataclass
class RunCheckInput:
    run_id: str


@dataclass
class FailureRecord:
    run_id: str
    kind: str
    message: str
    error_type: str = "WorkflowDecision"
    workflow_id: str | None = None
    activity_id: str | None = None
    details: dict[str, object] = field(default_factory=dict)
