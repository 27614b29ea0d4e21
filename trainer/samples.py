"""Stored trajectories -> the trainer's `Sample`s, and the staleness of each."""

from __future__ import annotations

from collections.abc import Sequence

from rl.batch import Sample
from schemas.tables import Trajectory


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
