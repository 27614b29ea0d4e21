"""Whole training runs through Temporal with a data-parallel trainer, on the real stack (Temporal,
Postgres, SeaweedFS, a vLLM server with the tiny model, the worker processes): 2 gloo ranks with 2
micro-batches each and a KL penalty (so the ranks also hold the frozen reference), forked by the
trainer worker; and 2 ranks launched by two torchrun agents started apart, as on two hosts."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from temporalio.client import Client

from rlpipe.infra.stack import Stack
from rlpipe.storage.db import Database
from rlpipe.workers.launcher import WorkerSet
from tests.conftest import free_port_block
from tests.integration.runs import assert_audit_trail, rows, run_to_end, tiny_config

pytestmark = [pytest.mark.stack, pytest.mark.vllm, pytest.mark.usefixtures("clean_workflows")]

STEP_METRICS = ("loss", "entropy", "kl_sampler", "kl_ref", "mismatch", "clip_frac", "is_weight_mean",
                "is_weight_max", "is_weight_min", "is_capped_frac", "grad_norm", "adv_mean", "adv_std", "adv_max",
                "adv_min", "reward_mean", "staleness_mean", "staleness_max", "claim_s", "restore_s", "train_s",
                "publish_s")
"""What every step records in train_steps.metrics (publish_s: every step publishes at sync interval 1)."""


async def test_a_data_parallel_run_completes_and_records_its_step_metrics(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = tiny_config(tiny_model, steps=2, batch={"world_size": 2, "micro_batches": 2}, loss={"kl_coef": 0.01})
    result = await run_to_end(temporal_client, cfg)
    assert result.steps == cfg.steps
    # versions, claims and syncs as in every run; each version was published from rank 0's weights and
    # probed there, and the server matched that probe after its sync
    assert_audit_trail(migrated_db, cfg)
    steps = rows(migrated_db, "select step, n_trajectories, entropy, kl_sampler, grad_norm, metrics "
                              "from train_steps where run_id = :r order by step", r=cfg.name)
    for x in steps:
        assert x.n_trajectories == cfg.rollout.groups_per_step * cfg.rollout.group_size
        assert (x.metrics["world_size"], x.metrics["micro_batches"]) == (2, 4)
        assert all(math.isfinite(x.metrics[k]) for k in STEP_METRICS), x.metrics
        assert (x.entropy, x.kl_sampler, x.grad_norm) == (x.metrics["entropy"], x.metrics["kl_sampler"],
                                                          x.metrics["grad_norm"])
        # grad_norm may be exactly 0: a batch whose groups all have equal rewards has zero advantages,
        # and the KL gradient is zero while the policy still equals the reference
        assert x.metrics["kl_ref"] >= 0 and x.metrics["entropy"] > 0 and x.metrics["grad_norm"] >= 0
    if steps[0].grad_norm > 0:  # a first batch of all-equal rewards moves nothing
        assert steps[1].metrics["kl_ref"] > 0, "after one update the policy differs from its reference"


@contextmanager
def trainer_on_two_torchrun_hosts(stack: Stack, workers: WorkerSet) -> Iterator[Path]:
    """The pipeline's trainer worker swapped for one whose ranks torchrun launches over two "hosts"
    (this one's agent, started by the trainer, and `rlpipe worker ranks` as another host runs it);
    the usual trainer is back afterwards. Yields the torchrun trainer's log."""
    port = free_port_block(2)
    env = {"RLPIPE_TRAINER_RANKS": "torchrun", "RLPIPE_TRAINER_NNODES": "2",
           "RLPIPE_TRAINER_RENDEZVOUS": f"127.0.0.1:{port}", "RLPIPE_TRAINER_CONTROLLER_PORT": str(port + 1),
           "OMP_NUM_THREADS": "1"}   # two agents' ranks share this machine's cores
    torchrun = WorkerSet(stack.settings, env=env)
    workers.down(only=["trainer"], progress=lambda msg: None)
    other_host = subprocess.Popen([str(Path(sys.executable).parent / "rlpipe"), "worker", "ranks", "--per-host", "1"],
                                  env={**os.environ, **env}, start_new_session=True,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        torchrun.up(only=["trainer"], progress=lambda msg: None)
        yield torchrun.log("trainer")
    finally:
        os.killpg(other_host.pid, signal.SIGKILL)   # the join loop, its agent and the agent's rank
        other_host.wait()
        torchrun.down(only=["trainer"], progress=lambda msg: None)
        workers.up(only=["trainer"], progress=lambda msg: None)


async def test_a_run_on_ranks_two_torchrun_agents_launched_completes_with_verified_syncs(
        temporal_client: Client, stack: Stack, pipeline_workers: WorkerSet, migrated_db: Database,
        tiny_model: Path) -> None:
    cfg = tiny_config(tiny_model, steps=2, batch={"world_size": 2})
    with trainer_on_two_torchrun_hosts(stack, pipeline_workers) as trainer_log:
        result = await run_to_end(temporal_client, cfg)
        log = trainer_log.read_text(errors="replace")
    assert result.steps == cfg.steps
    assert_audit_trail(migrated_db, cfg)   # every version verified on the server, and each step committed once
    assert "launched by torchrun over 2 host(s)" in log, log[-2000:]
    steps = rows(migrated_db, "select metrics from train_steps where run_id = :r", r=cfg.name)
    assert [x.metrics["world_size"] for x in steps] == [2, 2]
