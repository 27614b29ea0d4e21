"""The trainer: one run's policy, advanced one committed step at a time.

    train_step(s):  committed already?  -> return the recorded result (a retried activity)
                    claim the batch of step s in Postgres (fresh groups, stale ones dropped; a
                      retry gets the same groups back)
                    bring the policy to step s - 1 (restore + replay after a restart or a failure)
                    one optimiser step on the engine (this process or data-parallel ranks: engine.py)
                    publish a checkpoint if asked: save + hash + probe logprobs here, the upload
                      to S3 (weights + optimizer state) in the background, beside the next step
                    wait for the previous version's upload (never commit past an undurable version)
                    commit: train_steps row (+ policy_versions row) in one transaction
                    after a publish, the run's retention pass (weights/retention.py) on the upload thread

Exact recovery. Publishing version v after step k stores the weights (what inference servers load)
and, every `sync.recovery_state_every` steps, the recovery state after step k beside them: the fp32
weights and the optimizer state, each rank writing its own shards (rl/train_state.py; read only by
recovery, and at any world size). A trainer whose memory does not hold step s - 1 (a new
process, another run, a failed step) loads the newest version with trained_steps <= s - 1 whose
optimizer state is stored (or the base, version 0) and replays steps k + 1 .. s - 1 on their recorded
batches (`claimed_trajectories`: the groups each committed step claimed; a replay claims nothing).
A step's batch, plan and seed are pure functions of what Postgres holds, so the replay redoes the
same arithmetic and the parameters equal those of a trainer that never stopped.

Uploads off the critical path (on by default where the trainer computes on a GPU). A published
version is saved into this machine's cache, hashed and probed, committed, and uploaded by a
background thread while the next step computes; a sidecar on
this filesystem loads it from the cache at once, any other waits for its manifest. The next step
commits only once that upload has ended (retried once in the foreground if it failed), and the
run's last step uploads before it returns. A trainer that died with an upload in flight leaves a
committed version without a manifest: the next restore uploads it from the cache, or, on a machine
without it, re-creates it by the same exact replay and checks its sha256 against the committed one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import torch

from rlpipe.policy.checkpoint import WEIGHTS_FILE, save_checkpoint
from rlpipe.rl.batching import plan_updates
from rlpipe.rl.torchrun import TorchrunRanks
from rlpipe.rollout.context import RunContext, RunContexts
from rlpipe.schemas.config import RetentionConfig
from rlpipe.schemas.payloads import PublishedVersion, StepSummary, TrainStepInput
from rlpipe.schemas.tables import PolicyVersion, TrainStep
from rlpipe.storage import buffer
from rlpipe.storage.db import Database
from rlpipe.storage.object_store import ObjectStore
from rlpipe.storage.runs import record_failure
from rlpipe.trainer.engine import Engine, EngineSpec, load_policy, open_engine, step_seed
from rlpipe.trainer.probe import make_probe, probe_ids
from rlpipe.trainer.samples import batch_metrics, staleness, to_samples, trajectory_metrics
from rlpipe.weights.checkpoints import (
    Manifest,
    describe_checkpoint,
    download_checkpoint,
    download_train_state,
    load_manifest,
    local_version_dir,
    manifest_key,
    recovery_base,
    stored_train_states,
    stored_versions,
    train_state_key,
    upload_described,
    upload_train_state,
)
from rlpipe.weights.retention import forget_deleted, prune_run
from rlpipe.weights.stream import WeightStreamServer


@dataclasses.dataclass(frozen=True)
class TrainState:
    """A recovery state as runs stored it before states were written per rank (`train_state_key`:
    one torch.save dict); read to restore those runs."""

    optimizer: dict[str, Any]
    master_weights: dict[str, torch.Tensor] | None = None
    """The fp32 weights, when the published ones are rounded to a smaller dtype."""

    @classmethod
    def read(cls, stored: dict[str, Any]) -> TrainState:
        """The state from what torch.load returns; states stored before master weights could travel
        with it are the optimizer state alone."""
        return cls(**stored) if "optimizer" in stored else cls(stored)


log = logging.getLogger("rlpipe.trainer")
Heartbeat = Callable[[], None]


class Trainer:
    """Holds one run's policy and optimizer (through an `Engine`); a trainer worker has one and
    runs one activity at a time."""

    def __init__(self, db: Database, store: ObjectStore, contexts: RunContexts, work_dir: Path, *,
                 background_uploads: bool | None = None, ranks: TorchrunRanks | None = None,
                 stream: WeightStreamServer | None = None) -> None:
        self.db = db
        self.store = store
        self.contexts = contexts
        self.work_dir = work_dir
        work_dir.mkdir(parents=True, exist_ok=True)  # checkpoints cached for restores, temporary files
        self.engine: Engine | None = None
        self.run_id: str | None = None
        self.applied_step = -1
        """The last step of `run_id` whose update the engine holds (-1: no engine)."""
        self.background_uploads = torch.cuda.is_available() if background_uploads is None else background_uploads
        """Upload beside the next step. By default only where the trainer computes on a GPU: on a CPU
        trainer the upload takes the very cores the next step needs, and measured on 2 cores with a
        local S3 it made a SmolLM2 step ~10 % slower, not faster (BENCHMARKS.md, section 4b)."""
        self.uploader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlpipe-upload",
                                           initializer=_yield_the_cores)
        self.upload: tuple[Future[None], Callable[[], None]] | None = None
        """The background upload of the newest version published here (and the job, to run it again)."""
        self.pruning: Future[None] | None = None
        """The retention pass after the newest commit (on the upload thread, after that upload)."""
        self.ranks = ranks
        """Where data-parallel ranks run when launched by torchrun (several hosts); None: forked here."""
        self.stream = stream
        """Serves each version published here to the servers' weight-transfer engines (the sync's hot
        path, for runs with sync.transport "stream"); None: servers load files only."""

    # -- entry points ---------------------------------------------------------------------------
    def init_policy(self, run_id: str) -> PublishedVersion:
        """Publish the base model as version 0 (once per run)."""
        existing = self._version_row(run_id, 0)
        if existing is not None:
            return _published(existing)
        ctx = self.contexts.get(run_id)
        self._open(ctx, ctx.model_dir, optimizer_state=None, step=0)
        manifest, probe = self._publish(ctx, version=0, trained_steps=0)
        with self.db.begin() as s:
            s.add(self._version_row_of(manifest, probe))
        return PublishedVersion(0, 0, manifest_key(run_id, 0), manifest.weights.sha256)

    def train_step(self, inp: TrainStepInput, heartbeat: Heartbeat = lambda: None) -> StepSummary:
        """Run and commit step `inp.step`; `heartbeat` is called between units of work (replayed
        steps, the step itself) so a long restore shows progress."""
        committed = self._committed(inp.run_id, inp.step)
        if committed is not None:
            return committed
        ctx = self.contexts.get(inp.run_id)
        started = datetime.now(UTC)
        timings: dict[str, float] = {}
        # claim first: a step retried for NotEnoughFreshGroups leaves the engine as it was
        with timed(timings, "claim_s"), self.db.begin() as s:
            claim = buffer.claim_batch(s, run_id=inp.run_id, step=inp.step, groups_per_step=inp.groups_per_step,
                                       min_trained_steps=inp.min_trained_steps)
        try:
            with timed(timings, "restore_s"):
                restored = self._bring_to(ctx, inp.step - 1, heartbeat)
            with timed(timings, "train_s"):
                metrics = self._apply(ctx, inp.step, timings)
            heartbeat()
            published = None
            if inp.publish:
                with timed(timings, "publish_s"):
                    # the last step uploads before it returns: nothing follows to hide it behind; a run
                    # whose servers stream the weights from here never waits for S3 before it publishes
                    beside = self.background_uploads or ctx.config.sync.transport == "stream"
                    published = self._publish(ctx, version=inp.policy_version + 1, trained_steps=inp.step,
                                              timings=timings, background=beside and inp.step < ctx.config.steps)
            else:
                with timed(timings, "upload_wait_s"):
                    self._finish_upload()
            summary = self._commit(inp, claim, metrics | restored | timings, started, published)
        except BaseException:
            self.close()  # the engine may be mid-step or past the committed state: the retry restores
            raise
        if published is not None and ctx.config.retention.keep_last is not None:
            self.pruning = self.uploader.submit(self._prune, inp.run_id, ctx.config.retention)
        return summary

    def close(self) -> None:
        """Stop the engine (and its data-parallel ranks); the next step restores from the store. An
        upload in flight goes on (the restore waits for it)."""
        if self.engine is not None:
            self.engine.close()
        self.engine, self.run_id, self.applied_step = None, None, -1

    def shutdown(self) -> None:
        """The worker is stopping: let the upload in flight end (a failure is left to the next
        trainer's restore, which finds the version missing), then close."""
        try:
            self._finish_upload()
        except Exception:  # noqa: BLE001 - a committed version without its upload is repaired by a restore
            log.warning("the last upload failed; the next trainer re-creates that version", exc_info=True)
        self.uploader.shutdown()
        self.close()

    # -- state --------------------------------------------------------------------------------------
    def _bring_to(self, ctx: RunContext, step: int, heartbeat: Heartbeat) -> dict[str, float]:
        """Make the engine hold the result of the run's first `step` committed steps; returns the
        restore's metrics (empty when it already did)."""
        run_id = ctx.config.name
        if self.engine is not None and self.run_id == run_id and self.applied_step == step:
            return {}
        try:
            self._finish_upload()
        except Exception:  # noqa: BLE001 - the version it lacks is found and re-created below
            log.warning("the upload of the last version published here failed; re-creating it", exc_info=True)
        self.wait_for_pruning()  # what it deleted is no longer a restore base
        lost = self._lost_versions(ctx, step)
        base = self._restore_base(run_id, min([step, *(v.trained_steps - 1 for v in lost.values())]))
        log.info("restoring run %s: version %d (step %d), replaying steps %d..%d%s", run_id, base.version,
                 base.trained_steps, base.trained_steps + 1, step,
                 f", re-creating lost version(s) {sorted(v.version for v in lost.values())}" if lost else "")
        if base.trained_steps == 0:  # the base model itself: a rounded version 0 is not what step 1 started from
            self._open(ctx, ctx.model_dir, None, 0)
        else:
            with tempfile.TemporaryDirectory(dir=self.work_dir) as tmp:   # the engine reads it once
                state_dir = Path(tmp) / "train-state"
                if download_train_state(self.store, run_id, base.trained_steps, state_dir):
                    # the state's fp32 weights and optimizer replace the base model's weights
                    self._open(ctx, ctx.model_dir, None, base.trained_steps, train_state_dir=state_dir)
                else:
                    self._open_legacy_state(ctx, base, Path(tmp))
        for replay in range(base.trained_steps + 1, step + 1):
            self._apply(ctx, replay)
            if replay in lost:
                self._publish(ctx, lost[replay].version, replay, expect_sha256=lost[replay].sha256)
            heartbeat()
        return {"restored_version": float(base.version), "replayed_steps": float(step - base.trained_steps),
                "recreated_versions": float(len(lost))}

    def _lost_versions(self, ctx: RunContext, step: int) -> dict[int, PolicyVersion]:
        """Committed versions trained for at most `step` steps whose upload never finished (a trainer
        died with it in flight), by trained steps. Those whose files this machine still has are
        uploaded now; the others are returned, to be re-created by the replay."""
        run_id = ctx.config.name
        durable = stored_versions(self.store, run_id)
        with self.db.begin() as s:
            missing = s.scalars(sa.select(PolicyVersion).where(PolicyVersion.run_id == run_id,
                                                               PolicyVersion.trained_steps <= step,
                                                               PolicyVersion.deleted_at.is_(None),
                                                               PolicyVersion.version.not_in(durable))
                                .order_by(PolicyVersion.version)).all()
        lost = {}
        for row in missing:
            cached = local_version_dir(self.work_dir, run_id, row.version)
            manifest = describe_checkpoint(run_id, row.version, row.trained_steps, cached) \
                if (cached / WEIGHTS_FILE).exists() else None
            if manifest is not None and manifest.weights.sha256 == row.sha256:
                log.info("uploading version %d of run %s from this machine's copy (its upload never finished)",
                         row.version, run_id)
                upload_described(self.store, manifest, cached)
                self._serve_again(run_id, row.version, cached)
            else:
                lost[row.trained_steps] = row
        return lost

    def _serve_again(self, run_id: str, version: int, directory: Path) -> None:
        """A committed version this trainer holds again after a restart (its bytes checked against the
        committed sha256): the servers stream it from here, so its row names this trainer's stream
        rather than the one that died with the trainer that made it."""
        if self.stream is None:
            return
        self.stream.offer(run_id, version, directory)
        with self.db.begin() as s:
            s.execute(sa.update(PolicyVersion).where(PolicyVersion.run_id == run_id, PolicyVersion.version == version)
                      .values(stream_endpoint=self.stream.endpoint))

    def _open_legacy_state(self, ctx: RunContext, base: PolicyVersion, tmp: Path) -> None:
        """Restore from a recovery state stored as one file (runs from before per-rank states)."""
        run_id = ctx.config.name
        self.store.get_file(train_state_key(run_id, base.trained_steps), tmp / "train-state.pt")
        state = TrainState.read(torch.load(tmp / "train-state.pt", weights_only=True))
        if state.master_weights is None:  # the published weights are the master weights
            directory = local_version_dir(self.work_dir, run_id, base.version)
            download_checkpoint(self.store, load_manifest(self.store, base.checkpoint_key), directory)
            self._open(ctx, directory, state.optimizer, base.trained_steps)
        else:
            save_checkpoint(state.master_weights, tmp / "master", ctx.model_dir)
            self._open(ctx, tmp / "master", state.optimizer, base.trained_steps)

    def _open(self, ctx: RunContext, weights_dir: Path, optimizer_state: dict[str, Any] | None, step: int, *,
              train_state_dir: Path | None = None) -> None:
        """Replace the engine by one holding `weights_dir` and `optimizer_state` (or the recovery
        state in `train_state_dir`) as step `step`."""
        self.close()
        cfg = ctx.config
        self.engine = open_engine(EngineSpec(base_dir=ctx.model_dir, weights_dir=weights_dir,
                                             optimizer_state=optimizer_state, loss=cfg.loss, optim=cfg.optim,
                                             world_size=cfg.batch.world_size, epochs=cfg.batch.epochs,
                                             activation_checkpointing=cfg.batch.activation_checkpointing,
                                             precision=cfg.batch.precision, ranks=self.ranks,
                                             train_state_dir=train_state_dir))
        self.run_id, self.applied_step = cfg.name, step

    def _apply(self, ctx: RunContext, step: int, timings: dict[str, float] | None = None) -> dict[str, Any]:
        """One optimiser step on the batch `step` claimed; the engine then holds step `step`. Returns
        the step's metrics: the loss's (rl/step.py) and the batch's (trainer/samples.py); `timings`
        gets the seconds of reading and planning the batch and of the engine's step."""
        assert self.engine is not None and self.run_id == ctx.config.name and self.applied_step == step - 1
        cfg, timings = ctx.config, {} if timings is None else timings
        with timed(timings, "read_s"), self.db.begin() as s:
            rows = buffer.claimed_trajectories(s, cfg.name, step)
            version_steps = dict(s.execute(sa.select(PolicyVersion.version, PolicyVersion.trained_steps)
                                           .where(PolicyVersion.run_id == cfg.name)).all())
        samples = to_samples(rows, mask_truncated=cfg.loss.mask_truncated)
        if not samples:
            raise RuntimeError(f"step {step} of run {cfg.name} claimed no completed trajectories")
        with timed(timings, "plan_s"):
            updates = plan_updates(samples, advantage=cfg.advantage, loss=cfg.loss, batch=cfg.batch,
                                   pad_token_id=ctx.tokenizer.pad_token_id or 0)
        with timed(timings, "engine_s"):
            metrics = self.engine.step(updates, step_seed(cfg.optim.seed, step))
        self.applied_step = step
        stale = staleness(samples, step, version_steps)
        return (metrics | batch_metrics(samples, updates, stale) | trajectory_metrics(rows)
                | {"staleness": stale})  # per trajectory, for metrics

    def _restore_base(self, run_id: str, step: int) -> PolicyVersion:
        """Where a restore to `step` starts (checkpoints.recovery_base); never a version whose bytes
        the retention policy deleted."""
        with self.db.begin() as s:
            versions = s.scalars(sa.select(PolicyVersion).where(PolicyVersion.run_id == run_id,
                                                                PolicyVersion.deleted_at.is_(None))).all()
        base = recovery_base(versions, stored_versions(self.store, run_id), stored_train_states(self.store, run_id),
                             step)
        if base is None:
            raise RuntimeError(f"run {run_id} has no published version at or before step {step}: "
                               "init_policy must run first")
        return base

    def _stores_train_state(self, ctx: RunContext, trained_steps: int) -> bool:
        """Whether the version published after `trained_steps` steps carries the optimizer state: after
        the run's last step, or `sync.recovery_state_every` steps after the last stored state (the
        same answer when a failed step is retried: only states before it count)."""
        cfg = ctx.config
        if trained_steps == cfg.steps:
            return True
        earlier = [k for k in stored_train_states(self.store, cfg.name) if k < trained_steps]
        return trained_steps - max(earlier, default=0) >= cfg.sync.recovery_state_every

    # -- publishing and committing ------------------------------------------------------------------
    def _publish(self, ctx: RunContext, version: int, trained_steps: int, timings: dict[str, float] | None = None,
                 *, background: bool = False, expect_sha256: str | None = None) -> tuple[Manifest, dict]:
        """Save the engine's weights as `version` into this machine's cache, hash them, probe them
        (the reference logprobs a server must reproduce: the fp32 forward of the saved bytes) and upload them, with the
        recovery state where the recovery policy asks for it (recovery only: never part of the
        inference checkpoint); with `background` the upload runs beside the next step. A re-created
        version (`expect_sha256`) must have the committed weights' bytes. `timings` gets the seconds
        of each part (the profile of benchmarks/trainer_efficiency.py)."""
        assert self.engine is not None
        run_id, timings = ctx.config.name, {} if timings is None else timings
        with timed(timings, "upload_wait_s"):
            self._finish_upload()  # the previous version durable first; its train state counts below
        cached = local_version_dir(self.work_dir, run_id, version)
        rounded = ctx.config.sync.weights_dtype != "float32"
        with timed(timings, "save_s"):
            weights = self.engine.state_dict()   # gathered once: a sharded engine's gather is a collective
            with tempfile.TemporaryDirectory(dir=self.work_dir) as tmp:
                directory = Path(tmp) / "checkpoint"
                saved = save_checkpoint(weights, directory, ctx.model_dir,
                                        getattr(torch, ctx.config.sync.weights_dtype) if rounded else None)
                shutil.rmtree(cached, ignore_errors=True)  # a failed try's files: replaced by this step's
                cached.parent.mkdir(parents=True, exist_ok=True)
                directory.rename(cached)  # whole or not at all (same filesystem)
        with timed(timings, "hash_s"):
            manifest = describe_checkpoint(run_id, version, trained_steps, cached, {WEIGHTS_FILE: saved.sha256})
        if expect_sha256 is not None and manifest.weights.sha256 != expect_sha256:
            raise RuntimeError(f"replaying run {run_id} to step {trained_steps} re-created version {version} with "
                               f"weights {manifest.weights.sha256}, not the committed {expect_sha256}")
        if expect_sha256 is not None:
            self._serve_again(run_id, version, cached)
        elif self.stream is not None:
            self.stream.offer(run_id, version, cached)  # servers may pull it from now on
        state_dir = None
        if trained_steps > 0 and self._stores_train_state(ctx, trained_steps):
            with timed(timings, "train_state_s"):
                state_dir = cached.parent / f".train-state-v{version:06d}"
                shutil.rmtree(state_dir, ignore_errors=True)   # a failed try's files
                self.engine.save_train_state(state_dir)
                written = len(list(state_dir.glob("*.distcp")))
                if written != ctx.config.batch.world_size:   # ranks on other hosts wrote into their own disks
                    raise RuntimeError(f"{written} of {ctx.config.batch.world_size} ranks' recovery files are in "
                                       f"{state_dir}: the trainer's work directory must be shared by every host of "
                                       "its ranks (docs/multi-host.md)")
        del weights   # before the probe, which may load a model of its own
        with timed(timings, "probe_s"):
            # what a faithful server must reproduce: the published bytes forwarded in fp32 (the live
            # model when it computes in fp32 on unrounded weights, otherwise the file just written),
            # so the bound depends on the server's dtype alone (weights/tolerance.py)
            prompt, scored = probe_ids(ctx.tokenizer)
            probe_of = functools.partial(make_probe, prompt_ids=prompt, scored_ids=scored)
            live = ctx.config.batch.precision == "fp32" and not rounded
            probe = self.engine.evaluate(probe_of) if live else probe_of(load_policy(cached))
        job = functools.partial(self._upload, manifest, cached, state_dir)
        if background:
            self.upload = self.uploader.submit(job), job
        else:
            with timed(timings, "upload_s"):
                job()
        return manifest, probe

    def _upload(self, manifest: Manifest, directory: Path, state_dir: Path | None) -> None:
        """The recovery state first, the checkpoint's files, and its manifest last (the mark of a
        durable version). The cache keeps the checkpoint's files: restores start from them, and a
        sidecar on this filesystem loads them."""
        t0 = time.monotonic()
        if state_dir is not None and state_dir.exists():
            upload_train_state(self.store, manifest.run_id, manifest.trained_steps, state_dir)
            shutil.rmtree(state_dir)
        upload_described(self.store, manifest, directory)
        log.info("uploaded version %d of run %s (%.1f MB) in %.2f s", manifest.version, manifest.run_id,
                 manifest.total_bytes / 1e6, time.monotonic() - t0)

    def _finish_upload(self) -> None:
        """Wait for the background upload; one that failed is tried once more in the foreground, and a
        second failure raises: the step in progress then fails instead of committing past a version
        that is not durable."""
        if self.upload is None:
            return
        (upload, job), self.upload = self.upload, None
        try:
            upload.result()
        except Exception:  # noqa: BLE001 - S3 may have been down for a moment: once more, in the foreground
            log.warning("a background upload failed; trying it once more", exc_info=True)
            job()

    def _prune(self, run_id: str, policy: RetentionConfig) -> None:
        """Apply the run's retention policy (weights/retention.py) to the store and this machine's
        cache. A failure costs only disk space: it is recorded, and the next pass tries again."""
        try:
            pruned = prune_run(self.db, self.store, run_id, policy)
            local = forget_deleted(self.db, self.work_dir, run_id)
        except Exception as exc:  # noqa: BLE001 - never fails a step
            log.warning("the retention pass of run %s failed", run_id, exc_info=True)
            with self.db.begin() as s:
                record_failure(s, run_id=run_id, kind="retention", error_type=type(exc).__name__,
                               message=f"deleting old checkpoints failed (retried after the next publish): {exc}")
            return
        if pruned.versions or pruned.train_states or local:
            log.info("retention of run %s: deleted versions %s and optimizer states of steps %s (%.1f MB in the "
                     "store, %.1f MB here)", run_id, pruned.versions, pruned.train_states, pruned.bytes_freed / 1e6,
                     local / 1e6)

    def wait_for_pruning(self) -> None:
        """Wait for the retention pass in flight, if any (it records its own failures)."""
        if self.pruning is not None:
            self.pruning.result()
            self.pruning = None

    def _commit(self, inp: TrainStepInput, claim: buffer.Claim, metrics: dict[str, Any], started: datetime,
                published: tuple[Manifest, dict] | None) -> StepSummary:
        row = TrainStep(
            run_id=inp.run_id, step=inp.step, policy_version=inp.policy_version,
            published_version=published[0].version if published else None, n_groups=len(claim.consumed),
            n_trajectories=int(metrics["num_sequences"]), n_tokens=int(metrics["num_tokens"]), loss=metrics["loss"],
            reward_mean=metrics["reward_mean"], reward_std=metrics["reward_std"],
            response_length_mean=metrics["response_length_mean"], entropy=metrics["entropy"],
            kl_sampler=metrics["kl_sampler"], grad_norm=metrics["grad_norm"],
            staleness_mean=metrics["staleness_mean"], staleness_max=int(metrics["staleness_max"]),
            max_staleness=inp.max_staleness,
            metrics={**metrics, "dropped_groups": claim.dropped, "consumed_groups": claim.consumed},
            started_at=started, finished_at=datetime.now(UTC))
        with self.db.begin() as s:
            if published:
                s.add(self._version_row_of(*published))
                s.flush()  # the version row first: its trigger checks contiguity
            s.add(row)
        return _summary(row, published[0] if published else None)

    def _version_row_of(self, manifest: Manifest, probe: dict) -> PolicyVersion:
        return PolicyVersion(run_id=manifest.run_id, version=manifest.version, trained_steps=manifest.trained_steps,
                             checkpoint_key=manifest_key(manifest.run_id, manifest.version),
                             sha256=manifest.weights.sha256, size_bytes=manifest.total_bytes, probe=probe,
                             stream_endpoint=self.stream.endpoint if self.stream is not None else None)

    def _committed(self, run_id: str, step: int) -> StepSummary | None:
        with self.db.begin() as s:
            row = s.scalar(sa.select(TrainStep).where(TrainStep.run_id == run_id, TrainStep.step == step))
            if row is None:
                return None
            version = self._version_row(run_id, row.published_version) if row.published_version is not None else None
            return _summary(row, version)

    def _version_row(self, run_id: str, version: int) -> PolicyVersion | None:
        with self.db.begin() as s:
            return s.scalar(sa.select(PolicyVersion).where(PolicyVersion.run_id == run_id,
                                                           PolicyVersion.version == version))


def _yield_the_cores() -> None:
    """Run the upload thread at the lowest CPU priority (Linux schedules threads by their own nice
    value): where the trainer shares its cores, the step's compute goes first and the upload takes
    what is left; where it does not (a GPU trainer, a remote S3), nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux: the thread keeps the process's priority
        pass


@contextmanager
def timed(into: dict[str, float], key: str) -> Iterator[None]:
    """Record the seconds the block took as into[key] (also when it raises)."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        into[key] = time.monotonic() - t0


def _published(row: PolicyVersion) -> PublishedVersion:
    return PublishedVersion(row.version, row.trained_steps, row.checkpoint_key, row.sha256)


def _summary(row: TrainStep, published: Manifest | PolicyVersion | None) -> StepSummary:
    metrics = row.metrics or {}
    version = None
    if published is not None:
        key = manifest_key(row.run_id, published.version)
        sha = published.weights.sha256 if isinstance(published, Manifest) else published.sha256
        version = PublishedVersion(published.version, published.trained_steps, key, sha)
    return StepSummary(step=row.step, loss=row.loss or 0.0, reward_mean=row.reward_mean or 0.0,
                       staleness_max=row.staleness_max or 0, n_tokens=row.n_tokens,
                       consumed_groups=list(metrics.get("consumed_groups", [])),
                       dropped_groups=list(metrics.get("dropped_groups", [])), published=version,
                       duration_s=(row.finished_at - row.started_at).total_seconds(),
                       staleness=list(metrics.get("staleness", [])), entropy=row.entropy,
                       kl_sampler=row.kl_sampler, response_length=row.response_length_mean)
