"""A whole training run through Temporal with a data-parallel trainer: 2 gloo ranks with 2
micro-batches each and a KL penalty (so the ranks also hold the frozen reference), on the real
stack (Temporal, Postgres, SeaweedFS, a vLLM server with the tiny model, the worker processes)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from temporalio.client import Client

from rlpipe.storage.db import Database
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
