"""The rollout worker: hosts the TrainingRun and RolloutGroup workflows with their bookkeeping
activities (workflow queue), the generation activities (rollout queue), and the loop that feeds
runs' experiment trackers from Postgres (tracking/follow.py says why here)."""

from __future__ import annotations

import asyncio

from temporalio.worker import Worker

from rlpipe.activities.bookkeeping import BookkeepingActivities
from rlpipe.activities.rollout import RolloutActivities
from rlpipe.inference.directory import ServerDirectory
from rlpipe.rollout.context import RunContexts
from rlpipe.schemas.payloads import ROLLOUT_QUEUE, WORKFLOW_QUEUE
from rlpipe.storage.db import Database
from rlpipe.tracking.follow import TrackingLoop
from rlpipe.workers.common import (
    WORKER_CONNECT_WAIT_S,
    connect,
    endpoints,
    server_urls,
    setup_logging,
    start_metrics,
    workflow_runner,
)
from rlpipe.workflows.rollout_group import RolloutGroupWorkflow
from rlpipe.workflows.training_run import TrainingRunWorkflow


async def run_rollout_worker(max_concurrent_generations: int = 256) -> None:
    log = setup_logging("rollout")
    ep = endpoints()
    client = await connect(ep, start_metrics("rollout", "rollout", ("rollout", "persist")),
                           wait_s=WORKER_CONNECT_WAIT_S)
    db = Database(ep.database_url, pool_size=10)
    servers = ServerDirectory(server_urls(ep), db)
    bookkeeping = BookkeepingActivities(db, servers)
    rollouts = RolloutActivities(db, RunContexts(db), servers)
    orchestration = Worker(client, task_queue=WORKFLOW_QUEUE, workflow_runner=workflow_runner(),
                           workflows=[TrainingRunWorkflow, RolloutGroupWorkflow],
                           activities=[bookkeeping.register_run, bookkeeping.set_run_status,
                                       bookkeeping.record_failure, bookkeeping.record_rejected_run,
                                       bookkeeping.check_server])
    generation = Worker(client, task_queue=ROLLOUT_QUEUE,
                        activities=[rollouts.check_tasks, rollouts.start_group, rollouts.generate,
                                    rollouts.finish_group],
                        max_concurrent_activities=max_concurrent_generations)
    log.info("serving %s and %s with inference servers %s", WORKFLOW_QUEUE, ROLLOUT_QUEUE, servers.configured)
    await asyncio.gather(orchestration.run(), generation.run(), TrackingLoop(db).run())

