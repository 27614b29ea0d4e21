"""Exact trainer recovery, on the real Postgres and SeaweedFS (no vLLM, no Temporal workers). The
trainers upload each version beside the next step (background_uploads, a GPU trainer's default), the
path with the most to recover.

Each run's buffer holds the same synthetic completed groups, so every run trains on identical
batches. The uninterrupted run: one Trainer runs steps 1..STEPS, publishing every SYNC_INTERVAL
steps and at the last, with the optimizer state stored every RECOVERY_STATE_EVERY steps (so after steps
4 and 5, not 2). The recovered runs must end with the same weights and optimizer state, as published to
the store, within 1e-6 (max abs), while one step's update is far larger than that:
- thrown away: the Trainer is discarded after step 1 (before any trained checkpoint: restore
  version 0, replay step 1), after step 3 (version 1 of step 2 has no optimizer state: restore
  version 0, replay steps 1..3) and after step 4 (restore version 2, which has it: nothing to
  replay); each successor starts with an empty work directory; on one rank and
  two, with one optimiser step per train step and with four (2 epochs x 2 mini-batches, decoupled
  PPO anchored at the proximal policy recorded before the first);
- SIGKILLed: a child process (with its data-parallel ranks) is killed inside step 4, after it
  claimed and trained but before it published or committed -- or, with four optimiser steps per
  train step, between its two epochs, when two of them have moved the weights in memory; a new
  process restores version 0, replays steps 1..3 and redoes step 4 on the batch step 4 had already claimed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from rlpipe.infra.endpoints import Endpoints
from rlpipe.infra.process import free_port
from rlpipe.observe.invariants import CHECKPOINTS_MATCH, check_run
from rlpipe.policy.checkpoint import load_state_dict
from rlpipe.rl import step as step_module
from rlpipe.rl.distributed import optimizer_state_by_index
from rlpipe.rollout.context import RunContexts
from rlpipe.schemas.config import RunConfig
from rlpipe.schemas.payloads import TrainStepInput
from rlpipe.schemas.tracking import TrackerName
from rlpipe.schemas.trajectory import AssembledTrajectory
from rlpipe.storage import buffer
from rlpipe.storage.db import Database
from rlpipe.storage.object_store import ObjectStore
from rlpipe.storage.runs import register_run
from rlpipe.tracking.cursor import cursor_states, plan_batch, tracker_lines
from rlpipe.tracking.follow import MAX_STEPS_PER_BATCH, Outcome, catch_up_run, read_batch
from rlpipe.tracking.sinks import open_sink
from rlpipe.trainer.engine import RankEngine, load_policy
from rlpipe.trainer.trainer import Trainer
from rlpipe.weights.checkpoints import (
    delete_train_state,
    download_checkpoint,
    download_train_state,
    load_manifest,
    manifest_key,
    stored_train_states,
    stored_versions,
    train_state_key,
)
from rlpipe.weights.stream import StreamSource, WeightStreamServer, offered

pytestmark = pytest.mark.stack

STEPS = 5
SYNC_INTERVAL = 2            # versions: v0 (base), v1 (step 2), v2 (step 4), v3 (step 5, the last)
RECOVERY_STATE_EVERY = 3     # optimizer state stored with v2 (4 - 0 >= 3) and v3 (the last), not v1
GROUP_SIZE, GROUPS_PER_STEP = 4, 2
TOLERANCE = 1e-6
CHILD_TIMEOUT_S = 300
Weights = dict[str, torch.Tensor]


# -- a run and its buffer -----------------------------------------------------------------------
def new_run(db: Database, tiny_model: Path, world_size: int, several_updates: bool = False,
            tracking: dict[str, Any] | None = None, retention: dict[str, Any] | None = None,
            bf16: bool = False) -> RunConfig:
    """A registered run whose steps move the weights far more than TOLERANCE (lr 1e-3), with the
    reference model (KL) and micro-batches on; `several_updates`: 2 epochs over 2 mini-batches, four
    optimiser steps per train step, anchored at the proximal policy recorded before the first;
    `tracking`: the config's `tracking` and `trackers` fields (experiment trackers, issue #23); `bf16`: bf16
    compute and bf16 published weights (the fp32 master weights then travel with the optimizer state)."""
    updates = {"mini_batches": 2, "epochs": 2} if several_updates else {}
    cfg = RunConfig.model_validate({
        "name": f"recovery-{world_size}-{uuid.uuid4().hex[:8]}", "steps": STEPS,
        "model": {"path": str(tiny_model)},
        "rollout": {"group_size": GROUP_SIZE, "groups_per_step": GROUPS_PER_STEP},
        "batch": {"world_size": world_size, "micro_batches": 2, **updates, **({"precision": "bf16"} if bf16 else {})},
        "sync": {"interval": SYNC_INTERVAL, "recovery_state_every": RECOVERY_STATE_EVERY,
                 **({"weights_dtype": "bfloat16"} if bf16 else {})},
        "loss": {"kl_coef": 0.05, **({"off_policy": "decoupled"} if several_updates else {})},
        "optim": {"lr": 1e-3},
        "retention": retention or {},
        **(tracking or {}),
    })
    with db.begin() as s:
        # registered without its trackers: a rollout worker of the session (its tracking loop) must not
        # follow the run, whose tracker passes the tests drive and count themselves
        register_run(s, cfg.model_copy(update={"tracking": []}))
    fill_buffer(db, cfg)
    return cfg


def fill_buffer(db: Database, cfg: RunConfig) -> None:
    """STEPS x GROUPS_PER_STEP completed groups generated by version 0; the same content for every
    run: prompts and completions of random tokens, some tool tokens (mask 0), sampler logprobs
    near the tiny model's (about -log 384)."""
    rng = random.Random(0)
    for g in range(STEPS * GROUPS_PER_STEP):
        prompt = [rng.randrange(3, 384) for _ in range(6)]
        with db.begin() as s:  # one transaction per group: claims take them in this order
            ids = buffer.start_group(s, run_id=cfg.name, group_index=g, prompt_index=g, task_id=f"task-{g}",
                                     workflow_id=f"{cfg.name}-group-{g}", n_samples=GROUP_SIZE, prompt_ids=prompt)
            samples = []
            for trajectory_id in ids:
                n = rng.randrange(4, 12)
                trajectory = AssembledTrajectory(
                    prompt_ids=prompt, completion_ids=[rng.randrange(3, 384) for _ in range(n)],
                    loss_mask=[0 if rng.random() < 0.2 else 1 for _ in range(n)],
                    sampler_logprobs=[-6.0 + rng.uniform(-0.5, 0.5) for _ in range(n)], version_spans=[[0, 0, n]])
                samples.append(buffer.FinishedSample(trajectory_id, rng.choice([0.0, 0.5, 1.0]), None, trajectory,
                                                     "stop", 1))
            buffer.finish_group(s, run_id=cfg.name, group_index=g, samples=samples, discarded_ids=[],
                                status="completed", reason=None)


def step_input(cfg: RunConfig, step: int) -> TrainStepInput:
    """What TrainingRunWorkflow asks for: publish every SYNC_INTERVAL steps and at the last."""
    return TrainStepInput(run_id=cfg.name, step=step, policy_version=(step - 1) // SYNC_INTERVAL,
                          min_trained_steps=0, groups_per_step=GROUPS_PER_STEP,
                          publish=step % SYNC_INTERVAL == 0 or step == STEPS)


def run_steps(trainer: Trainer, cfg: RunConfig, steps: range, pause_in: int | None = None,
              pause_after_updates: int | None = None) -> None:
    """init_policy when starting at step 1, then `steps`; inside step `pause_in` report on stdout and
    wait to be killed: after its first `pause_after_updates` optimiser steps, or (None) after training,
    before publishing and committing."""
    if steps.start == 1:
        trainer.init_policy(cfg.name)
    for step in steps:
        if step != pause_in:
            trainer.train_step(step_input(cfg, step))
        elif pause_after_updates is None:
            trainer.train_step(step_input(cfg, step), heartbeat=_wait_to_be_killed)
        else:
            with _pausing_after_updates(pause_after_updates):
                trainer.train_step(step_input(cfg, step))


@contextmanager
def _pausing_after_updates(updates: int) -> Iterator[None]:
    """Wait to be killed once `updates` optimiser steps of the one-process engine are done
    (rl/step.run_epochs calls the module's `train_step` once per optimiser step)."""
    original, done = step_module.train_step, 0

    def counting(*args: Any, **kwargs: Any) -> dict[str, float]:
        nonlocal done
        metrics = original(*args, **kwargs)
        done += 1
        if done == updates:
            _wait_to_be_killed()
        return metrics

    step_module.train_step = counting
    try:
        yield
    finally:
        step_module.train_step = original


def _wait_to_be_killed() -> None:
    print("paused", flush=True)
    time.sleep(CHILD_TIMEOUT_S)
    raise TimeoutError("was not killed")


# -- what a run ends with -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FinalState:
    weights: Weights                 # published after the last step
    optimizer: dict                  # stored beside them for recovery (AdamW's state by parameter name)
    train_weights: Weights           # and the fp32 weights the optimizer steps, in the same recovery state
    weights_before: Weights          # published one checkpoint earlier (step STEPS - 1)


Uninterrupted = Callable[[int, bool, bool], tuple[RunConfig, FinalState]]
"""(world_size, several_updates) -> the uninterrupted run of that layout and its final state."""


def final_state(db: Database, store: ObjectStore, run_id: str, tmp: Path, with_before: bool = True) -> FinalState:
    """The run's last weights and optimizer state; `with_before`: also the version before (only the
    uninterrupted run's is compared, and a retention policy may have deleted it)."""
    with db.begin() as s:
        last = s.execute(sa.text("select max(version) from policy_versions where run_id = :r"), {"r": run_id}).scalar()

    def weights(version: int) -> Weights:
        directory = tmp / f"{run_id}-v{version}"
        download_checkpoint(store, load_manifest(store, manifest_key(run_id, version)), directory)
        return load_state_dict(directory)

    state_dir = tmp / f"{run_id}-state"   # a file per rank (torch.distributed.checkpoint), read here in one
    assert download_train_state(store, run_id, STEPS, state_dir), "the last step's recovery state is stored"
    dcp_to_torch_save(state_dir, tmp / f"{run_id}-state.pt")
    stored = torch.load(tmp / f"{run_id}-state.pt", weights_only=False)
    final = weights(last)
    return FinalState(final, stored["optimizer"], stored["model"], weights(last - 1) if with_before else final)


def max_abs_diff(a: Weights, b: Weights) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def optimizer_tensors(state: dict) -> Weights:
    """AdamW's per-parameter state (step, exp_avg, exp_avg_sq) by '<param name>.<name>'."""
    return {f"{param}.{name}": v for param, per in state["state"].items() for name, v in per.items()}


def assert_same_final_state(got: FinalState, want: FinalState) -> None:
    assert max_abs_diff(got.weights, want.weights) <= TOLERANCE
    assert optimizer_tensors(want.optimizer), "the optimizer state was stored"
    assert max_abs_diff(optimizer_tensors(got.optimizer), optimizer_tensors(want.optimizer)) <= TOLERANCE
    assert max_abs_diff(got.train_weights, want.train_weights) <= TOLERANCE
    # the check can fail: the last step alone moved the weights by far more than the tolerance
    assert max_abs_diff(want.weights, want.weights_before) > 1000 * TOLERANCE


def claimed_steps(db: Database, run_id: str) -> list[int | None]:
    """The step that claimed each group, in group order."""
    with db.begin() as s:
        return list(s.scalars(sa.text("select claimed_step from rollout_groups where run_id = :r "
                                      "order by group_index"), {"r": run_id}))


def step_metrics(db: Database, run_id: str) -> dict[int, dict]:
    with db.begin() as s:
        return dict(s.execute(sa.text("select step, metrics from train_steps where run_id = :r"),
                              {"r": run_id}).all())


def assert_replayed(metrics: dict, version: int, steps: int) -> None:
    assert (metrics["restored_version"], metrics["replayed_steps"]) == (version, steps)


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def uninterrupted(migrated_db: Database, object_store: ObjectStore, tiny_model: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Uninterrupted:
    """The uninterrupted run for a world size (run once, shared by the tests of that world size)."""
    done: dict[tuple[int, bool, bool], tuple[RunConfig, FinalState]] = {}

    def run(world_size: int, several_updates: bool = False, bf16: bool = False) -> tuple[RunConfig, FinalState]:
        if (world_size, several_updates, bf16) not in done:
            cfg = new_run(migrated_db, tiny_model, world_size, several_updates, bf16=bf16)
            tmp = tmp_path_factory.mktemp(f"uninterrupted-{world_size}")
            trainer = Trainer(migrated_db, object_store, RunContexts(migrated_db), tmp / "work",
                              background_uploads=True)
            try:
                run_steps(trainer, cfg, range(1, STEPS + 1))
            finally:
                trainer.shutdown()
            done[world_size, several_updates, bf16] = cfg, final_state(migrated_db, object_store, cfg.name, tmp)
        return done[world_size, several_updates, bf16]

    return run


# -- the tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("world_size", "several_updates", "bf16"),
                         [(1, False, False), (2, False, False), (1, True, False), (2, True, False), (2, False, True)],
                         ids=["1-rank", "2-ranks", "1-rank-epochs", "2-ranks-epochs", "2-ranks-bf16"])
def test_a_trainer_thrown_away_between_checkpoints_recovers_by_replay(
        world_size: int, several_updates: bool, bf16: bool, uninterrupted: Uninterrupted, migrated_db: Database,
        object_store: ObjectStore, tiny_model: Path, tmp_path: Path) -> None:
    """`bf16`: the published weights are rounded, so each restore must start from the fp32 master weights
    stored with the optimizer state (or the base model, for version 0): from the rounded ones, the
    replayed steps end elsewhere."""
    baseline, want = uninterrupted(world_size, several_updates, bf16)
    # the recovery state's weights are fp32, the published ones too unless rounded to bf16
    assert {t.dtype for t in want.train_weights.values()} == {torch.float32}
    published = {k: want.train_weights[k] for k in want.weights}
    assert (max_abs_diff(want.weights, published) > 0) == bf16
    cfg = new_run(migrated_db, tiny_model, world_size, several_updates, bf16=bf16)
    for steps in (range(1, 2), range(2, 4), range(4, 5), range(5, STEPS + 1)):   # thrown away after 1, 3 and 4
        trainer = Trainer(migrated_db, object_store, RunContexts(migrated_db), tmp_path / f"work-{steps.start}",
                          background_uploads=True)
        try:
            run_steps(trainer, cfg, steps)
        finally:
            trainer.shutdown()  # nothing in memory, ranks gone (its last upload ended: the kill is below)
    assert_same_final_state(final_state(migrated_db, object_store, cfg.name, tmp_path), want)
    metrics = step_metrics(migrated_db, cfg.name)
    assert_replayed(metrics[2], version=0, steps=1)
    assert_replayed(metrics[4], version=0, steps=3)
    assert_replayed(metrics[5], version=2, steps=0)
    assert all("replayed_steps" not in metrics[s] for s in (1, 3))
    assert stored_train_states(object_store, cfg.name) == {4, 5}
    # every step records its phases (benchmarks/trainer_efficiency.py); only publishing steps the publish's,
    # only those that store the optimizer state its seconds, and only the last its upload (the others
    # upload beside the next step, which records the wait for it)
    train_phases = {"claim_s", "read_s", "plan_s", "engine_s", "upload_wait_s"}
    publish_phases = {"save_s", "hash_s", "probe_s"}
    assert train_phases | publish_phases <= metrics[2].keys() and "train_state_s" not in metrics[2]
    assert train_phases | publish_phases | {"train_state_s"} <= metrics[4].keys() and "upload_s" not in metrics[4]
    assert train_phases | publish_phases | {"train_state_s", "upload_s"} <= metrics[5].keys()
    assert train_phases <= metrics[3].keys() and not publish_phases & metrics[3].keys()
    # replay read the recorded claims and claimed nothing: every group once, by the same step as before
    assert claimed_steps(migrated_db, cfg.name) == claimed_steps(migrated_db, baseline.name)
    assert claimed_steps(migrated_db, cfg.name) == [1 + g // GROUPS_PER_STEP for g in range(STEPS * GROUPS_PER_STEP)]
    # each step records the staleness bound it claimed under: (step - 1) - min_trained_steps (0 here)
    with migrated_db.begin() as s:
        bounds = dict(s.execute(sa.text("select step, max_staleness from train_steps where run_id = :r"),
                                {"r": cfg.name}).all())
    assert bounds == {step: step - 1 for step in range(1, STEPS + 1)}


@pytest.mark.parametrize("same_machine", [False, True], ids=["another-machine", "same-machine"])
def test_a_version_whose_upload_never_finished_is_uploaded_or_recreated(
        same_machine: bool, uninterrupted: Uninterrupted, migrated_db: Database, object_store: ObjectStore,
        tiny_model: Path, tmp_path: Path) -> None:
    """Version 2 (step 4) is committed, but its upload died with its trainer: its manifest never
    reached S3 (nor, on another machine, its optimizer state). The next trainer uploads it from the
    machine's cache when it runs on the same machine, and otherwise re-creates it by replaying steps
    1..4 from version 0, with the committed weights' sha256, before it trains step 5. Either way the
    servers can stream it from the new trainer: its row names the new trainer's weight stream."""
    _, want = uninterrupted(1, False, False)
    cfg = new_run(migrated_db, tiny_model, 1)
    first_stream, second_stream = WeightStreamServer().start(), WeightStreamServer().start()
    first_endpoint = first_stream.endpoint
    first = Trainer(migrated_db, object_store, RunContexts(migrated_db), tmp_path / "work-1",
                    background_uploads=True, stream=first_stream)
    try:
        run_steps(first, cfg, range(1, 5))
    finally:
        first.shutdown()
        first_stream.close()  # gone with its trainer
    object_store.delete(manifest_key(cfg.name, 2))
    if not same_machine:
        delete_train_state(object_store, cfg.name, 4)
    second = Trainer(migrated_db, object_store, RunContexts(migrated_db),
                     tmp_path / ("work-1" if same_machine else "work-2"), background_uploads=True,
                     stream=second_stream)
    try:
        run_steps(second, cfg, range(5, STEPS + 1))
        with migrated_db.begin() as s:
            endpoints = dict(s.execute(sa.text("select version, stream_endpoint from policy_versions "
                                               "where run_id = :r"), {"r": cfg.name}).all())
        assert endpoints[1] == first_endpoint and endpoints[2] == second_stream.endpoint, endpoints
        assert offered(StreamSource(endpoints[2], cfg.name, 2)) is None, "the new trainer serves version 2"
    finally:
        second.shutdown()
        second_stream.close()
    assert_same_final_state(final_state(migrated_db, object_store, cfg.name, tmp_path), want)
    with migrated_db.begin() as s:
        committed = s.execute(sa.text("select sha256 from policy_versions where run_id = :r and version = 2"),
                              {"r": cfg.name}).scalar()
    assert load_manifest(object_store, manifest_key(cfg.name, 2)).weights.sha256 == committed
    assert stored_train_states(object_store, cfg.name) == {4, 5}
    metrics = step_metrics(migrated_db, cfg.name)[5]
    if same_machine:  # uploaded from the cache: a durable version with its state, nothing to replay
        assert_replayed(metrics, version=2, steps=0)
        assert metrics["recreated_versions"] == 0
    else:
        assert_replayed(metrics, version=0, steps=4)
        assert metrics["recreated_versions"] == 1


def test_a_recovery_state_stored_as_one_file_by_an_older_trainer_still_restores(
        uninterrupted: Uninterrupted, migrated_db: Database, object_store: ObjectStore, tiny_model: Path,
        tmp_path: Path) -> None:
    """Runs whose trainer stored the recovery state as one torch.save file (the full optimizer state
    by parameter index) keep restoring from it: the state of step 4 is rewritten so, and a new trainer
    restores version 2 from it for step 5 and ends where the uninterrupted run did."""
    _, want = uninterrupted(1, False, False)
    cfg = new_run(migrated_db, tiny_model, 1)
    first = Trainer(migrated_db, object_store, RunContexts(migrated_db), tmp_path / "work-1", background_uploads=True)
    try:
        run_steps(first, cfg, range(1, 5))
    finally:
        first.shutdown()
    assert download_train_state(object_store, cfg.name, 4, tmp_path / "state")
    dcp_to_torch_save(tmp_path / "state", tmp_path / "state.pt")
    optimizer = torch.load(tmp_path / "state.pt", weights_only=False)["optimizer"]
    names = [name for name, _ in load_policy(tiny_model).named_parameters()]   # the index is this order
    torch.save({"optimizer": optimizer_state_by_index(optimizer, names), "master_weights": None}, tmp_path / "old.pt")
    delete_train_state(object_store, cfg.name, 4)
    object_store.put_file(train_state_key(cfg.name, 4), tmp_path / "old.pt")
    assert stored_train_states(object_store, cfg.name) == {4}
    second = Trainer(migrated_db, object_store, RunContexts(migrated_db), tmp_path / "work-2", background_uploads=True)
    try:
        run_steps(second, cfg, range(5, STEPS + 1))
    finally:
        second.shutdown()
    assert_replayed(step_metrics(migrated_db, cfg.name)[5], version=2, steps=0)
    assert_same_final_state(final_state(migrated_db, object_store, cfg.name, tmp_path), want)


def test_retention_deletes_old_versions_but_never_the_one_a_restore_needs(
        uninterrupted: Uninterrupted, migrated_db: Database, object_store: ObjectStore, tiny_model: Path,
        tmp_path: Path) -> None:
    """keep_last 1 on v0 (base), v1 (step 2), v2 (step 4, optimizer state), v3 (step 5, state).
    After step 2 only v1 is the newest, but v0 is what a restore to step 3 starts from: it is kept,
    and the trainer thrown away after step 3 restores from it. Step 4 stores a state: v0 and v1 go,
    and the trainer thrown away after step 4 restores from v2. After step 5 only v3 and its state
    are left, and the replays reproduce the uninterrupted run exactly."""
    _, want = uninterrupted(1, False, False)
    cfg = new_run(migrated_db, tiny_model, 1, retention={"keep_last": 1})
    kept_after: dict[int, set[int]] = {}
    for steps in (range(1, 4), range(4, 5), range(5, STEPS + 1)):
        trainer = Trainer(migrated_db, object_store, RunContexts(migrated_db), tmp_path / f"work-{steps.start}",
                          background_uploads=True)
        try:
            run_steps(trainer, cfg, steps)
        finally:
            trainer.shutdown()  # its retention pass has ended
        kept_after[steps.stop - 1] = stored_versions(object_store, cfg.name)
    assert kept_after == {3: {0, 1}, 4: {2}, 5: {3}}
    assert_same_final_state(final_state(migrated_db, object_store, cfg.name, tmp_path, with_before=False), want)
    metrics = step_metrics(migrated_db, cfg.name)
    assert_replayed(metrics[4], version=0, steps=3)
    assert_replayed(metrics[5], version=2, steps=0)
    assert stored_train_states(object_store, cfg.name) == {5}
    with migrated_db.begin() as s:  # the rows stay, with their hashes, and say when the bytes went
        deleted = dict(s.execute(sa.text("select version, deleted_at is not null from policy_versions "
                                         "where run_id = :r"), {"r": cfg.name}).all())
        invariant = check_run(s, cfg.name, store=object_store, only=[CHECKPOINTS_MATCH])
    assert deleted == {0: True, 1: True, 2: True, 3: False}
    assert invariant[0].ok, invariant
    # the last trainer's cache: v2 (its restore base) was removed with the version, v3 stays
    assert sorted(p.name for p in (tmp_path / "work-5" / cfg.name).iterdir() if p.is_dir()) == ["v000003"]
    # the objects left are exactly those v3's manifest names
    manifest = load_manifest(object_store, manifest_key(cfg.name, 3))
    assert {o.key for o in object_store.list(f"runs/{cfg.name}/objects/")} == {f.key for f in manifest.files.values()}


@pytest.fixture
def child_env(endpoints: Endpoints) -> dict[str, str]:
    return {**os.environ, "RLPIPE_TEST_ENDPOINTS": json.dumps(dataclasses.asdict(endpoints))}


@pytest.mark.parametrize("several_updates", [False, True], ids=["after-training", "between-epochs"])
def test_a_sigkilled_trainer_process_recovers_by_replay(
        several_updates: bool, uninterrupted: Uninterrupted, migrated_db: Database, object_store: ObjectStore,
        tiny_model: Path, tmp_path: Path, child_env: dict[str, str]) -> None:
    """One process (world_size 1): data-parallel recovery is the test above; this one is about a
    real crash in the middle of a step, with its claim made and nothing committed. With 2 epochs x
    2 mini-batches the kill lands after the first epoch's two optimiser steps."""
    _, want = uninterrupted(1, several_updates, False)
    # the trackers ride along (issue #23): TensorBoard, an MLflow file store and W&B offline with one
    # layout, an MLflow tracking server that is not there with the other
    mlflow_uri = f"http://127.0.0.1:{free_port()}" if several_updates else f"file:{tmp_path / 'mlruns'}"
    cfg = new_run(migrated_db, tiny_model, 1, several_updates, tracking={
        "tracking": ["mlflow"] if several_updates else ["tensorboard", "mlflow", "wandb"],
        "trackers": {"tensorboard": {"log_dir": str(tmp_path / "tb")}, "mlflow": {"tracking_uri": mlflow_uri},
                     "wandb": {"dir": str(tmp_path / "wandb")}}})
    with trainer_process(cfg, range(1, STEPS + 1), tmp_path / "first", child_env, pause_in=4,
                         pause_after_updates=2 if several_updates else None) as first:
        assert _read_until(first, "paused"), "the child never reached step 4"
        os.killpg(first.pid, signal.SIGKILL)   # the trainer (and any rank processes), mid-step
        first.wait(timeout=30)
    with migrated_db.begin() as s:
        assert s.execute(sa.text("select max(step) from train_steps where run_id = :r"), {"r": cfg.name}).scalar() == 3
    assert claimed_steps(migrated_db, cfg.name).count(4) == GROUPS_PER_STEP, "step 4 claimed, not committed"
    first_outcomes = catch_up_run(migrated_db, cfg)  # what the rollout worker's tracking loop does
    with trainer_process(cfg, range(4, STEPS + 1), tmp_path / "second", child_env) as second:
        assert second.wait(timeout=CHILD_TIMEOUT_S) == 0, (tmp_path / "second" / "stderr.log").read_text()[-3000:]
    assert_same_final_state(final_state(migrated_db, object_store, cfg.name, tmp_path), want)
    assert_replayed(step_metrics(migrated_db, cfg.name)[4], version=0, steps=3)
    if several_updates:
        assert_unreachable_tracker_reported(migrated_db, cfg, first_outcomes)
    else:
        assert_every_step_tracked_once(migrated_db, cfg, first_outcomes, tmp_path)


def test_a_rank_sigkilled_mid_step_fails_the_step_and_its_retry_commits_once(
        uninterrupted: Uninterrupted, migrated_db: Database, object_store: ObjectStore, tiny_model: Path,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sharded ranks; rank 1 is SIGKILLed as step 4's engine step begins, so rank 0 is left in a
    collective it never completes. The step must fail saying which rank, leave nothing committed, and
    its retry (what Temporal does with the failed activity) must restore, replay and commit step 4
    once, ending where the undisturbed run ends."""
    _, want = uninterrupted(2, False, False)
    cfg = new_run(migrated_db, tiny_model, 2)
    original, killed, step_being_trained = RankEngine.step, [], [0]

    def killing_rank_one(engine: RankEngine, *args: Any, **kwargs: Any) -> dict[str, float]:
        if not killed and step_being_trained[0] == 4:
            rank_one = engine.group._procs[1].pid
            assert rank_one is not None
            os.kill(rank_one, signal.SIGKILL)
            killed.append(rank_one)
        return original(engine, *args, **kwargs)

    monkeypatch.setattr(RankEngine, "step", killing_rank_one)
    trainer = Trainer(migrated_db, object_store, RunContexts(migrated_db), tmp_path / "work", background_uploads=True)
    try:
        trainer.init_policy(cfg.name)
        for step in range(1, STEPS + 1):
            step_being_trained[0] = step
            if step == 4:
                with pytest.raises(RuntimeError, match=r"data-parallel rank"):
                    trainer.train_step(step_input(cfg, step))
                assert killed, "rank 1 was killed"
                assert 4 not in step_metrics(migrated_db, cfg.name), "the failed step committed nothing"
            trainer.train_step(step_input(cfg, step))   # step 4: the retry
    finally:
        trainer.shutdown()
    assert_same_final_state(final_state(migrated_db, object_store, cfg.name, tmp_path), want)
    assert sorted(step_metrics(migrated_db, cfg.name)) == list(range(1, STEPS + 1))   # each step once
    assert_replayed(step_metrics(migrated_db, cfg.name)[4], version=0, steps=3)
    assert claimed_steps(migrated_db, cfg.name).count(4) == GROUPS_PER_STEP


# -- the trackers fed from this record (issue #23) ------------------------------------------------
def assert_every_step_tracked_once(db: Database, cfg: RunConfig, first: dict[TrackerName, Outcome], tmp: Path) -> None:
    """Steps 1-3 went out before the kill, step 4 was retried by a new trainer; then a tracking pass
    dies after its tracker took a batch but before the cursor moved (the batch stays pending): the
    next pass writes it again as a replay. Each tracker's own reader finds every step exactly once."""
    from tests.integration.tracking_checks import mlflow_steps, tensorboard_steps, wandb_steps  # not in the child

    everything = {"tensorboard": "idle", "mlflow": "idle", "wandb": "idle"}
    assert first == everything
    with db.begin() as s:
        assert [c.step for c in cursor_states(s, cfg.name)] == [3, 3, 3]
    for tracker in cfg.tracking:  # the pass that dies: plan, write, no completion
        with db.begin() as s:
            plan = plan_batch(s, cfg.name, tracker, max_steps=MAX_STEPS_PER_BATCH)
        assert plan is not None and (plan.first_step, plan.last_step) == (4, STEPS)
        open_sink(tracker, cfg.name, cfg.trackers).write(read_batch(db, cfg.name, plan), replay=False)
    assert catch_up_run(db, cfg) == everything
    tensorboard = tensorboard_steps(tmp / "tb" / cfg.name)
    mlflow = mlflow_steps(cfg.trackers.mlflow.tracking_uri, cfg.trackers.mlflow.experiment, cfg.name)
    wandb = wandb_steps(tmp / "wandb", cfg.name)
    every_step = list(range(1, STEPS + 1))
    for logged in (tensorboard, mlflow, wandb):
        for tag in ("train/loss", "train/reward_mean", "train/entropy", "train/kl_sampler", "reward/p50",
                    "train/tokens_per_s", "phase/claim_s", "phase/engine_s"):
            assert logged[tag] == every_step, (tag, logged[tag])
        # all the groups came from version 0: step k trains on data k - 1 steps stale, all of it
        assert {tag: steps for tag, steps in logged.items() if tag.startswith("staleness/share_")} == \
            {f"staleness/share_{k - 1}": [k] for k in every_step}
        assert all(len(steps) == len(set(steps)) for steps in logged.values()), "a point logged twice"
    with db.begin() as s:
        assert [(c.step, c.error) for c in cursor_states(s, cfg.name)] == [(STEPS, None)] * 3


def assert_unreachable_tracker_reported(db: Database, cfg: RunConfig, first: dict[TrackerName, Outcome]) -> None:
    """An MLflow server that is not there: every step still commits, the tracker's cursor says what it
    lacks and why, `failures` has one row for the outage (not one per retry), run status warns."""
    assert first == {"mlflow": "failed"}
    assert catch_up_run(db, cfg) == {"mlflow": "failed"}
    with db.begin() as s:
        assert s.execute(sa.text("select max(step) from train_steps where run_id = :r"), {"r": cfg.name}).scalar() \
            == STEPS
        failures = s.execute(sa.text("select message from failures where run_id = :r and kind = 'tracking'"),
                             {"r": cfg.name}).scalars().all()
        [(line, warning)] = tracker_lines(s, cfg.name)
    assert len(failures) == 1 and "tracker mlflow failed" in failures[0]
    assert warning and line.startswith("mlflow: NOT RECEIVING since") and f"at step 0 of {STEPS}" in line


# -- the child process ----------------------------------------------------------------------------
@contextmanager
def trainer_process(cfg: RunConfig, steps: range, work: Path, env: dict[str, str], pause_in: int | None = None,
                    pause_after_updates: int | None = None) -> Iterator[subprocess.Popen]:
    """A child running `run_steps` in its own process group (so one killpg takes its ranks too);
    whatever is left of the group is killed on exit. Its stderr goes to work/stderr.log."""
    work.mkdir(parents=True)
    args = json.dumps({"run": cfg.name, "first": steps.start, "last": steps.stop - 1, "pause_in": pause_in,
                       "pause_after_updates": pause_after_updates, "work": str(work / "trainer")})
    with open(work / "stderr.log", "w") as stderr:
        proc = subprocess.Popen([sys.executable, __file__, args], stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env=env, start_new_session=True)
        try:
            yield proc
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def _read_until(proc: subprocess.Popen, marker: str) -> bool:
    assert proc.stdout is not None
    return any(line.strip() == marker for line in proc.stdout)


def child_main() -> None:
    """The child process (this file run as a script): run the steps named in argv[1] (JSON)
    against the session's stack."""
    args = json.loads(sys.argv[1])
    ep = Endpoints(**json.loads(os.environ["RLPIPE_TEST_ENDPOINTS"]))
    db = Database(ep.database_url)
    trainer = Trainer(db, ObjectStore.from_endpoints(ep), RunContexts(db), Path(args["work"]),
                      background_uploads=True)
    with db.begin() as s:
        cfg = RunConfig.model_validate(s.execute(sa.text("select config from runs where id = :r"),
                                                 {"r": args["run"]}).scalar())
    try:
        run_steps(trainer, cfg, range(args["first"], args["last"] + 1), pause_in=args["pause_in"],
                  pause_after_updates=args["pause_after_updates"])
    finally:
        trainer.shutdown()


if __name__ == "__main__":
    child_main()
