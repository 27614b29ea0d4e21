"""`rlpipe run start|status|pause|resume|cancel|list`: runs through the Temporal client, with a
live progress display while a run trains."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
)
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from rlpipe.schemas.config import RUN_NAME_PATTERN, RunConfig
from rlpipe.schemas.payloads import WORKFLOW_QUEUE, DrainRequest, JoinRequest, PauseRequest, RunStatus, ScheduleUpdate
from rlpipe.workflows.training_run import TrainingRunWorkflow

console = Console()


class RunCommandError(RuntimeError):
    """A run command that cannot be done; the message says why."""


def workflow_id(run: str) -> str:
    return run if run.startswith("run-") else f"run-{run}"


async def find_run(client: Client, run: str) -> WorkflowHandle:
    """The workflow of run `run`: `run-<name>`; else (a run started from the Web UI under an id of
    its own) the newest TrainingRun workflow whose RunName is `run`; else the workflow id `run`."""
    async for candidate in _candidates(client, run):
        handle = client.get_workflow_handle(candidate)
        try:
            await handle.describe()
            return handle
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise RunCommandError(f"cannot ask Temporal about run '{run}': {exc.message}") from exc
    raise RunCommandError(f"no run '{run}': no workflow {workflow_id(run)} or {run}, and no TrainingRun workflow "
                          f"whose RunName is '{run}' (`rlpipe run list` shows them all)")


async def _candidates(client: Client, run: str) -> AsyncIterator[str]:
    """Workflow ids that may be run `run`'s, in the order `find_run` tries them."""
    yield workflow_id(run)
    if re.fullmatch(RUN_NAME_PATTERN, run):  # a run name (which also keeps the query free of quotes)
        async for wf in client.list_workflows(f"WorkflowType = 'TrainingRunWorkflow' AND RunName = '{run}'"):
            yield wf.id
    yield run


async def start_run(client: Client, config: RunConfig) -> WorkflowHandle:
    """Start the run, or attach to it if the same run (same name and config) is already running."""
    try:
        handle = await client.start_workflow(
            TrainingRunWorkflow.run, config, id=config.workflow_id, task_queue=WORKFLOW_QUEUE,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            memo={"config_sha256": _digest(config)})
    except WorkflowAlreadyStartedError as exc:  # a closed run of that name exists
        raise RunCommandError(f"a run named '{config.name}' already ran (workflow {config.workflow_id}); "
                              "choose another name") from exc
    await check_same_config(handle, config)
    return handle


async def check_same_config(handle: WorkflowHandle, config: RunConfig) -> None:
    """A second start of a running run must carry the same config, else it is a different run."""
    memo = await (await handle.describe()).memo()
    if memo.get("config_sha256") not in (None, _digest(config)):
        raise RunCommandError(f"run '{config.name}' is already running with a different config; "
                              "choose another name or cancel it first")


def _digest(config: RunConfig) -> str:
    return hashlib.sha256(json.dumps(config.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


async def run_status(client: Client, run: str) -> RunStatus:
    """The run's status from its workflow. A closed run answers from a replay of its history, which
    code changed since it ran may not reproduce: a failed or cancelled run then says why it closed."""
    handle = await find_run(client, run)
    try:
        return await handle.query(TrainingRunWorkflow.status)
    except (RPCError, WorkflowQueryFailedError) as exc:
        closed = (await handle.describe()).status
        if closed in (None, WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.COMPLETED):
            raise RunCommandError(f"run '{run}' cannot answer now: {exc}") from exc
        raise RunCommandError(f"run '{run}' {closed.name.lower()}: {await close_reason(handle)}") from exc


async def close_reason(handle: WorkflowHandle) -> str:
    """Why a run that did not complete closed: its failure, outermost message first."""
    try:
        await handle.result()
    except WorkflowFailureError as err:
        return failure_chain(err)
    return "it completed"


def failure_chain(err: BaseException) -> str:
    """The messages of an exception and its causes, outermost first (Temporal wraps the reason
    a run failed in a chain: workflow failure <- activity error <- application error)."""
    messages: list[str] = []
    current: BaseException | None = err
    while current is not None:
        messages.append(str(current) or type(current).__name__)
        current = current.__cause__
    return " <- ".join(messages)


async def final_status(client: Client, run: str) -> RunStatus:
    """The status of a closed run (queries still answer from its last state)."""
    return await client.get_workflow_handle(workflow_id(run)).query(TrainingRunWorkflow.status)


async def pause(client: Client, run: str, reason: str) -> RunStatus:
    request = PauseRequest(reason)
    return await _update(client, run, lambda handle: handle.execute_update(TrainingRunWorkflow.pause, request))


async def resume(client: Client, run: str) -> RunStatus:
    return await _update(client, run, lambda handle: handle.execute_update(TrainingRunWorkflow.resume))


async def set_schedule(client: Client, run: str, update: ScheduleUpdate) -> RunStatus:
    return await _update(client, run, lambda handle: handle.execute_update(TrainingRunWorkflow.set_schedule, update))


async def drain_server(client: Client, run: str, request: DrainRequest) -> RunStatus:
    return await _update(client, run, lambda handle: handle.execute_update(TrainingRunWorkflow.drain_server, request))


async def join_server(client: Client, run: str, request: JoinRequest) -> RunStatus:
    return await _update(client, run, lambda handle: handle.execute_update(TrainingRunWorkflow.join_server, request))


async def _update(client: Client, run: str,
                  send: Callable[[WorkflowHandle[Any, Any]], Awaitable[RunStatus]]) -> RunStatus:
    """`send` one update to the run's workflow; a rejected or failed update becomes a RunCommandError."""
    handle = await find_run(client, run)
    try:
        return await send(handle)
    except Exception as exc:  # WorkflowUpdateFailedError carries the validator's message
        cause = exc.__cause__ or exc
        raise RunCommandError(f"run '{run}': {getattr(cause, 'message', None) or cause}") from exc


async def cancel(client: Client, run: str) -> None:
    await (await find_run(client, run)).cancel()


async def list_runs(client: Client) -> list[tuple[str, str, str]]:
    rows = []
    async for wf in client.list_workflows("WorkflowType = 'TrainingRunWorkflow'"):
        rows.append((wf.id, wf.status.name if wf.status else "?", wf.start_time.strftime("%Y-%m-%d %H:%M:%S")))
    return rows


def status_table(status: RunStatus) -> Table:
    table = Table(show_header=False, box=None, padding=(0, 2))
    last = status.last_step
    table.add_row("phase", status.phase + (f" ({status.pause_reason})" if status.paused else "") +
                  (f" ({status.close_reason})" if status.close_reason else ""))
    table.add_row("policy version", f"v{status.version}  servers: " +
                  ", ".join(f"{s}=v{v}" for s, v in sorted(status.server_versions.items())))
    table.add_row("groups", f"{status.in_flight} in flight, {status.buffered} buffered, {status.groups_consumed} "
                            f"trained, {status.groups_dropped} dropped, {status.groups_failed} failed")
    if status.in_flight_by_server:
        table.add_row("in flight by server", ", ".join(f"{server}: {n}" for server, n
                                                        in sorted(status.in_flight_by_server.items())))
    if status.last_group_failure is not None:
        table.add_row("last failure", status.last_group_failure)
    if status.unavailable_servers:
        table.add_row("unavailable servers", ", ".join(status.unavailable_servers) + " (no groups routed to them)")
    if status.draining_servers:
        table.add_row("draining servers", ", ".join(status.draining_servers) + " (their groups finish; nothing new)")
    if status.joining_servers:
        table.add_row("joining servers", ", ".join(status.joining_servers) + " (loading the current version; "
                                                                             "groups once it is verified)")
    if status.left_servers:
        table.add_row("drained servers", ", ".join(status.left_servers) + " (out of the run: safe to stop)")
    if status.groups_rerouted:
        table.add_row("rerouted groups", f"{status.groups_rerouted} moved off a server that went down or was drained")
    if last is not None:
        table.add_row("last step", f"#{last.step}: reward {last.reward_mean:.3f}, loss {last.loss:.4f}, "
                                   f"staleness ≤ {last.staleness_max}, {last.n_tokens} tokens, {last.duration_s:.1f}s")
    table.add_row("schedule", f"sync every {status.sync_interval} step(s), max staleness {status.max_staleness}")
    for result in status.evals:
        interval = f"95% CI {result.ci_low:.1%}–{result.ci_high:.1%}, n={result.n_prompts}"
        table.add_row(f"eval v{result.version}", f"accuracy {result.accuracy:.1%} ({interval})")
    return table


async def watch(client: Client, run: str, poll_s: float = 1.0) -> WorkflowExecutionStatus:
    """Show the run's progress until its workflow closes; returns how it closed."""
    handle = await find_run(client, run)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("steps"), TimeElapsedColumn())
    task = progress.add_task(f"run {run}", total=None)
    table = Table.grid()
    with Live(table, console=console, refresh_per_second=4) as live:
        while True:
            described = await handle.describe()
            # a status the server leaves unspecified (None) is no close: keep watching
            if described.status is not None and described.status != WorkflowExecutionStatus.RUNNING:
                return described.status
            try:
                status = await handle.query(TrainingRunWorkflow.status)
            except RPCError:
                await asyncio.sleep(poll_s)  # between continue-as-new runs, or not started yet
                continue
            progress.update(task, total=status.steps, completed=status.step)
            grid = Table.grid()
            grid.add_row(progress)
            grid.add_row(status_table(status))
            live.update(grid)
            await asyncio.sleep(poll_s)
