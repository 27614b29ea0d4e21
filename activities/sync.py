"""The sync activity (queue `inference-<server>`): load a published version into this sidecar's
inference server, verified, and record the sync event with its timings."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path

from temporalio import activity

from activities.common import heartbeating, instrumented
from inference.admin import InferenceAdmin
from inference.client import InferenceClient
from observe.metrics import METRICS
from infra.inference import SERVED_MODEL_NAME
from rollout.context import RunContexts
from schemas.payloads import SyncInput, SyncResult
from storage.db import Database
from storage.object_store import DigestMismatch, ObjectStore
from storage.syncs import record_sync, version_row
from weights.sync import LoadedVersion, SyncOutcome, VersionToLoad, fetch, load_into_server


class SyncActivities:
    def __init__(self, db: Database, store: ObjectStore, contexts: RunContexts, server: str, url: str,
                 work_dir: Path) -> None:
        self.db = db
        self.store = store
        self.contexts = contexts
        self.server = server
        self.admin = InferenceAdmin(url)
        self.url = url
        self.work_dir = work_dir
        self.loaded: LoadedVersion | None = None
        self._lock = asyncio.Lock()  # one sync at a time per server

    @activity.defn(name="sync_weights")
    @instrumented("sync", "sync")
    async def sync_weights(self, inp: SyncInput) -> SyncResult:
        async with self._lock:
            return await heartbeating(self._sync(inp))

    async def _sync(self, inp: SyncInput) -> SyncResult:
        ctx = self.contexts.get(inp.run_id)
        started, t0 = datetime.now(UTC), time.monotonic()

        def lookup() -> VersionToLoad:
            with self.db.begin() as s:
                row = version_row(s, inp.run_id, inp.version)
                return VersionToLoad(inp.run_id, row.version, row.checkpoint_key, row.sha256, row.probe)

        target = await asyncio.to_thread(lookup)
        directory = self.work_dir / inp.run_id / f"v{inp.version:06d}"
        try:
            _, fetched = await asyncio.to_thread(fetch, self.store, target, directory)
            download_s = time.monotonic() - t0
            async with InferenceClient(self.url, SERVED_MODEL_NAME) as client:
                outcome = await load_into_server(
                    self.admin, client, target, directory, self.loaded, ctx.config.sync.pause_mode,
                    ctx.config.sync.verify_tolerance if ctx.config.sync.verify else None)
            outcome.bytes = fetched
            outcome.timings["download_s"] = download_s
        except DigestMismatch as exc:  # the server was never touched
            outcome = SyncOutcome(status="refused", error=str(exc))
        outcome.timings["total_s"] = time.monotonic() - t0
        if outcome.status == "ok":
            self.loaded = LoadedVersion(inp.version, directory)

        def write() -> None:
            with self.db.begin() as s:
                record_sync(s, run_id=inp.run_id, version=inp.version, server=self.server, status=outcome.status,
                            bytes=outcome.bytes, timings=outcome.timings,
                            probe_max_abs_diff=outcome.probe_max_abs_diff, greedy_match=outcome.greedy_match,
                            error=outcome.error,
                            started_at=started, finished_at=datetime.now(UTC))

        await asyncio.to_thread(write)
        METRICS.observe_sync(inp.run_id, self.server, inp.version, outcome.status,
                             {k.removesuffix("_s"): v for k, v in outcome.timings.items()})
        return SyncResult(self.server, inp.version, outcome.status, outcome.timings["total_s"], outcome.error)
