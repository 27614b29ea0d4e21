"""The trainer: one policy in memory, advanced one committed step at a time.

    train_step(s):  committed already?  -> return the recorded result (a retried activity)
                    bring the model to step s - 1 (restore + replay after a restart)
                    claim the batch of step s in Postgres (fresh groups; stale ones dropped)
                    one optimiser step (data-parallel ranks, micro-batches: rl/)
                    publish a checkpoint if asked (S3 + probe logprobs)
                    commit: train_steps row (+ policy_versions row) in one transaction

Exact recovery: every published version also stores the optimizer state. A new trainer loads
the newest version at or before the step it needs and replays the later committed steps on
their recorded batches (the groups each step claimed), so its parameters equal those of a
trainer that never stopped.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa
import torch
from transformers import AutoModelForCausalLM

from policy.checkpoint import WEIGHTS_FILE, load_state_dict, save_checkpoint
from rl.batching import plan_step
from rl.step import make_optimizer, train_step
from rollout.context import RunContext, RunContexts
from schemas.payloads import PublishedVersion, StepSummary, TrainStepInput
from schemas.tables import PolicyVersion, TrainStep
from storage import buffer
from storage.db import Database
from storage.object_store import ObjectStore
from trainer.probe import make_probe
from trainer.samples import staleness, to_samples
from weights.checkpoints import (
    Manifest,
    download_checkpoint,
    load_manifest,
    manifest_key,
    train_state_key,
    upload_checkpoint,
)

log = logging.getLogger("rlpipe.trainer")
Heartbeat = Callable[[], None]


class Trainer:
    """Holds one run's policy and optimizer; a trainer worker has one (concurrency 1)."""

    def __init__(self, db: Database, store: ObjectStore, contexts: RunContexts, work_dir: Path) -> None:
        self.db = db
        self.store = store
        self.contexts = contexts
        self.work_dir = work_dir
        self.run_id: str | None = None
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.applied_step = -1
        """The last step whose update the in-memory model holds (-1: nothing loaded)."""

    # -- entry points ---------------------------------------------------------------------------
    def init_policy(self, run_id: str) -> PublishedVersion:
        """Publish the base model as version 0 (once per run)."""
        existing = self._version_row(run_id, 0)
        if existing is not None:
            return _published(existing)
        ctx = self.contexts.get(run_id)
        self._load_weights(ctx, ctx.model_dir, optimizer_state=None, step=0)
        manifest, probe = self._publish(ctx, version=0, trained_steps=0)
        with self.db.begin() as s:
            s.add(_version_row(manifest, probe))
        return PublishedVersion(0, 0, manifest_key(run_id, 0), manifest.weights.sha256)

    def train_step(self, inp: TrainStepInput, heartbeat: Heartbeat = lambda: None) -> StepSummary:
        committed = self._committed(inp.run_id, inp.step)
        if committed is not None:
            return committed
        ctx = self.contexts.get(inp.run_id)
        self._bring_to(ctx, inp.step - 1, heartbeat)
        with self.db.begin() as s:
            claim = buffer.claim_batch(s, run_id=inp.run_id, step=inp.step, groups_per_step=inp.groups_per_step,
                                       min_trained_steps=inp.min_trained_steps)
        started = datetime.now(UTC)
        t0 = time.monotonic()
        metrics, stale = self._apply(ctx, inp.step)
        train_s = time.monotonic() - t0
        heartbeat()
        published = None
        if inp.publish:
            manifest, probe = self._publish(ctx, version=inp.policy_version + 1, trained_steps=inp.step)
            published = (manifest, probe)
        metrics |= {"train_s": train_s, "publish_s": time.monotonic() - t0 - train_s}
        return self._commit(inp, claim, metrics, stale, started, published)

    # -- state --------------------------------------------------------------------------------------
    def _bring_to(self, ctx: RunContext, step: int, heartbeat: Heartbeat) -> None:
        """Make the in-memory model hold the result of `step` committed steps."""
        run_id = ctx.config.name
        if self.run_id == run_id and self.applied_step == step:
            return
        with self.db.begin() as s:
            base = s.scalars(sa.select(PolicyVersion).where(PolicyVersion.run_id == run_id,
                                                            PolicyVersion.trained_steps <= step)
                             .order_by(PolicyVersion.version.desc()).limit(1)).first()
        if base is None:
            raise RuntimeError(f"run {run_id} has no published version at or before step {step}: "
                               "init_policy must run first")
        log.info("restoring run %s: version %d (step %d), replaying steps %d..%d", run_id, base.version,
                 base.trained_steps, base.trained_steps + 1, step)
        directory = self.work_dir / run_id / f"v{base.version:06d}"
        download_checkpoint(self.store, load_manifest(self.store, base.checkpoint_key), directory)
        optimizer_state = None
        if base.trained_steps > 0:
            state_file = directory / "optimizer.pt"
            self.store.get_file(train_state_key(run_id, base.trained_steps), state_file)
            optimizer_state = torch.load(state_file, weights_only=True)
        self._load_weights(ctx, directory, optimizer_state, base.trained_steps)
        for replay in range(base.trained_steps + 1, step + 1):
            self._apply(ctx, replay)
            heartbeat()

    def _load_weights(self, ctx: RunContext, directory: Path, optimizer_state: dict | None, step: int) -> None:
        model = AutoModelForCausalLM.from_pretrained(ctx.model_dir, torch_dtype=torch.float32)
        model.load_state_dict(load_state_dict(directory), strict=False)  # tied weights are re-tied by config
        model.train()
        optimizer = make_optimizer(model.parameters(), ctx.config.optim)
        if optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)
        self.model, self.optimizer, self.run_id, self.applied_step = model, optimizer, ctx.config.name, step

    def _apply(self, ctx: RunContext, step: int) -> tuple[dict[str, float], list[int]]:
        """One optimiser step on the batch `step` claimed; the model then holds step `step`."""
        assert self.model is not None and self.optimizer is not None and self.applied_step == step - 1
        cfg = ctx.config
        with self.db.begin() as s:
            rows = buffer.claimed_trajectories(s, cfg.name, step)
            version_steps = dict(s.execute(sa.select(PolicyVersion.version, PolicyVersion.trained_steps)
                                           .where(PolicyVersion.run_id == cfg.name)).tuples().all())
        samples = to_samples(rows)
        if not samples:
            raise RuntimeError(f"step {step} of run {cfg.name} claimed no completed trajectories")
        plan = plan_step(samples, advantage=cfg.advantage, loss=cfg.loss, batch=cfg.batch,
                         pad_token_id=ctx.tokenizer.pad_token_id or 0)
        metrics = train_step(self.model, self.optimizer, plan.shards[0], cfg.loss, grad_clip=cfg.optim.grad_clip)
        self.applied_step = step
        rewards = [x.reward for x in samples]
        metrics |= {"reward_mean": statistics.fmean(rewards), "reward_std": statistics.pstdev(rewards),
                    "response_length_mean": statistics.fmean(sum(x.loss_mask) for x in samples)}
        return metrics, staleness(samples, step, version_steps)

    # -- publishing and committing ------------------------------------------------------------------
    def _publish(self, ctx: RunContext, version: int, trained_steps: int) -> tuple[Manifest, dict]:
        """Upload the current weights as `version` (and the optimizer state); returns the manifest
        and the probe with the trainer's reference logprobs."""
        assert self.model is not None and self.optimizer is not None
        run_id = ctx.config.name
        with tempfile.TemporaryDirectory(dir=self.work_dir) as tmp:
            directory = Path(tmp) / "checkpoint"
            save_checkpoint(self.model.state_dict(), directory, ctx.model_dir)
            manifest = upload_checkpoint(self.store, run_id, version, trained_steps, directory)
            if trained_steps > 0:
                state_file = Path(tmp) / "optimizer.pt"
                torch.save(self.optimizer.state_dict(), state_file)
                self.store.put_file(train_state_key(run_id, trained_steps), state_file)
            cached = self.work_dir / run_id / f"v{version:06d}"
            if not cached.exists():  # keep it: a restore after a crash starts from the newest version
                shutil.copytree(directory, cached)
        return manifest, make_probe(self.model, ctx.tokenizer)

    def _commit(self, inp: TrainStepInput, claim: buffer.Claim, metrics: dict[str, float], stale: list[int],
                started: datetime, published: tuple[Manifest, dict] | None) -> StepSummary:
        row = TrainStep(
            run_id=inp.run_id, step=inp.step, policy_version=inp.policy_version,
            published_version=published[0].version if published else None, n_groups=len(claim.consumed),
            n_trajectories=int(metrics["num_sequences"]), n_tokens=int(metrics["num_tokens"]), loss=metrics["loss"],
            reward_mean=metrics["reward_mean"], reward_std=metrics["reward_std"],
            response_length_mean=metrics["response_length_mean"], entropy=metrics["entropy"],
            kl_sampler=metrics["kl_sampler"], grad_norm=metrics["grad_norm"],
            staleness_mean=statistics.fmean(stale), staleness_max=max(stale),
            metrics={**metrics, "dropped_groups": claim.dropped, "consumed_groups": claim.consumed},
            started_at=started, finished_at=datetime.now(UTC))
        with self.db.begin() as s:
            if published:
                s.add(_version_row(*published))
                s.flush()  # the version row first: its trigger checks contiguity
            s.add(row)
        return _summary(row, published[0] if published else None)

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


def _version_row(manifest: Manifest, probe: dict) -> PolicyVersion:
    return PolicyVersion(run_id=manifest.run_id, version=manifest.version, trained_steps=manifest.trained_steps,
                         checkpoint_key=manifest_key(manifest.run_id, manifest.version),
                         sha256=manifest.weights.sha256, size_bytes=manifest.total_bytes, probe=probe)


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
                       duration_s=(row.finished_at - row.started_at).total_seconds())


WEIGHTS = WEIGHTS_FILE  # re-exported for the sidecar's local layout
