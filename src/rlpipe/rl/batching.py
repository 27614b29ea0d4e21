"""Splitting a step's global batch over data-parallel ranks and micro-batches.

Order of operations (the denominator protocol of rl/losses.py), all done by `plan_step`:
1) advantages over the whole global batch (`assign_advantages`): batch_whitened needs the whole
   batch; the group estimators give the same values wherever they run;
2) `GlobalStats` over the whole global batch (`global_stats`);
3) the split: whole groups per rank (`shard_by_rank`), then micro-batches per rank, by count
   (`split_by_count`) or by a padded-token budget (`pack_by_tokens`);
4) collation of every micro-batch with the SAME `GlobalStats`.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from rlpipe.rl.advantages import compute_advantages
from rlpipe.rl.batch import GlobalStats, Sample, TrainBatch, collate
from rlpipe.schemas.algorithm import AdvantageConfig, BatchConfig, LossConfig


@dataclass(frozen=True)
class StepPlan:
    """A global batch ready for one optimisation step."""

    stats: GlobalStats
    shards: list[list[TrainBatch]]  # [rank][micro-batch]; every rank has at least one micro-batch


def assign_advantages(samples: Sequence[Sample], cfg: AdvantageConfig) -> list[Sample]:
    """The samples with `advantage` computed by `cfg.kind` over exactly these samples (the global batch)."""
    adv = compute_advantages([s.reward for s in samples], [s.group_id for s in samples], cfg)  # (N,)
    return [replace(s, advantage=float(a)) for s, a in zip(samples, adv.tolist(), strict=True)]


def global_stats(
    samples: Sequence[Sample], *, world_size: int, max_completion_tokens: int | None = None
) -> GlobalStats:
    """The step's denominators, counted over the whole global batch before any split."""
    return GlobalStats(
        num_loss_tokens=sum(s.num_loss_tokens for s in samples),
        num_sequences=sum(1 for s in samples if s.num_loss_tokens > 0),
        max_completion_tokens=max_completion_tokens or max((len(s.completion_ids) for s in samples), default=1),
        world_size=world_size,
    )


def per_micro_batch_stats(micro_batch: Sequence[Sample], *, num_micro_batches: int, world_size: int) -> GlobalStats:
    """THE WRONG PROTOCOL, kept to show why it is wrong (tests, benchmarks/ablation_denominators.py):
    each micro-batch takes its own mean, gradient accumulation divides by the number of
    micro-batches and DDP averages over ranks, so every count is local x micro-batches x ranks."""
    local = global_stats(micro_batch, world_size=world_size)
    scale = num_micro_batches * world_size
    return replace(local, num_loss_tokens=local.num_loss_tokens * scale, num_sequences=local.num_sequences * scale)


def shard_by_rank(samples: Sequence[Sample], world_size: int) -> list[list[Sample]]:
    """Data-parallel shards, balanced by tokens: whole groups per rank when there are at least as
    many groups as ranks (largest group first onto the lightest rank), single sequences otherwise."""
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    units = list(groups.values()) if len(groups) >= world_size else [[s] for s in samples]
    shards: list[list[Sample]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for unit in sorted(units, key=lambda u: -sum(s.num_tokens for s in u)):  # stable: ties keep input order
        rank = min(range(world_size), key=lambda r: (load[r], r))
        shards[rank].extend(unit)
        load[rank] += sum(s.num_tokens for s in unit)
    return shards


def split_by_count(samples: Sequence[Sample], num_micro_batches: int) -> list[list[Sample]]:
    """`num_micro_batches` contiguous pieces whose sizes differ by at most one (some may be empty)."""
    base, extra = divmod(len(samples), num_micro_batches)
    pieces, start = [], 0
    for i in range(num_micro_batches):
        size = base + (1 if i < extra else 0)
        pieces.append(list(samples[start : start + size]))
        start += size
    return pieces


def pack_by_tokens(samples: Sequence[Sample], max_tokens: int) -> list[list[Sample]]:
    """First-fit decreasing into micro-batches of at most `max_tokens` padded tokens (rows x longest
    row); a sequence longer than the budget gets a micro-batch of its own. Never returns no batch."""
    bins: list[list[Sample]] = []
    for s in sorted(samples, key=lambda s: -s.num_tokens):   # each bin's first sample is its longest
        for b in bins:
            if (len(b) + 1) * b[0].num_tokens <= max_tokens:
                b.append(s)
                break
        else:
            bins.append([s])
    return bins or [[]]


def plan_step(
    samples: Sequence[Sample],
    *,
    advantage: AdvantageConfig,
    loss: LossConfig,
    batch: BatchConfig,
    pad_token_id: int,
    dtype: torch.dtype = torch.float32,
) -> StepPlan:
    """Advantages and denominators over the whole global batch, then the split and collation."""
    return _plan(assign_advantages(samples, advantage), loss=loss, batch=batch, pad_token_id=pad_token_id, dtype=dtype)


def plan_updates(
    samples: Sequence[Sample],
    *,
    advantage: AdvantageConfig,
    loss: LossConfig,
    batch: BatchConfig,
    pad_token_id: int,
    dtype: torch.dtype = torch.float32,
) -> list[StepPlan]:
    """One plan per optimiser step of a pass (`batch.mini_batches`): advantages over the whole
    batch first, then mini-batches of whole groups balanced by tokens, each with its own
    denominators (each is the global batch of its update)."""
    samples = assign_advantages(samples, advantage)
    parts = shard_by_rank(samples, batch.mini_batches)   # the same balanced cut as the ranks' shards
    return [_plan(part, loss=loss, batch=batch, pad_token_id=pad_token_id, dtype=dtype) for part in parts if part]


def _plan(
    samples: Sequence[Sample], *, loss: LossConfig, batch: BatchConfig, pad_token_id: int, dtype: torch.dtype
) -> StepPlan:
    """Denominators over `samples` (advantages assigned), then the split over ranks and micro-batches."""
    stats = global_stats(samples, world_size=batch.world_size, max_completion_tokens=loss.max_completion_tokens)
    shards = []
    for shard in shard_by_rank(samples, batch.world_size):
        if batch.split == "count":
            pieces = split_by_count(shard, batch.micro_batches)
        else:
            pieces = pack_by_tokens(shard, batch.micro_batch_tokens)
        shards.append([collate(p, stats, pad_token_id=pad_token_id, dtype=dtype) for p in pieces])
    return StepPlan(stats=stats, shards=shards)
