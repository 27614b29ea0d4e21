"""The sync activity (queue `inference-<server>`): load a published version into this sidecar's
inference server, verified and recorded (weights/sidecar.py does the work)."""

from __future__ import annotations

from temporalio import activity

from rlpipe.activities.common import heartbeating, instrumented
from rlpipe.activities.definitions import SYNC_WEIGHTS
from rlpipe.schemas.payloads import SyncInput, SyncResult
from rlpipe.storage.db import Database
from rlpipe.weights.sidecar import Sidecar


class SyncActivities:
    def __init__(self, db: Database, sidecar: Sidecar) -> None:
        self.db = db  # `instrumented` records failures and spans through it
        self.sidecar = sidecar

    @activity.defn(name=SYNC_WEIGHTS.name)
    @instrumented("sync", "sync")
    async def sync_weights(self, inp: SyncInput) -> SyncResult:
        outcome = await heartbeating(self.sidecar.sync(inp.run_id, inp.version))
        return SyncResult(self.sidecar.server, inp.version, outcome.status, outcome.timings.get("total_s", 0.0),
                          outcome.error)
