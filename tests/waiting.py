"""Waiting for a training run: the one helper the whole suite uses.

A run that pauses itself (every group failing, say) or fails can never return the result a test
waits for. Waiting on `handle.result()` alone then costs the whole timeout and ends in a bare
`TimeoutError`; `run_result` watches the run's status beside the result and fails the wait within
a poll interval, quoting the reason the run gives (the same text as `runs.status_reason`).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.service import RPCError

from rlpipe.cli.run_commands import failure_chain
from rlpipe.schemas.payloads import RunResult, RunStatus
from rlpipe.workflows.training_run import TrainingRunWorkflow

POLL_S = 1.0
UNTIL_TIMEOUT_S = 600.0

Condition = Callable[[], Any]
"""A check that returns something truthy when it holds, or an awaitable of it."""


class RunStalled(AssertionError):
    """The run paused or failed, so the result a test waits for cannot come."""


async def run_result(handle: WorkflowHandle, timeout_s: float, poll_s: float = POLL_S) -> RunResult:
    """The run's result; RunStalled as soon as it pauses or fails, TimeoutError (with its last
    status) only when it is still making progress at the deadline."""
    result = asyncio.ensure_future(handle.result())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    status: RunStatus | None = None
    try:
        while True:
            done, _ = await asyncio.wait({result}, timeout=poll_s)
            if done:
                return _finished(result, handle.id)
            status = await _status(handle) or status
            if status is not None and status.paused:
                raise RunStalled(f"run {status.run} paused at step {status.step}/{status.steps}: {status.pause_reason}")
            if loop.time() >= deadline:
                raise TimeoutError(f"run {handle.id} did not finish in {timeout_s:.0f} s; last status: {status}")
    finally:
        result.cancel()


def _finished(result: asyncio.Future[RunResult], workflow_id: str) -> RunResult:
    try:
        return result.result()
    except WorkflowFailureError as err:
        raise RunStalled(f"run {workflow_id} failed: {failure_chain(err)}") from err


async def _status(handle: WorkflowHandle) -> RunStatus | None:
    """The run's status, or None while nobody can answer the query (workers still starting)."""
    try:
        return await handle.query(TrainingRunWorkflow.status)
    except RPCError:
        return None


async def until(condition: Condition, what: str, timeout_s: float = UNTIL_TIMEOUT_S, interval_s: float = 0.2,
                explain: Callable[[], Awaitable[str]] | None = None) -> Any:
    """Poll `condition` until it returns something truthy, and return that; on timeout, fail
    naming `what`, with `explain()`'s account of the run."""
    deadline = time.monotonic() + timeout_s
    while not (value := await _value(condition)):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting until {what}" + (f"\n{await explain()}" if explain else ""))
        await asyncio.sleep(interval_s)
    return value


async def _value(condition: Condition) -> Any:
    result = condition()
    return await result if inspect.isawaitable(result) else result
