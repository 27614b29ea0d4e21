"""The denominator protocol: any split over ranks and micro-batches gives the full-batch gradient.

For every aggregation mode, the gradient of one step is computed (a) in one process on the whole
batch, (b) with 1, 2 and 4 micro-batches, (c) on two gloo ranks with 1, 2 and 4 micro-batches each.
(b) and (c) must equal (a) to 1e-6 relative; the same splits with per-micro-batch / per-rank
denominators (the wrong protocol) must not. The batch has unequal lengths, masked tool tokens,
a partial group, a group with constant rewards and a sequence that is all tool tokens.
"""

import copy
import functools
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import get_args

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlpipe.rl.batch import GlobalStats, Sample, TrainBatch, collate
from rlpipe.rl.batching import (
    assign_advantages,
    global_stats,
    pack_by_tokens,
    per_micro_batch_stats,
    plan_step,
    plan_updates,
    shard_by_rank,
    split_by_count,
)
from rlpipe.rl.distributed import DataParallelGroup
from rlpipe.rl.losses import aggregate
from rlpipe.rl.step import (
    accumulate_gradients,
    completion_logprobs,
    train_step,
    train_updates,
    with_proximal_logprobs,
)
from rlpipe.schemas.algorithm import AdvantageConfig, Aggregation, BatchConfig, LossConfig

AGGREGATIONS: tuple[Aggregation, ...] = get_args(Aggregation)
ADVANTAGE = AdvantageConfig(kind="grpo")
F64 = torch.float64
TINY = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


OBJECTIVES: dict[str, dict[str, object]] = {
    "ppo_clip": {"clip_high": 0.28},
    "gspo": {"ratio_level": "sequence", "clip_low": 0.05, "clip_high": 0.05},
    "cispo": {"policy_loss": "cispo", "cispo_cap": 1.2},
    "ppo_clip_kl_is": {"clip_high": 0.28, "kl_is_correction": True},
}
"""Each policy-gradient objective, with clips and caps that some tokens or sequences of the batch reach
(and the KL penalty reweighted by the importance ratio)."""
SEQUENCE_WEIGHTS: dict[str, dict[str, object]] = {
    mode: {"clip_high": 0.28, "off_policy": mode, "tis_cap": 1.5, "tis_floor": 0.5}
    for mode in ("sequence_truncate", "sequence_mask")
}
"""The sequence-level importance weights; the noisy sampler puts some sequences above the cap and
some below the floor."""


def loss_config(aggregation: Aggregation, objective: str = "ppo_clip") -> LossConfig:
    """Every term on: the objective (the sampler logprobs are noisy, so some tokens clip), KL, entropy."""
    return LossConfig.model_validate({"aggregation": aggregation, "kl_coef": 0.05, "entropy_coef": 0.01,
                                      **(OBJECTIVES | SEQUENCE_WEIGHTS)[objective]})


# --- the protocol on plain tensors ------------------------------------------------------------


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize(("world_size", "micro_batches"), [(1, 3), (2, 1), (2, 2), (3, 2)])
def test_shares_sum_to_the_full_batch_value(mode: Aggregation, world_size: int, micro_batches: int) -> None:
    g = torch.Generator().manual_seed(world_size * 10 + micro_batches)
    values = torch.randn(11, 7, generator=g, dtype=F64)                     # (N, L)
    mask = (torch.rand(11, 7, generator=g) < 0.6).to(F64)                   # (N, L)
    mask[3] = 0.0                                                           # a sequence of tool tokens only
    lengths = mask.sum(-1)
    stats = GlobalStats(int(mask.sum()), int((lengths > 0).sum()), 7, world_size)
    full = aggregate(values, mask, mode, GlobalStats(stats.num_loss_tokens, stats.num_sequences, 7, 1))
    rows = torch.randperm(11, generator=g).tensor_split(world_size * micro_batches)   # uneven pieces
    right = sum(aggregate(values[r], mask[r], mode, stats) for r in rows) / world_size  # ranks average
    assert right.item() == pytest.approx(full.item(), rel=1e-12)
    wrong = sum(
        aggregate(values[r], mask[r], mode, GlobalStats(
            int(mask[r].sum()) * len(rows), int((lengths[r] > 0).sum()) * len(rows),
            7, world_size))
        for r in rows) / world_size
    assert wrong.item() != pytest.approx(full.item(), rel=1e-3)


# --- a tiny model and a hand-made batch -------------------------------------------------------

# (group, prompt length, completion length, tool-token positions, reward)
BATCH_SPEC = [
    ("a", 3, 5, {2}, 1.0), ("a", 3, 9, {4, 5}, 0.0), ("a", 3, 2, set(), 0.5),      # partial group of 3
    ("b", 6, 7, {0}, 1.0), ("b", 6, 3, set(), 1.0),                               # constant rewards: A = 0
    ("c", 2, 11, {3, 4, 5, 6}, 0.0), ("c", 2, 4, {0, 1, 2, 3}, 1.0), ("c", 2, 6, {1}, 0.0),  # 2nd: tools only
]


def save_tiny_llama(path: Path, seed: int) -> None:
    torch.manual_seed(seed)
    LlamaForCausalLM._from_config(TINY, dtype=F64).save_pretrained(path)


def load_tiny_llama(path: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(path, dtype=F64)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(root / "policy", seed=0)
    save_tiny_llama(root / "reference", seed=1)
    return root / "policy", root / "reference"


@pytest.fixture(scope="module")
def policy(model_dirs: tuple[Path, Path]) -> LlamaForCausalLM:
    return load_tiny_llama(model_dirs[0])


@pytest.fixture(scope="module")
def reference(model_dirs: tuple[Path, Path]) -> LlamaForCausalLM:
    return load_tiny_llama(model_dirs[1]).requires_grad_(False)


@pytest.fixture(scope="module")
def samples(policy: LlamaForCausalLM) -> list[Sample]:
    """The batch, with sampler logprobs = the policy's own plus noise (a stale, mismatched sampler);
    the sampler reports nothing for tool tokens (nan), which must never reach the loss."""
    g = torch.Generator().manual_seed(7)
    prompts = {grp: torch.randint(1, 64, (p,), generator=g).tolist() for grp, p, *_ in BATCH_SPEC}
    drafts = [
        Sample(prompts[grp], torch.randint(1, 64, (c,), generator=g).tolist(),
               [0 if i in tool else 1 for i in range(c)], [0.0] * c, reward, grp, 0)
        for grp, _, c, tool, reward in BATCH_SPEC
    ]
    batch = collate(drafts, global_stats(drafts, world_size=1), pad_token_id=0, dtype=F64)
    with torch.no_grad():
        logprobs, _ = completion_logprobs(policy, batch)                     # (N, L)
    noisy = logprobs + 0.15 * torch.randn(logprobs.shape, generator=g, dtype=F64)
    out = []
    for i, s in enumerate(drafts):
        row = noisy[i, : len(s.completion_ids)].tolist()
        lp = [v if m else math.nan for v, m in zip(row, s.loss_mask, strict=True)]
        out.append(Sample(s.prompt_ids, s.completion_ids, s.loss_mask, lp, s.reward, s.group_id, s.policy_version))
    return out


def plan(samples: Sequence[Sample], loss: LossConfig, batch: BatchConfig) -> list[list[TrainBatch]]:
    return plan_step(samples, advantage=ADVANTAGE, loss=loss, batch=batch, pad_token_id=0, dtype=F64).shards


def wrong_plan(samples: Sequence[Sample], world_size: int, micro_batches: int) -> list[list[TrainBatch]]:
    """The same split as `plan`, but every micro-batch normalised by its own counts."""
    shards = shard_by_rank(assign_advantages(samples, ADVANTAGE), world_size)
    return [
        [collate(p, per_micro_batch_stats(p, num_micro_batches=micro_batches, world_size=world_size),
                 pad_token_id=0, dtype=F64) for p in split_by_count(shard, micro_batches)]
        for shard in shards
    ]


def gradient(
    model: LlamaForCausalLM, micro_batches: Sequence[TrainBatch], loss: LossConfig, ref: LlamaForCausalLM
) -> torch.Tensor:
    """The accumulated gradient of one rank's micro-batches, flattened: (num params,)."""
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, micro_batches, loss, ref)
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("objective", OBJECTIVES | SEQUENCE_WEIGHTS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_give_the_full_batch_gradient(
    policy: LlamaForCausalLM, reference: LlamaForCausalLM, samples: list[Sample], aggregation: Aggregation,
    objective: str,
) -> None:
    loss = loss_config(aggregation, objective)
    (whole,) = plan(samples, loss, BatchConfig())
    assert len(whole) == 1
    full = gradient(policy, whole, loss, reference)
    for n in (1, 2, 4):
        (shard,) = plan(samples, loss, BatchConfig(micro_batches=n))
        assert relative_error(gradient(policy, shard, loss, reference), full) < 1e-6, n
        if n > 1:
            (wrong,) = wrong_plan(samples, 1, n)
            assert relative_error(gradient(policy, wrong, loss, reference), full) > 1e-3, n
    (packed,) = plan(samples, loss, BatchConfig(split="tokens", micro_batch_tokens=40))
    assert len(packed) > 2
    assert relative_error(gradient(policy, packed, loss, reference), full) < 1e-6


def whole_batch_metrics(policy: LlamaForCausalLM, reference: LlamaForCausalLM, samples: list[Sample],
                        objective: str) -> dict[str, float]:
    """The step metrics of `objective` on the whole batch, weights left as they are (lr 0)."""
    loss = loss_config("token_mean", objective)
    (whole,) = plan(samples, loss, BatchConfig())
    return train_step(policy, torch.optim.SGD(policy.parameters(), lr=0.0), whole, loss, grad_clip=None,
                      ref_model=reference)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_each_objectives_clip_acts_on_part_of_the_batch(
    policy: LlamaForCausalLM, reference: LlamaForCausalLM, samples: list[Sample], objective: str
) -> None:
    """So that the split tests above cover both branches of every clip or cap."""
    metrics = whole_batch_metrics(policy, reference, samples, objective)
    assert 0.0 < metrics["clip_frac"] < 1.0 and 0.0 < metrics["clip_seq_frac"] < 1.0, metrics


@pytest.mark.parametrize("objective", SEQUENCE_WEIGHTS)
def test_each_sequence_weights_cap_acts_on_part_of_the_batch(
    policy: LlamaForCausalLM, reference: LlamaForCausalLM, samples: list[Sample], objective: str
) -> None:
    metrics = whole_batch_metrics(policy, reference, samples, objective)
    assert 0.0 < metrics["is_capped_frac"] < 1.0, metrics


@pytest.fixture(scope="module")
def two_ranks(model_dirs: tuple[Path, Path]) -> Iterator[DataParallelGroup]:
    """Two gloo ranks with SGD(lr=1): the update of a step is minus the averaged gradient."""
    with DataParallelGroup(
        2,
        functools.partial(LlamaForCausalLM.from_pretrained, model_dirs[0], dtype=F64),  # pickles by reference
        functools.partial(torch.optim.SGD, lr=1.0),
        ref_model_fn=functools.partial(LlamaForCausalLM.from_pretrained, model_dirs[1], dtype=F64),
        timeout_s=120,
    ) as group:
        yield group


def data_parallel_gradient(
    group: DataParallelGroup, policy: LlamaForCausalLM, shards: Sequence[Sequence[TrainBatch]], loss: LossConfig
) -> torch.Tensor:
    """Reset the ranks to `policy`, take one SGD(lr=1) step, read the gradient off the update."""
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    group.load_state_dict(before)
    group.step(shards, loss, grad_clip=None)
    after = group.state_dict()
    return torch.cat([(before[name] - after[name]).reshape(-1) for name, _ in policy.named_parameters()])


@pytest.mark.parametrize("objective", OBJECTIVES | SEQUENCE_WEIGHTS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_two_ranks_give_the_full_batch_gradient(
    two_ranks: DataParallelGroup,
    policy: LlamaForCausalLM,
    reference: LlamaForCausalLM,
    samples: list[Sample],
    aggregation: Aggregation,
    objective: str,
) -> None:
    loss = loss_config(aggregation, objective)
    (whole,) = plan(samples, loss, BatchConfig())
    full = gradient(policy, whole, loss, reference)
    for n in (1, 2, 4):
        shards = plan(samples, loss, BatchConfig(world_size=2, micro_batches=n))
        assert relative_error(data_parallel_gradient(two_ranks, policy, shards, loss), full) < 1e-6, n
        wrong = wrong_plan(samples, 2, n)
        assert relative_error(data_parallel_gradient(two_ranks, policy, wrong, loss), full) > 1e-3, n


def test_two_ranks_report_the_single_process_metrics(
    two_ranks: DataParallelGroup, policy: LlamaForCausalLM, reference: LlamaForCausalLM, samples: list[Sample]
) -> None:
    """Metric totals are all-reduced (sums, max, min) before they are divided by the global counts."""
    loss = loss_config("seq_mean_token_mean")
    (whole,) = plan(samples, loss, BatchConfig())
    frozen = torch.optim.SGD(policy.parameters(), lr=0.0)
    single = train_step(policy, frozen, whole, loss, grad_clip=None, ref_model=reference)
    two_ranks.load_state_dict(policy.state_dict())
    both = two_ranks.step(plan(samples, loss, BatchConfig(world_size=2, micro_batches=2)), loss, grad_clip=None)
    assert both.keys() == single.keys()
    for key, value in single.items():
        assert both[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert single["clip_frac"] > 0 and single["kl_ref"] > 0 and single["num_sequences"] == len(samples)


# --- the split itself -------------------------------------------------------------------------


def test_shards_keep_groups_whole_and_balance_tokens(samples: list[Sample]) -> None:
    shards = shard_by_rank(samples, 2)
    groups = [{s.group_id for s in shard} for shard in shards]
    assert not groups[0] & groups[1]
    assert sorted(id(s) for shard in shards for s in shard) == sorted(id(s) for s in samples)
    # group tokens: c 13+6+8 = 27 -> rank 0, a 8+12+5 = 25 -> rank 1, b 13+9 = 22 -> the lighter, rank 1
    assert [sum(s.num_tokens for s in shard) for shard in shards] == [27, 47]


def test_fewer_groups_than_ranks_splits_groups(samples: list[Sample]) -> None:
    shards = shard_by_rank(samples, 4)
    assert all(shards) and sum(len(s) for s in shards) == len(samples)


def test_split_by_count_and_pack_by_tokens(samples: list[Sample]) -> None:
    assert [len(p) for p in split_by_count(samples, 3)] == [3, 3, 2]
    assert [len(p) for p in split_by_count(samples[:2], 4)] == [1, 1, 0, 0]
    packed = pack_by_tokens(samples, 30)
    assert sorted(id(s) for p in packed for s in p) == sorted(id(s) for s in samples)
    assert all(len(p) * max(s.num_tokens for s in p) <= 30 or len(p) == 1 for p in packed)
    assert pack_by_tokens([], 30) == [[]]


def test_plan_counts_once_and_shares_the_counts(samples: list[Sample]) -> None:
    loss = LossConfig(aggregation="constant_normalizer", max_completion_tokens=16)
    shards = plan(samples, loss, BatchConfig(world_size=2, micro_batches=4))
    expected = GlobalStats(num_loss_tokens=34, num_sequences=7, max_completion_tokens=16, world_size=2)
    assert all(mb.stats == expected for shard in shards for mb in shard)
    assert global_stats(samples, world_size=2).max_completion_tokens == 11
    assert sum(mb.num_sequences for shard in shards for mb in shard) == 8


# --- several optimiser steps per batch (mini-batches x epochs) ---------------------------------------


def test_mini_batches_are_whole_groups_with_the_whole_batchs_advantages(samples: list[Sample]) -> None:
    whitened = AdvantageConfig(kind="batch_whitened")   # the estimator that depends on the whole batch
    loss = LossConfig()
    (whole,) = plan_updates(samples, advantage=whitened, loss=loss, batch=BatchConfig(), pad_token_id=0, dtype=F64)
    updates = plan_updates(samples, advantage=whitened, loss=loss, batch=BatchConfig(mini_batches=2), pad_token_id=0,
                           dtype=F64)
    assert len(updates) == 2
    advantages = sorted(a for plan in updates for mb in plan.shards[0] for a in mb.advantages.tolist())
    assert advantages == pytest.approx(sorted(whole.shards[0][0].advantages.tolist()), rel=1e-12)
    # each update is a global batch of its own: its denominators count only its samples
    assert sum(plan.stats.num_loss_tokens for plan in updates) == whole.stats.num_loss_tokens
    assert sum(plan.stats.num_sequences for plan in updates) == whole.stats.num_sequences


def flat_weights(model: LlamaForCausalLM) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("off_policy", ["none", "decoupled"])
def test_epochs_and_mini_batches_on_two_ranks_equal_one_process(
    two_ranks: DataParallelGroup, policy: LlamaForCausalLM, reference: LlamaForCausalLM, samples: list[Sample],
    off_policy: str,
) -> None:
    loss = LossConfig.model_validate({"off_policy": off_policy, "clip_high": 0.28, "kl_coef": 0.05})
    epochs, one_rank, two = 2, BatchConfig(mini_batches=2, micro_batches=2), \
        BatchConfig(world_size=2, mini_batches=2, micro_batches=2)
    local = copy.deepcopy(policy)
    single = train_updates(local, torch.optim.SGD(local.parameters(), lr=1.0),
                           [p.shards[0] for p in plan_updates(samples, advantage=ADVANTAGE, loss=loss, batch=one_rank,
                                                              pad_token_id=0, dtype=F64)],
                           loss, epochs=epochs, grad_clip=None, ref_model=reference)
    two_ranks.load_state_dict(policy.state_dict())
    both = two_ranks.train([p.shards for p in plan_updates(samples, advantage=ADVANTAGE, loss=loss, batch=two,
                                                           pad_token_id=0, dtype=F64)],
                           loss, epochs=epochs, grad_clip=None)
    after = two_ranks.state_dict()
    ranked = torch.cat([after[name].reshape(-1) for name, _ in policy.named_parameters()])
    moved = flat_weights(local) - flat_weights(policy)
    assert relative_error(ranked - flat_weights(policy), moved) < 1e-6
    assert single["optimizer_steps"] == 4 and single["num_sequences"] == len(samples)
    for key, value in single.items():
        assert both[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_the_proximal_policy_is_recorded_once_before_the_first_update(
    policy: LlamaForCausalLM, reference: LlamaForCausalLM, samples: list[Sample]
) -> None:
    """Decoupled PPO clips around the proximal policy: two epochs must anchor both passes at the
    weights from before the first update, not at the weights each pass starts from."""
    loss = LossConfig(off_policy="decoupled", clip_high=0.28)
    (plan,) = plan_updates(samples, advantage=ADVANTAGE, loss=loss, batch=BatchConfig(), pad_token_id=0, dtype=F64)
    recorded = with_proximal_logprobs(policy, plan.shards[0], loss)
    with torch.no_grad():
        before, _ = completion_logprobs(policy, plan.shards[0][0])
    assert torch.equal(recorded[0].proximal_logprobs, before)
    two_epochs, step_by_step = copy.deepcopy(policy), copy.deepcopy(policy)
    train_updates(two_epochs, torch.optim.SGD(two_epochs.parameters(), lr=1.0), [plan.shards[0]], loss, epochs=2,
                  grad_clip=None)
    sgd = torch.optim.SGD(step_by_step.parameters(), lr=1.0)
    for _ in range(2):   # what a second train step on the same batch would do: proximal = its own start
        train_step(step_by_step, sgd, plan.shards[0], loss, grad_clip=None)
    moved = flat_weights(two_epochs) - flat_weights(policy)
    assert relative_error(flat_weights(step_by_step) - flat_weights(policy), moved) > 1e-3
