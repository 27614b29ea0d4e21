"""The grader worker: rewards for finished groups, and held-out evaluations (grader queue)."""

from __future__ import annotations

import httpx
from temporalio.worker import Worker

from rlpipe.activities.evaluation import EvaluationActivities
from rlpipe.activities.grading import GradingActivities
from rlpipe.graders.base import GraderDeps
from rlpipe.inference.directory import ServerDirectory
from rlpipe.rollout.context import RunContexts
from rlpipe.sandbox.config import SandboxConfig
from rlpipe.sandbox.executor import SandboxExecutor
from rlpipe.sandbox.runner import Sandbox
from rlpipe.schemas.payloads import GRADER_QUEUE
from rlpipe.storage.db import Database
from rlpipe.workers.common import WORKER_CONNECT_WAIT_S, connect, endpoints, server_urls, setup_logging, start_metrics


async def run_grader_worker(max_concurrent_groups: int = 32) -> None:
    log = setup_logging("grader")
    ep = endpoints()
    client = await connect(ep, start_metrics("grader", "grader", ("grader",)), wait_s=WORKER_CONNECT_WAIT_S)
    db = Database(ep.database_url)
    async with Sandbox(SandboxConfig()) as sandbox, httpx.AsyncClient(timeout=120) as http:
        contexts, executor = RunContexts(db), SandboxExecutor(sandbox)
        deps = GraderDeps(executor=executor, http_client=http)
        grading = GradingActivities(db, contexts, deps)
        evaluation = EvaluationActivities(db, contexts, ServerDirectory(server_urls(ep), db), executor, deps)
        worker = Worker(client, task_queue=GRADER_QUEUE, activities=[grading.grade_group, evaluation.evaluate],
                        max_concurrent_activities=max_concurrent_groups)
        log.info("serving %s", GRADER_QUEUE)
        await worker.run()
