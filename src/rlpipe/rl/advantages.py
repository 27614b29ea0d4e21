"""Advantage estimators: one scalar reward per trajectory -> one advantage per trajectory.

Every estimator has the signature ``(rewards, group_index, eps) -> advantages`` over a flat batch:
rewards (N,) float, group_index (N,) int64 in [0, num_groups). One call handles many groups of
different sizes, so partial groups (some samples failed or were dropped as stale) need no padding.

Edge cases, chosen on purpose:
1) a group of one sample has nothing to be compared with: advantage 0 (all group estimators);
2) a group whose rewards are all equal carries no learning signal: advantage exactly 0, not the
   ~1e-11 that rounding of the mean would leave after dividing by eps;
3) a partial group uses the samples it has (its own size, mean and std);
4) std is the population std (divide by n): Bessel's n - 1 is undefined for a group of one.

Scope: the group estimators read only the group's own rewards, so every process that holds a
group computes bit-identical advantages for it. batch_whitened reads the whole batch, so it must be
called on the step's whole global batch before the split (`batching.plan_step` does).
To add an estimator, write a function with the signature above and add it to ``ADVANTAGES``.
"""

from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

from rlpipe.schemas.algorithm import AdvantageConfig, AdvantageKind, OverlongConfig

AdvantageFn = Callable[[Tensor, Tensor, float], Tensor]


def group_indices(group_ids: Sequence[Hashable]) -> Tensor:
    """Map arbitrary group ids to contiguous indices in order of first appearance: (N,) int64."""
    first_seen: dict[Hashable, int] = {}
    return torch.tensor([first_seen.setdefault(g, len(first_seen)) for g in group_ids], dtype=torch.long)


def _per_group_sum(values: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    """(N,) values -> (num_groups,) sums; index_add_ on CPU adds in sample order, so it is deterministic."""
    return torch.zeros(num_groups, dtype=values.dtype).index_add_(0, group_index, values)


def _group_mean_std(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample view of its group's (mean, population std, size), each (N,)."""
    num_groups = int(group_index.max()) + 1
    size = _per_group_sum(torch.ones_like(rewards), group_index, num_groups)          # (G,)
    mean = _per_group_sum(rewards, group_index, num_groups) / size                     # (G,)
    centred = rewards - mean[group_index]                                              # (N,)
    var = _per_group_sum(centred * centred, group_index, num_groups) / size            # (G,)
    return mean[group_index], var.sqrt()[group_index], size[group_index]


def _constant_group(rewards: Tensor, group_index: Tensor) -> Tensor:
    """(N,) bool: the sample's group has all-equal rewards (which includes groups of one)."""
    num_groups = int(group_index.max()) + 1
    empty = torch.zeros(num_groups, dtype=rewards.dtype)
    hi = empty.scatter_reduce(0, group_index, rewards, "amax", include_self=False)      # (G,)
    lo = empty.scatter_reduce(0, group_index, rewards, "amin", include_self=False)      # (G,)
    return (hi == lo)[group_index]


def grpo_advantages(rewards: Tensor, group_index: Tensor, eps: float) -> Tensor:
    """(r - group mean) / (group std + eps): (N,) -> (N,); constant groups and groups of one give 0."""
    if rewards.numel() == 0:
        return rewards.clone()
    mean, std, _ = _group_mean_std(rewards, group_index)
    adv = (rewards - mean) / (std + eps)                                               # (N,)
    return adv.masked_fill(_constant_group(rewards, group_index), 0.0)


def dr_grpo_advantages(rewards: Tensor, group_index: Tensor, eps: float) -> Tensor:
    """r - group mean: (N,) -> (N,). No std division: Dr. GRPO shows it up-weights prompts that are
    nearly always solved or failed. eps is unused (kept for the common signature)."""
    if rewards.numel() == 0:
        return rewards.clone()
    mean, _, _ = _group_mean_std(rewards, group_index)
    return (rewards - mean).masked_fill(_constant_group(rewards, group_index), 0.0)


def rloo_advantages(rewards: Tensor, group_index: Tensor, eps: float) -> Tensor:
    """r_i - mean of the group's other rewards = n / (n - 1) * (r_i - group mean): (N,) -> (N,).
    A group of one has no others: 0. eps is unused (kept for the common signature)."""
    if rewards.numel() == 0:
        return rewards.clone()
    mean, _, size = _group_mean_std(rewards, group_index)
    scale = size / (size - 1).clamp(min=1)                                             # (N,) n/(n-1)
    return (scale * (rewards - mean)).masked_fill(_constant_group(rewards, group_index), 0.0)


def batch_whitened_advantages(rewards: Tensor, group_index: Tensor, eps: float) -> Tensor:
    """(r - batch mean) / (batch std + eps) over every sample passed in: (N,) -> (N,).
    group_index is ignored: the statistics are the batch's, so pass the whole global batch.
    A batch of equal rewards gives 0."""
    if rewards.numel() == 0 or bool((rewards == rewards[0]).all()):
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean()                                                 # (N,)
    return centred / (centred.pow(2).mean().sqrt() + eps)


ADVANTAGES: dict[AdvantageKind, AdvantageFn] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "batch_whitened": batch_whitened_advantages,
}


def compute_advantages(
    rewards: Sequence[float] | Tensor, group_ids: Sequence[Hashable], cfg: AdvantageConfig
) -> Tensor:
    """Advantages for a batch of trajectories, by the estimator `cfg.kind`: (N,) float64.

    Computed in float64 so that the result does not depend on the caller's dtype.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64)                                  # (N,)
    if r.shape != (len(group_ids),):
        raise ValueError(f"rewards has shape {tuple(r.shape)} but there are {len(group_ids)} group ids")
    return ADVANTAGES[cfg.kind](r, group_indices(group_ids), cfg.std_eps)


def overlong_penalty(num_tokens: int, cfg: OverlongConfig) -> float:
    """DAPO's soft overlong punishment of a trajectory with `num_tokens` model tokens: 0 up to
    max_tokens - window, then falling linearly to -penalty at max_tokens, -penalty beyond."""
    free = cfg.max_tokens - cfg.window
    if num_tokens <= free:
        return 0.0
    return -cfg.penalty * min(num_tokens - free, cfg.window) / cfg.window


def shaped_rewards(rewards: Sequence[float], num_tokens: Sequence[int], cfg: OverlongConfig | None) -> list[float]:
    """The rewards with each trajectory's overlong penalty added (unchanged when cfg is None)."""
    if cfg is None:
        return list(rewards)
    return [r + overlong_penalty(n, cfg) for r, n in zip(rewards, num_tokens, strict=True)]


def uninformative(rewards: Sequence[float], tolerance: float = 1e-9) -> bool:
    """A group whose rewards are all equal: every group estimator gives it advantage 0 (DAPO's
    dynamic sampling drops such groups)."""
    return len(rewards) > 0 and max(rewards) - min(rewards) <= tolerance
