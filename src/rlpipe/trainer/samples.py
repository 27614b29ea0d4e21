"""Stored trajectories -> the trainer's `Sample`s, and the per-step statistics of a batch."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from rlpipe.rl.batch import Sample
from rlpipe.rl.batching import StepPlan
from rlpipe.schemas.tables import Trajectory


def to_samples(rows: Sequence[Trajectory]) -> list[Sample]:
    """One Sample per completed trajectory (the group id keeps the samples of a prompt together)."""
    return [Sample(prompt_ids=list(t.prompt_ids or []), completion_ids=list(t.completion_ids or []),
                   loss_mask=list(t.loss_mask or []), sampler_logprobs=list(t.sampler_logprobs or []),
                   reward=float(t.reward if t.reward is not None else 0.0), group_id=str(t.group_id),
                   policy_version=int(t.policy_version or 0))
            for t in rows if t.completion_ids]


def staleness(samples: Sequence[Sample], step: int, version_steps: dict[int, int]) -> list[int]:
    """Optimiser steps between the weights that generated each sample and the weights `step` starts
    from (which have step - 1 steps)."""
    return [(step - 1) - version_steps[s.policy_version] for s in samples]


def batch_metrics(samples: Sequence[Sample], plan: StepPlan, stale: Sequence[int]) -> dict[str, float]:
    """What the step trained on: rewards, lengths, freshness and how the batch was split."""
    rewards = [s.reward for s in samples]
    return {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "response_length_mean": statistics.fmean(s.num_loss_tokens for s in samples),
        "staleness_mean": statistics.fmean(stale),
        "staleness_max": float(max(stale)),
        "stale_frac": sum(1 for x in stale if x > 0) / len(stale),   # trained off-policy (staleness > 0)
        "world_size": float(len(plan.shards)),
        "micro_batches": float(sum(len(shard) for shard in plan.shards)),   # over all ranks
    }
