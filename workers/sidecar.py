"""The sync sidecar beside one inference server: loads published versions into it (queue
`inference-<server>`). Run one per server, on the server's machine when it is remote."""

from __future__ import annotations

from temporalio.worker import Worker

from activities.sync import SyncActivities
from infra.settings import load_settings
from rollout.context import RunContexts
from schemas.payloads import sync_queue
from storage.db import Database
from storage.object_store import ObjectStore
from workers.common import connect, endpoints, server_urls, setup_logging, start_metrics


async def run_sidecar_worker(server: str) -> None:
    log = setup_logging(f"sidecar-{server}")
    ep = endpoints()
    urls = server_urls(ep)
    if server not in urls:
        raise SystemExit(f"no inference server '{server}': the workers know {sorted(urls) or 'none'} "
                         "(INFERENCE_URLS or `rlpipe stack up --inference N`)")
    client = await connect(ep, start_metrics(f"sidecar-{server}", "sidecar", ("sync",), server))
    db = Database(ep.database_url)
    work_dir = load_settings().home.resolve() / f"sidecar-{server}"
    syncs = SyncActivities(db, ObjectStore.from_endpoints(ep), RunContexts(db), server, urls[server], work_dir)
    worker = Worker(client, task_queue=sync_queue(server), activities=[syncs.sync_weights])
    log.info("serving %s for %s", sync_queue(server), urls[server])
    await worker.run()
