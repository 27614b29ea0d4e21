"""The trainer worker: holds the policy in memory and runs one train step at a time (trainer queue)."""

from __future__ import annotations

import os

from temporalio.worker import Worker

from rlpipe.activities.training import TrainingActivities
from rlpipe.infra.settings import load_settings
from rlpipe.observe.metrics import METRICS, start_db_refresh
from rlpipe.rollout.context import RunContexts
from rlpipe.schemas.payloads import TRAINER_QUEUE
from rlpipe.storage.db import Database
from rlpipe.storage.object_store import ObjectStore
from rlpipe.trainer.trainer import Trainer
from rlpipe.weights.stream import WeightStreamServer
from rlpipe.workers.common import WORKER_CONNECT_WAIT_S, connect, endpoints, setup_logging, start_metrics
from rlpipe.workers.ranks import ranks_from_env


def background_uploads() -> bool | None:
    """RLPIPE_BACKGROUND_UPLOADS: 1 uploads each version beside the next step, 0 inside its own;
    unset: beside it where the trainer has a GPU (trainer/trainer.py says why)."""
    value = os.environ.get("RLPIPE_BACKGROUND_UPLOADS", "").strip()
    if value not in ("", "0", "1"):
        raise SystemExit(f"RLPIPE_BACKGROUND_UPLOADS={value!r}: use 1 (beside the next step), 0 (inside the step) "
                         "or leave it unset (beside it on a GPU)")
    return None if value == "" else value == "1"


async def run_trainer_worker() -> None:
    log = setup_logging("trainer")
    ep = endpoints()
    client = await connect(ep, start_metrics("trainer", "trainer", ("trainer",)), wait_s=WORKER_CONNECT_WAIT_S)
    db = Database(ep.database_url)
    start_db_refresh(METRICS, db.begin)  # buffer depth, staleness and shares from Postgres
    ranks = ranks_from_env()
    if ranks is not None:
        log.info("data-parallel ranks are launched by torchrun over %d host(s), rendezvous at %s; on each other "
                 "host run: RLPIPE_TRAINER_RANKS=torchrun RLPIPE_TRAINER_NNODES=%d RLPIPE_TRAINER_RENDEZVOUS=%s "
                 "RLPIPE_TRAINER_CONTROLLER_PORT=%d rlpipe worker ranks --per-host <world_size / hosts>",
                 ranks.nnodes, ranks.rendezvous, ranks.nnodes, ranks.rendezvous, ranks.controller_port)
    settings = load_settings()
    # answers only the inference servers' engines, which the sidecars hand the servers' admin token
    stream = WeightStreamServer(settings.weight_stream_host or settings.host, settings.weight_stream_port,
                                token=ep.inference_token).start()
    trainer = Trainer(db, ObjectStore.from_endpoints(ep), RunContexts(db), settings.home.resolve() / "trainer",
                      background_uploads=background_uploads(), ranks=ranks, stream=stream)
    training = TrainingActivities(db, trainer)
    # one activity at a time: the model is a single in-memory state advanced step by step
    worker = Worker(client, task_queue=TRAINER_QUEUE, activities=[training.init_policy, training.train_step],
                    max_concurrent_activities=1)
    log.info("serving %s", TRAINER_QUEUE)
    try:
        await worker.run()
    finally:
        trainer.shutdown()  # the upload in flight, then the data-parallel ranks (they also exit if this process dies)
        stream.close()
