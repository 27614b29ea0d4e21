"""The grader worker: rewards for finished groups (grader queue), with its own concurrency."""

from __future__ import annotations

import httpx
from temporalio.worker import Worker

from activities.grading import GradingActivities
from graders.base import GraderDeps
from rollout.context import RunContexts
from sandbox.config import SandboxConfig
from sandbox.executor import SandboxExecutor
from sandbox.runner import Sandbox
from schemas.payloads import GRADER_QUEUE
from storage.db import Database
from workers.common import connect, endpoints, setup_logging, start_metrics


async def run_grader_worker(max_concurrent_groups: int = 32) -> None:
    log = setup_logging("grader")
    ep = endpoints()
    client = await connect(ep, start_metrics("grader", "grader", ("grader",)))
    db = Database(ep.database_url)
    async with Sandbox(SandboxConfig()) as sandbox, httpx.AsyncClient(timeout=120) as http:
        grading = GradingActivities(db, RunContexts(db), GraderDeps(executor=SandboxExecutor(sandbox), http_client=http))
        worker = Worker(client, task_queue=GRADER_QUEUE, activities=[grading.grade_group],
                        max_concurrent_activities=max_concurrent_groups)
        log.info("serving %s", GRADER_QUEUE)
        await worker.run()
