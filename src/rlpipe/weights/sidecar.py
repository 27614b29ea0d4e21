"""The sync sidecar's state machine for one inference server.

It owns two promises about its server:

1. Syncs are verified and recorded (`sync`): with `sync.transport: stream` the server's own
   weight-transfer engine pulls the version from the trainer (weights/stream.py) while it serves
   and loads it while paused, no file involved; otherwise, or when the trainer no longer serves
   the version, the checkpoint is fetched (sha256-checked, or read from the trainer's directory
   when the two share a filesystem) before the server is paused;
   a bad checkpoint is refused untouched; a load that fails or does not match the trainer's
   probe goes back to the previous weights; each attempt is a `sync_events` row (a failed one
   also a `failures` row) and a metrics observation.
2. The server holds a verified version or says it does not (`check`, run by `watch` every few
   seconds and at start): when the server's label is not what the sidecar last verified — a
   restarted server answers "default" — the server is reported unknown and the latest published
   version of the run it serves is loaded, verified, and reported. Rollouts reject every
   label that is not a published version (weights/labels.py), so nothing is sampled from the
   restarted server's start-up weights meanwhile.

One lock serialises syncs, checks and restores: the server's label changes only under it.
Versions on a server only move forward: a sync of a version older than the one held is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from rlpipe.inference.admin import InferenceAdmin
from rlpipe.inference.client import InferenceClient, InferenceError, ServerUnavailableError
from rlpipe.observe.metrics import METRICS
from rlpipe.policy.checkpoint import WEIGHTS_FILE
from rlpipe.schemas.config import SyncConfig
from rlpipe.storage import syncs
from rlpipe.storage.db import Database
from rlpipe.storage.digest import sha256_file
from rlpipe.storage.object_store import DigestMismatch, ObjectStore
from rlpipe.storage.runs import load_run_config, record_failure
from rlpipe.weights.checkpoints import download_checkpoint, local_version_dir, wait_for_manifest
from rlpipe.weights.labels import published_label, published_version, verifying_label
from rlpipe.weights.retention import forget_deleted
from rlpipe.weights.stream import StreamSource, offered
from rlpipe.weights.sync import Source, SyncOutcome, SyncPlan, Weights, load_into_server
from rlpipe.weights.tolerance import UnmeasuredDtype, probe_tolerance

log = logging.getLogger("rlpipe.sidecar")

StateListener = Callable[[str, int | None], Awaitable[None]]
"""(run, version or None): called when the server's verified version becomes unknown (None: it
went down, or holds unverified weights) and when a restore has verified one."""
DEFAULT_LABEL = "default"
FAILURE_TYPES = {"refused": "CheckpointRefused", "rolled_back": "ProbeMismatch", "failed": "ReloadFailed"}
UPLOAD_WAIT_S = 300.0
"""How long a load waits for a version's manifest in S3: the trainer uploads a version beside its next
step, so a sidecar that does not share the trainer's files may be asked for it before it is there."""
"""`failures.error_type` of each failed sync status."""


@dataclass(frozen=True)
class Published:
    """A published version as the sidecar needs it (a `policy_versions` row)."""

    run_id: str
    version: int
    checkpoint_key: str
    sha256: str
    probe: dict | None
    deleted: bool = False
    """The run's retention policy deleted its bytes."""
    stream_endpoint: str | None = None
    """The trainer's weight stream that served the version when it was published."""


class Sidecar:
    def __init__(self, db: Database, store: ObjectStore, server: str, url: str, work_dir: Path, *,
                 model_name: str, admin_token: str | None, shared_dir: Path | None = None,
                 on_state: StateListener | None = None) -> None:
        self.db = db
        self.store = store
        self.server = server
        self.url = url
        self.model_name = model_name
        self.work_dir = work_dir
        """Checkpoints fetched from S3 land in work_dir/<run>/v<version>."""
        self.shared_dir = shared_dir
        """The trainer's published checkpoints (same layout), when this machine shares its filesystem."""
        self.on_state = on_state
        self.admin = InferenceAdmin(url, token=admin_token)
        self.admin_token = admin_token
        """Also the token the trainer's weight stream asks the server's engine for."""
        self.held: Weights | None = None
        """The verified weights the server holds (None: unknown, or not a published version)."""
        self.reachable = True
        self._lock = asyncio.Lock()
        self._configs: dict[str, SyncConfig] = {}

    # -- entry points -------------------------------------------------------------------------------
    async def sync(self, run_id: str, version: int) -> SyncOutcome:
        """Load `version` of `run_id` into the server, verified (a retried call changes nothing)."""
        async with self._lock:
            return await self._sync(run_id, version)

    async def check(self) -> SyncOutcome | None:
        """Make sure the server holds what the sidecar verified; restore the latest published
        version if it does not (returns that restore's outcome, or None when nothing was done).
        While a sync holds the server, only its death is checked for: the run then moves the
        server's groups at once instead of when the sync's retries give up."""
        if self._lock.locked():
            if self.reachable and not await self.admin.healthy():
                await self._unreachable()
            return None
        async with self._lock:
            try:
                if await self._current() is not None:
                    self.reachable = True
                    return None
            except ServerUnavailableError:
                if self.reachable:
                    await self._unreachable()
                return None
            self.reachable = True
            return await self._restore()

    async def watch(self, every_s: float = 2.0) -> None:
        """`check` now and every `every_s` seconds, forever (the sidecar worker runs it beside
        its activity worker)."""
        while True:
            try:
                await self.check()
            except Exception:  # noqa: BLE001 - a failed restore is retried at the next check
                log.exception("checking server %s failed", self.server)
            await asyncio.sleep(every_s)

    async def aclose(self) -> None:
        await self.admin.aclose()

    # -- syncing ------------------------------------------------------------------------------------
    async def _sync(self, run_id: str, version: int) -> SyncOutcome:
        target = await asyncio.to_thread(self._published, run_id, version)
        held = await self._current()
        if held is not None and held.run_id == run_id and held.version is not None and held.version >= version:
            if held.version > version:  # a retry after a restore: close this load's row (the history says it completed)
                await asyncio.to_thread(self._record_superseded, run_id, version, held.version)
            return SyncOutcome(status="ok", error=f"skipped: server {self.server} already holds version {held.version}")
        config = await asyncio.to_thread(self._config, run_id)
        attempt = _Attempt(self, target)
        if target.deleted:  # a late load of an old version: the workflow's next one is the newest
            outcome = SyncOutcome(status="refused", error=f"version {version} of run {run_id} was deleted by the "
                                                          "run's retention policy; the server was not touched")
            await attempt.record(outcome)
            return self._observed(target, outcome)
        label = verifying_label(version, attempt.started_at) if config.verify else published_label(version)
        source: Source
        streamed = await self._streamed(target, config)
        if streamed is not None:
            source, attempt.transport = streamed, "stream"
        else:
            try:
                source, attempt.bytes, attempt.download_s = await asyncio.to_thread(self._fetch, target)
            except DigestMismatch as exc:  # the server was never touched
                outcome = SyncOutcome(status="refused", error=f"refused before pausing the server: {exc}")
                await attempt.record(outcome)
                return self._observed(target, outcome)
            attempt.transport = "file"
        try:
            tolerance = await self._tolerance(config) if config.verify else None
            previous = await self._rollback_target(held, run_id)
            plan = SyncPlan(version, source, target.probe, label, previous, config.pause_mode, tolerance)
            async with InferenceClient(self.url, self.model_name) as client:
                outcome = await load_into_server(self.admin, client, plan, attempt.record)
        except UnmeasuredDtype as exc:  # the run must name a bound: every retry would meet the same server
            refused = SyncOutcome(status="refused", error=f"refused before pausing the server: {exc}")
            await attempt.record(refused)
            return self._observed(target, refused)
        except InferenceError as exc:
            self.held = None
            failed = SyncOutcome(status="failed",
                                 error=f"sync of version {version} on server {self.server} broke off: {exc}")
            await attempt.record(failed)
            self._observed(target, failed)
            raise
        await attempt.finish()
        if outcome.status == "ok":
            self.held = Weights(published_label(version), source, run_id, version, target.probe)
            await asyncio.to_thread(self._forget_deleted, run_id)
        else:
            self.held = previous if previous.version is not None else None
        return self._observed(target, outcome)

    def _fetch(self, target: Published) -> tuple[Path, int, float]:
        """(directory with the version's files, bytes downloaded, seconds): the trainer's own
        directory when it is shared and intact, else a download from S3 checked file by file.
        Raises DigestMismatch when the published bytes are not what the version recorded."""
        t0 = time.monotonic()
        shared = self._shared_copy(target)
        if shared is not None:
            return shared, 0, time.monotonic() - t0
        manifest = wait_for_manifest(self.store, target.checkpoint_key, UPLOAD_WAIT_S)
        if manifest.weights.sha256 != target.sha256:
            raise DigestMismatch(f"the manifest of version {target.version} names weights {manifest.weights.sha256}, "
                                 f"but the version was published with {target.sha256}")
        directory = local_version_dir(self.work_dir, target.run_id, target.version)
        fetched = download_checkpoint(self.store, manifest, directory)
        return directory, fetched, time.monotonic() - t0

    async def _streamed(self, target: Published, config: SyncConfig) -> StreamSource | None:
        """The trainer's stream of the version, when the run syncs by stream, the trainer still serves
        it (a restarted trainer, or a version retention deleted, does not) and the server runs the
        stream's engine; otherwise None, and the file path loads the durable copy."""
        if config.transport != "stream" or target.stream_endpoint is None:
            return None
        source = StreamSource(target.stream_endpoint, target.run_id, target.version, self.admin_token)
        why_not = await asyncio.to_thread(offered, source)
        if why_not is None and not await self.admin.streams_weights():
            why_not = "the server was started without the weight stream's engine (--weight-transfer-config)"
        if why_not is None:
            return source
        log.warning("%s v%d cannot be streamed to server %s (%s): loading its durable copy", target.run_id,
                    target.version, self.server, why_not)
        return None

    def _shared_copy(self, target: Published) -> Path | None:
        if self.shared_dir is None:
            return None
        directory = local_version_dir(self.shared_dir, target.run_id, target.version)
        weights = directory / WEIGHTS_FILE
        if weights.exists() and sha256_file(weights) == target.sha256:
            return directory
        log.warning("the trainer's copy of %s v%d at %s is missing or altered: downloading it from S3",
                    target.run_id, target.version, directory)
        return None

    async def _rollback_target(self, held: Weights | None, run_id: str) -> Weights:
        """What a failed load goes back to: the verified weights held, if they are this run's
        (fetched again when this machine lost them: a restarted sidecar), else the server's
        start-up weights, labelled "default". Another run's version would carry a label that
        this run's rollouts would take for one of its own versions."""
        if held is None or held.run_id != run_id or held.version is None:
            return Weights(DEFAULT_LABEL, await self.admin.served_model_dir())
        if held.probe is not None and await asyncio.to_thread(_available, held.source):
            return held
        published = await asyncio.to_thread(self._published, run_id, held.version)
        directory, _, _ = await asyncio.to_thread(self._fetch, published)
        return Weights(held.label, directory, run_id, held.version, published.probe)

    # -- what the server holds ----------------------------------------------------------------------
    async def _current(self) -> Weights | None:
        """The verified weights the server holds now, judged by its label: what this sidecar
        loaded, or (after a sidecar restart) the version the database says it verified last.
        Raises ServerUnavailableError when the server does not answer."""
        label = await self.admin.weight_version()
        if self.held is not None and self.held.label == label:
            return self.held
        self.held = None
        version = published_version(label)
        verified = await asyncio.to_thread(self._last_verified)
        if version is not None and verified is not None and verified.version == version:
            directory = local_version_dir(self.work_dir, verified.run_id, version)
            self.held = Weights(label, directory, verified.run_id, version)
        return self.held

    async def _restore(self) -> SyncOutcome | None:
        """Load the latest published version of the run this server serves (if any)."""
        run_id = await asyncio.to_thread(self._served_run)
        if run_id is None:
            return None
        latest = await asyncio.to_thread(self._latest, run_id)
        if latest is None:
            return None
        log.warning("server %s does not hold a verified version (label %r): restoring %s v%d", self.server,
                    await self.admin.weight_version(), run_id, latest)
        await self._notify(run_id, None)
        outcome = await self._sync(run_id, latest)
        if outcome.status == "ok":
            await self._notify(run_id, latest)
        return outcome

    async def _unreachable(self) -> None:
        """The server stopped answering: tell the run it serves, which routes no group to it."""
        self.reachable = False
        log.warning("server %s at %s is unreachable", self.server, self.url)
        run_id = await asyncio.to_thread(self._served_run)
        if run_id is not None:
            await self._notify(run_id, None)

    async def _notify(self, run_id: str, version: int | None) -> None:
        if self.on_state is None:
            return
        try:
            await self.on_state(run_id, version)
        except Exception:  # noqa: BLE001 - the run learns it at the next sync; the labels keep rollouts safe
            log.exception("could not tell run %s that server %s holds %s", run_id, self.server, version)

    # -- records ------------------------------------------------------------------------------------
    def _observed(self, target: Published, outcome: SyncOutcome) -> SyncOutcome:
        METRICS.observe_sync(target.run_id, self.server, target.version, outcome.status,
                             {k.removesuffix("_s"): v for k, v in outcome.timings.items()})
        return outcome

    def _published(self, run_id: str, version: int) -> Published:
        with self.db.begin() as s:
            row = syncs.version_row(s, run_id, version)
            return Published(run_id, row.version, row.checkpoint_key, row.sha256, row.probe, row.deleted_at is not None,
                             row.stream_endpoint)

    def _forget_deleted(self, run_id: str) -> None:
        """Remove this machine's downloads of the run's versions that retention deleted (the
        trainer's shared directory is the trainer's to clean)."""
        forget_deleted(self.db, self.work_dir, run_id)

    def _config(self, run_id: str) -> SyncConfig:
        if run_id not in self._configs:
            with self.db.begin() as s:
                self._configs[run_id] = load_run_config(s, run_id).sync
        return self._configs[run_id]

    async def _tolerance(self, config: SyncConfig) -> float:
        """The run's sync.verify_tolerance, or the one this server's dtype calls for."""
        if config.verify_tolerance is not None:
            return config.verify_tolerance
        return probe_tolerance(await self.admin.served_dtype())

    def _record_superseded(self, run_id: str, version: int, held: int) -> None:
        with self.db.begin() as s:
            syncs.record_superseded(s, run_id, version, self.server, held, datetime.now(UTC))

    def _last_verified(self) -> syncs.Verified | None:
        with self.db.begin() as s:
            return syncs.last_verified(s, self.server)

    def _served_run(self) -> str | None:
        with self.db.begin() as s:
            return syncs.served_run(s, self.server)

    def _latest(self, run_id: str) -> int | None:
        with self.db.begin() as s:
            return syncs.latest_version(s, run_id)


class _Attempt:
    """One sync attempt's bookkeeping: its start (which also names its verifying label), the
    transfer it did, and its sync_events row."""

    def __init__(self, sidecar: Sidecar, target: Published) -> None:
        self.sidecar = sidecar
        self.target = target
        self.started_at = datetime.now(UTC)
        self.t0 = time.monotonic()
        self.bytes = 0
        self.download_s: float | None = None
        self.transport: str | None = None

    async def record(self, outcome: SyncOutcome) -> None:
        """Write the outcome (the verdict, for a load) with the transfer's numbers."""
        outcome.bytes = self.bytes
        if self.download_s is not None:
            outcome.timings["download_s"] = self.download_s
        outcome.timings["total_s"] = time.monotonic() - self.t0
        await asyncio.to_thread(self._write, outcome)

    def _write(self, outcome: SyncOutcome) -> None:
        """The attempt's sync_events row, and a failures row (with the numbers) if it failed."""
        server, target = self.sidecar.server, self.target
        record = syncs.SyncRecord(target.run_id, target.version, server, outcome.status, outcome.bytes,
                                  dict(outcome.timings), outcome.probe_max_abs_diff, outcome.probe_tolerance,
                                  outcome.greedy_match, outcome.error, self.started_at, datetime.now(UTC),
                                  self.transport)
        with self.sidecar.db.begin() as s:
            attempt = syncs.record_sync(s, record)
            if outcome.status == "ok":
                return
            record_failure(s, run_id=target.run_id, kind="sync", error_type=FAILURE_TYPES[outcome.status],
                           message=outcome.error or outcome.status, activity="sync_weights",
                           workflow_id=syncs.run_workflow_id(s, target.run_id),
                           activity_id=sync_failure_id(server, target.version), attempt=attempt,
                           details={"server": server, "version": target.version,
                                    "probe_max_abs_diff": outcome.probe_max_abs_diff,
                                    "probe_tolerance": outcome.probe_tolerance,
                                    "greedy_match": outcome.greedy_match, **outcome.timings})

    async def finish(self) -> None:
        """Stretch the recorded row to the attempt's end (a rollback, the final label)."""

        def write() -> None:
            with self.sidecar.db.begin() as s:
                syncs.finish_sync(s, self.target.run_id, self.target.version, self.sidecar.server,
                                  time.monotonic() - self.t0, datetime.now(UTC))

        await asyncio.to_thread(write)


def _available(source: Source) -> bool:
    """Can the server load `source` now (a rollback's weights are checked before the pause)?"""
    return source.exists() if isinstance(source, Path) else offered(source) is None


def sync_failure_id(server: str, version: int) -> str:
    """The `failures.activity_id` of a failed sync: the workflow records its own failure of the
    same sync under this id, so the two land on one row."""
    return f"sync-{server}-v{version}"
