"""The sandbox worker: tool calls of agentic rollouts, each in an isolated process (sandbox queue)."""

from __future__ import annotations

from temporalio.worker import Worker

from activities.tools import ToolActivities
from rollout.context import RunContexts
from sandbox.config import SandboxConfig
from sandbox.executor import SandboxExecutor
from sandbox.runner import Sandbox
from schemas.payloads import SANDBOX_QUEUE
from storage.db import Database
from workers.common import WORKER_CONNECT_WAIT_S, connect, endpoints, setup_logging, start_metrics


async def run_sandbox_worker(max_concurrent_tools: int = 64) -> None:
    log = setup_logging("sandbox")
    ep = endpoints()
    client = await connect(ep, start_metrics("sandbox", "sandbox", ("sandbox",)), wait_s=WORKER_CONNECT_WAIT_S)
    db = Database(ep.database_url)
    async with Sandbox(SandboxConfig()) as sandbox:
        tools = ToolActivities(db, RunContexts(db), SandboxExecutor(sandbox))
        worker = Worker(client, task_queue=SANDBOX_QUEUE, activities=[tools.run_tool],
                        max_concurrent_activities=max_concurrent_tools)
        log.info("serving %s", SANDBOX_QUEUE)
        await worker.run()
