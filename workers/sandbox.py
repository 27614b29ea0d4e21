"""The sandbox worker: tool calls of agentic rollouts, each in an isolated process (sandbox queue)."""

from __future__ import annotations

from temporalio.worker import Worker

from rlpipe.activities.tools import ToolActivities
from rlpipe.rollout.context import RunContexts
from rlpipe.sandbox.config import SandboxConfig
from rlpipe.sandbox.executor import SandboxExecutor
from rlpipe.sandbox.runner import Sandbox
from rlpipe.schemas.payloads import SANDBOX_QUEUE
from rlpipe.storage.db import Database
from rlpipe.workers.common import WORKER_CONNECT_WAIT_S, connect, endpoints, setup_logging, start_metrics


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
