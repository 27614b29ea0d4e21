"""Stored trajectories -> the trainer's `Sample`s, and the per-step statistics of a batch."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from rlpipe.rl.batch import Sample
from rlpipe.rl.batching import StepPlan
from rlpipe.schemas.tables import Trajectory

TRUNCATED = "length"
"""The finish_reason of a completion cut off at the token limit."""


def to_samples(rows: Sequence[Trajectory], *, mask_truncated: bool = False) -> list[Sample]:
    """One Sample per completed trajectory (the group id keeps the samples of a prompt together);
    with `mask_truncated`, a truncated one keeps its tokens but no loss tokens (loss.mask_truncated)."""
    return [Sample(prompt_ids=list(t.prompt_ids or []), completion_ids=list(t.completion_ids or []),
                   loss_mask=[0] * len(t.loss_mask or []) if mask_truncated and t.finish_reason == TRUNCATED
                   else list(t.loss_mask or []),
                   sampler_logprobs=list(t.sampler_logprobs or []),
                   reward=float(t.reward if t.reward is not None else 0.0), group_id=str(t.group_id),
                   policy_version=int(t.policy_version or 0))
            for t in _trained(rows)]


def trajectory_metrics(rows: Sequence[Trajectory]) -> dict[str, float]:
    """What the step's trajectories were as sampled, whatever the loss leaves out of them."""
    trained = _trained(rows)
    return {
        "response_length_mean": statistics.fmean(sum(t.loss_mask or []) for t in trained),   # model tokens
        "truncated_frac": sum(1 for t in trained if t.finish_reason == TRUNCATED) / len(trained),
    }


def _trained(rows: Sequence[Trajectory]) -> list[Trajectory]:
    return [t for t in rows if t.completion_ids]


def staleness(samples: Sequence[Sample], step: int, version_steps: dict[int, int]) -> list[int]:
    """Optimiser steps between the weights that generated each sample and the weights `step` starts
    from (which have step - 1 steps)."""
    return [(step - 1) - version_steps[s.policy_version] for s in samples]


def batch_metrics(samples: Sequence[Sample], updates: Sequence[StepPlan], stale: Sequence[int]) -> dict[str, float]:
    """What the step trained on: rewards, freshness and how the batch was split (per pass)."""
    rewards = [s.reward for s in samples]
    return {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "staleness_mean": statistics.fmean(stale),
        "staleness_max": float(max(stale)),
        "stale_frac": sum(1 for x in stale if x > 0) / len(stale),   # trained off-policy (staleness > 0)
        "world_size": float(len(updates[0].shards)),
        "mini_batches": float(len(updates)),
        "micro_batches": float(sum(len(shard) for plan in updates for shard in plan.shards)),   # all ranks
    }
