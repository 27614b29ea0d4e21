"""The sync sidecar beside one inference server: loads published versions into it (queue
`inference-<server>`) and watches that it keeps holding one. Run one per server, on the
server's machine when it is remote.

RLPIPE_SHARED_CHECKPOINTS=DIR: the trainer's published checkpoints (`<DIR>/<run>/v<version>`)
are readable here — the trainer and this server share a filesystem — so syncs reload from
there (sha256-checked) instead of downloading from S3. Unset: always S3.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import Worker

from rlpipe.activities.sync import SyncActivities
from rlpipe.inference.directory import announce
from rlpipe.infra.inference import SERVED_MODEL_NAME
from rlpipe.infra.settings import load_settings, named_urls
from rlpipe.schemas.payloads import ServerState, sync_queue
from rlpipe.storage.db import Database
from rlpipe.storage.object_store import ObjectStore
from rlpipe.storage.syncs import run_workflow_id
from rlpipe.weights.sidecar import Sidecar, StateListener
from rlpipe.workers.common import WORKER_CONNECT_WAIT_S, connect, endpoints, server_urls, setup_logging, start_metrics
from rlpipe.workflows.training_run import SERVER_STATE_SIGNAL

SHARED_CHECKPOINTS_ENV = "RLPIPE_SHARED_CHECKPOINTS"


async def run_sidecar_worker(server: str, url: str | None = None) -> None:
    """Serve `server`'s sync queue; `url` names a server that is not configured (INFERENCE_URLS),
    e.g. one that will join running runs."""
    log = setup_logging(f"sidecar-{server}")
    ep = endpoints()
    urls = server_urls(ep)
    if url is not None:
        try:
            urls = {**urls, **named_urls([f"{server}={url}"])}
        except ValueError as exc:
            raise SystemExit(f"sidecar --server/--url: {exc}") from exc
    if server not in urls:
        raise SystemExit(f"no inference server '{server}': the workers know {sorted(urls) or 'none'} "
                         "(INFERENCE_URLS, `rlpipe stack up --inference N`, or give its --url)")
    client = await connect(ep, start_metrics(f"sidecar-{server}", "sidecar", ("sync",), server),
                           wait_s=WORKER_CONNECT_WAIT_S)
    db = Database(ep.database_url)
    shared = os.environ.get(SHARED_CHECKPOINTS_ENV)
    sidecar = Sidecar(db, ObjectStore.from_endpoints(ep), server, urls[server],
                      load_settings().home.resolve() / f"sidecar-{server}", model_name=SERVED_MODEL_NAME,
                      admin_token=ep.inference_token,
                      shared_dir=Path(shared).resolve() if shared else None,
                      on_state=_signal_run(client, db, server))
    worker = Worker(client, task_queue=sync_queue(server), activities=[SyncActivities(db, sidecar).sync_weights])
    log.info("serving %s for %s (checkpoints from %s)", sync_queue(server), urls[server], shared or "S3")
    await asyncio.gather(worker.run(), sidecar.watch(), announce(db, server, urls[server]))


def _signal_run(client: Client, db: Database, server: str) -> StateListener:
    """Tell a run's workflow what this server verifiably holds, so that it routes rollouts only
    to servers on a known version."""

    async def signal(run_id: str, version: int | None) -> None:
        def workflow_id() -> str:
            with db.begin() as s:
                return run_workflow_id(s, run_id)

        handle = client.get_workflow_handle(await asyncio.to_thread(workflow_id))
        await handle.signal(SERVER_STATE_SIGNAL, ServerState(server, version))

    return signal
