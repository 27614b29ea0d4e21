"""In-memory fakes of every activity the workflows call, registered under the real names, for
tests of the orchestration logic alone (budget, lock-step, continue-as-new, pause). They keep
the same books the real activities keep in Postgres, plus a log of events with timestamps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from rlpipe.activities.definitions import (
    CHECK_SERVER,
    CHECK_TASKS,
    EVALUATE,
    FINISH_GROUP,
    GENERATE,
    GRADE_GROUP,
    INIT_POLICY,
    RECORD_FAILURE,
    RECORD_REJECTED_RUN,
    REGISTER_RUN,
    RUN_TOOL,
    SET_RUN_STATUS,
    START_GROUP,
    SYNC_WEIGHTS,
    TRAIN_STEP,
)
from rlpipe.schemas.config import RunConfig
from rlpipe.schemas.payloads import (
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
    sync_queue,
)
from rlpipe.workflows.policies import OUTAGE
from rlpipe.workflows.rollout_group import RUN_CANCELLED

REFUSE_DELAY_S = 1.0


@dataclass
class FakeBooks:
    servers: list[str] = field(default_factory=lambda: ["0"])
    spare: list[str] = field(default_factory=list)
    """Servers the workers know that a run does not start on: they may join it."""
    tool_turns: int = 0
    """Model turns that call a tool before the final one (multi-turn episodes)."""
    start_delay_s: float = 0.0
    """How long starting a group takes before its rows are written."""
    generate_delay_s: float = 0.01
    slow_servers: dict[str, float] = field(default_factory=dict)
    """Server -> its generate delay, where it differs from generate_delay_s."""
    train_delay_s: float = 0.05
    version_steps: list[int] = field(default_factory=lambda: [0])
    server_version: dict[str, int] = field(default_factory=dict)
    groups: dict[int, dict] = field(default_factory=dict)  # index -> {version, status, claimed}
    events: list[tuple[float, str, int]] = field(default_factory=list)  # (time, kind, index)
    statuses: list[str] = field(default_factory=list)
    failures: list[FailureRecord] = field(default_factory=list)
    down: set[str] = field(default_factory=set)
    """Servers whose syncs fail (a server that is down)."""
    hung: set[str] = field(default_factory=set)
    """Servers whose model calls never answer (a server that died mid-call), until cancelled."""
    held_loads: set[str] = field(default_factory=set)
    """Servers whose loads wait (a slow load) until the server is removed from the set."""
    loads_started: list[tuple[str, int]] = field(default_factory=list)
    """(server, version) of every load as it starts, in order."""
    refused: set[int] = field(default_factory=set)
    """Versions whose syncs are refused after REFUSE_DELAY_S (deleted by the retention policy)."""
    loads: list[tuple[str, int, int]] = field(default_factory=list)
    """(server, version, model calls made so far) of every verified load, in order."""
    generated_on: list[str] = field(default_factory=list)
    """The server of every generate call, in order."""
    generated: list[tuple[int, int]] = field(default_factory=list)
    """(trajectory id, turn index) of every generate call, in order."""
    finished_groups: list[FinishGroupInput] = field(default_factory=list)
    """What every group closed its books with, in order."""
    grading_error: str | None = None
    """While set, grading fails with this message (a broken grader), without retries."""
    task_error: str | None = None
    """While set, the environment cannot produce tasks: the run's check fails with it."""
    group_start_error: str | None = None
    """While set, starting a group fails with it (a task the environment cannot draw)."""
    tool_outages: int = 0
    """Tool calls that fail first because the database is unreachable (an outage), one after another."""
    rejected: list[RejectedRun] = field(default_factory=list)
    cancelled_groups: list[int] = field(default_factory=list)
    """Groups whose workflow was cancelled and closed their books (status dropped)."""

    def log(self, kind: str, index: int) -> None:
        self.events.append((time.monotonic(), kind, index))

    def activities(self) -> list[Callable[..., Any]]:
        books = self

        @activity.defn(name=REGISTER_RUN.name)
        async def register_run(config: RunConfig) -> RegisterRunResult:
            return RegisterRunResult(servers=books.servers)

        @activity.defn(name=INIT_POLICY.name)
        async def init_policy(inp: InitPolicyInput) -> PublishedVersion:
            return PublishedVersion(0, 0, "k0", "0" * 64)

        @activity.defn(name=SYNC_WEIGHTS.name)
        async def sync_weights(inp: SyncInput) -> SyncResult:
            server = next(s for s in books.servers + books.spare if sync_queue(s) == activity.info().task_queue)
            if server in books.down:
                raise ApplicationError(f"server {server} is unreachable", non_retryable=True)
            books.log("sync_start", inp.version)
            books.loads_started.append((server, inp.version))
            while server in books.held_loads:
                await asyncio.sleep(0.02)
            if inp.version in books.refused:
                await asyncio.sleep(REFUSE_DELAY_S)
                return SyncResult(server, inp.version, "refused", REFUSE_DELAY_S,
                                  error=f"version {inp.version} was deleted by the run's retention policy")
            await asyncio.sleep(0.02)
            books.server_version[server] = inp.version
            books.loads.append((server, inp.version, len(books.generated_on)))
            books.log("sync_end", inp.version)
            return SyncResult(server, inp.version, "ok", 0.02)

        @activity.defn(name=CHECK_SERVER.name)
        async def check_server(request: JoinRequest) -> None:
            if request.server not in books.servers + books.spare:
                raise ApplicationError(f"no inference server named {request.server!r}", non_retryable=True)

        @activity.defn(name=CHECK_TASKS.name)
        async def check_tasks(inp: RunCheckInput) -> None:
            if books.task_error is not None:
                raise ApplicationError(books.task_error, type="ConfigError", non_retryable=True)

        @activity.defn(name=START_GROUP.name)
        async def start_group(inp: StartGroupInput) -> StartGroupResult:
            if books.group_start_error is not None:
                raise ApplicationError(books.group_start_error, type="ConfigError", non_retryable=True)
            await asyncio.sleep(books.start_delay_s)
            books.log("group_start", inp.group_index)
            books.groups.setdefault(inp.group_index, {"version": books.server_version.get("0", 0),
                                                      "status": "running", "claimed": None})
            return StartGroupResult(trajectory_ids=[inp.group_index * 100 + i for i in range(inp.n_samples)],
                                    task_id=f"t{inp.group_index}")

        @activity.defn(name=GENERATE.name)
        async def generate(inp: GenerateInput) -> GenerateResult:
            books.generated_on.append(inp.server)
            books.generated.append((inp.trajectory_id, inp.turn_index))
            while inp.server in books.hung:  # heartbeats: a cancel of the call reaches it
                activity.heartbeat()
                await asyncio.sleep(0.1)
            await asyncio.sleep(books.slow_servers.get(inp.server, books.generate_delay_s))
            calls = 1 if inp.turn_index < books.tool_turns else 0
            return GenerateResult(n_tool_calls=calls, done=calls == 0, n_tokens=3, version=0, finish_reason="stop")

        @activity.defn(name=RUN_TOOL.name)
        async def run_tool(inp: ToolInput) -> ToolResult:
            if books.tool_outages > 0:
                books.tool_outages -= 1
                raise ApplicationError("database unreachable: OperationalError: connection refused", type=OUTAGE)
            return ToolResult("ok", 0.0)

        @activity.defn(name=GRADE_GROUP.name)
        async def grade_group(inp: GradeGroupInput) -> GradeGroupResult:
            if books.grading_error is not None:
                raise ApplicationError(books.grading_error, non_retryable=True)
            return GradeGroupResult([float(i % 2) for i in range(len(inp.trajectory_ids))], 0)

        @activity.defn(name=FINISH_GROUP.name)
        async def finish_group(inp: FinishGroupInput) -> GroupSummary:
            group = books.groups[inp.group_index]
            group["status"] = inp.status
            books.finished_groups.append(inp)
            if inp.reason == RUN_CANCELLED:
                books.cancelled_groups.append(inp.group_index)
            books.log("group_end", inp.group_index)
            return GroupSummary(inp.group_index, inp.status, group["version"], len(inp.trajectory_ids), 0.5,
                                reason=inp.reason)

        @activity.defn(name=TRAIN_STEP.name)
        async def train_step(inp: TrainStepInput) -> StepSummary:
            books.log("train_start", inp.step)
            completed = sorted(i for i, g in books.groups.items()
                               if g["status"] == "completed" and g["claimed"] is None)
            stale = [i for i in completed if books.version_steps[books.groups[i]["version"]] < inp.min_trained_steps]
            fresh = [i for i in completed if i not in stale][: inp.groups_per_step]
            assert len(fresh) == inp.groups_per_step, f"step {inp.step}: {len(fresh)} fresh groups"
            for i in stale:
                books.groups[i]["status"] = "dropped"
            for i in fresh:
                books.groups[i]["claimed"] = inp.step
            await asyncio.sleep(books.train_delay_s)
            published = None
            if inp.publish:
                books.version_steps.append(inp.step)
                published = PublishedVersion(len(books.version_steps) - 1, inp.step, "k", "0" * 64)
            worst = max((inp.step - 1) - books.version_steps[books.groups[i]["version"]] for i in fresh)
            books.log("train_end", inp.step)
            return StepSummary(inp.step, 0.1, 0.5, worst, 10, fresh, stale, published, books.train_delay_s)

        @activity.defn(name=EVALUATE.name)
        async def evaluate(inp: EvalInput) -> EvalSummary:
            books.log("eval", inp.version)
            return EvalSummary(inp.version, 10, 0.5, 0.2, 0.8)

        @activity.defn(name=RECORD_FAILURE.name)
        async def record_failure(record: FailureRecord) -> None:
            books.failures.append(record)

        @activity.defn(name=RECORD_REJECTED_RUN.name)
        async def record_rejected_run(rejected: RejectedRun) -> None:
            books.rejected.append(rejected)

        @activity.defn(name=SET_RUN_STATUS.name)
        async def set_run_status(update: RunStatusUpdate) -> None:
            books.statuses.append(update.status)

        return [register_run, check_server, init_policy, sync_weights, check_tasks, start_group, generate, run_tool,
                grade_group, finish_group, train_step, evaluate, record_failure, record_rejected_run, set_run_status]
