"""Advantage estimators against hand-computed values, their edge cases, and their scope."""

import math
import multiprocessing
from typing import get_args

import pytest
import torch

from rlpipe.rl.advantages import (
    ADVANTAGES,
    batch_whitened_advantages,
    compute_advantages,
    dr_grpo_advantages,
    group_indices,
    grpo_advantages,
    overlong_penalty,
    rloo_advantages,
    shaped_rewards,
    uninformative,
)
from rlpipe.rl.batch import Sample
from rlpipe.rl.batching import assign_advantages, plan_step, shard_by_rank
from rlpipe.schemas.algorithm import AdvantageConfig, AdvantageKind, BatchConfig, LossConfig, OverlongConfig

EPS = 1e-6


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def idx(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def test_registry_covers_every_configured_kind() -> None:
    assert set(ADVANTAGES) == set(get_args(AdvantageKind))


def test_group_indices_follow_first_appearance() -> None:
    assert group_indices(["b", "a", "b", "c", "a"]).tolist() == [0, 1, 0, 2, 1]


def test_grpo_one_group() -> None:
    # mean 0.5, population std 0.5
    adv = grpo_advantages(t(1, 0, 0, 1), idx(0, 0, 0, 0), EPS)
    expected = 0.5 / (0.5 + EPS)
    assert adv.tolist() == pytest.approx([expected, -expected, -expected, expected], rel=1e-12)


def test_grpo_groups_of_different_sizes() -> None:
    # group 0: [1, 2, 3] mean 2, std sqrt(2/3); group 1: [5] alone -> 0; group 2: [0, 1] mean .5, std .5
    adv = grpo_advantages(t(1, 2, 3, 5, 0, 1), idx(0, 0, 0, 1, 2, 2), EPS)
    s = math.sqrt(2 / 3) + EPS
    h = 0.5 / (0.5 + EPS)
    assert adv.tolist() == pytest.approx([-1 / s, 0.0, 1 / s, 0.0, -h, h], rel=1e-12, abs=1e-15)


def test_dr_grpo_subtracts_group_mean_only() -> None:
    adv = dr_grpo_advantages(t(1, 0, 0, 4, 2), idx(0, 0, 0, 1, 1), EPS)
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 1.0, -1.0], rel=1e-12)


def test_rloo_leaves_one_out() -> None:
    # group 0: 1 - mean(0, 0, 1) = 2/3; 0 - mean(0, 1, 1) = -2/3.  group 1 (partial, 2 samples): 3 - 1, 1 - 3.
    adv = rloo_advantages(t(1, 0, 0, 1, 3, 1, 7), idx(0, 0, 0, 0, 1, 1, 2), EPS)
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 2.0, -2.0, 0.0], rel=1e-12)


def test_batch_whitened_uses_batch_statistics_not_groups() -> None:
    # mean 2.5, population std sqrt(1.25), whatever the groups
    expected = [(r - 2.5) / (math.sqrt(1.25) + EPS) for r in (1, 2, 3, 4)]
    for groups in (idx(0, 0, 1, 1), idx(0, 1, 2, 3)):
        assert batch_whitened_advantages(t(1, 2, 3, 4), groups, EPS).tolist() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("kind", get_args(AdvantageKind))
def test_constant_rewards_give_exactly_zero(kind: AdvantageKind) -> None:
    # 0.1 * 3 / 3 != 0.1 in floating point: without the explicit zeroing, grpo would give ~1e-11
    adv = ADVANTAGES[kind](t(0.1, 0.1, 0.1), idx(0, 0, 0), EPS)
    assert adv.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_group_of_one_gives_zero_and_does_not_touch_others(kind: AdvantageKind) -> None:
    alone = ADVANTAGES[kind](t(0.7, 1, 0), idx(0, 1, 1), EPS)
    pair = ADVANTAGES[kind](t(1, 0), idx(0, 0), EPS)
    assert alone[0].item() == 0.0
    assert torch.equal(alone[1:], pair)


@pytest.mark.parametrize("kind", get_args(AdvantageKind))
def test_no_nan_on_edge_batches(kind: AdvantageKind) -> None:
    rewards = t(1, 1, 0.5, 2, 2, 2, 0, 1, 3)
    groups = idx(0, 0, 1, 2, 2, 2, 3, 3, 3)      # constant pair, singleton, constant triple, full group
    assert torch.isfinite(ADVANTAGES[kind](rewards, groups, EPS)).all()
    assert ADVANTAGES[kind](t(), idx(), EPS).shape == (0,)
    assert ADVANTAGES[kind](t(5.0), idx(0), EPS).tolist() == [0.0]


def test_compute_advantages_handles_interleaved_groups() -> None:
    cfg = AdvantageConfig(kind="rloo")
    adv = compute_advantages([1.0, 3.0, 0.0, 1.0], ["a", "b", "a", "b"], cfg)
    assert adv.tolist() == pytest.approx([1.0, 2.0, -1.0, -2.0], rel=1e-12)
    with pytest.raises(ValueError, match="group ids"):
        compute_advantages([1.0, 2.0], ["a"], cfg)


GROUP_A = ([0.25, 1.0, 0.0, 0.5, 0.75], ["A"] * 5)


def _replica_batch(companion: str, rewards: list[float], before: bool) -> tuple[list[float], list[str]]:
    other = (rewards, [companion] * len(rewards))
    first, second = (other, GROUP_A) if before else (GROUP_A, other)
    return first[0] + second[0], first[1] + second[1]


def test_two_replicas_compute_identical_group_advantages() -> None:
    """Two processes (data-parallel replicas: this one and a spawned one) hold the same prompt group
    among different companions and at a different position: its advantages must be identical bit for bit."""
    here, there = _replica_batch("B", [3.0, -1.0], before=False), _replica_batch("C", [0.1, 0.2, 9.0], before=True)
    in_a = [torch.tensor([g == "A" for g in ids]) for _, ids in (here, there)]
    kinds: list[AdvantageKind] = ["grpo", "dr_grpo", "rloo"]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        remote = pool.starmap(compute_advantages, [(*there, AdvantageConfig(kind=k)) for k in kinds])
    for k, theirs in zip(kinds, remote, strict=True):
        ours = compute_advantages(*here, AdvantageConfig(kind=k))
        assert torch.equal(ours[in_a[0]], theirs[in_a[1]]), k
        assert torch.equal(ours[in_a[0]], compute_advantages(*GROUP_A, AdvantageConfig(kind=k))), k


def _sample(group: str, reward: float) -> Sample:
    return Sample([1, 2], [3, 4, 5], [1, 1, 1], [-1.0, -1.0, -1.0], reward, group, 0)


def test_batch_whitened_is_computed_on_the_global_batch_before_the_split() -> None:
    """Each rank's shard carries the advantages of the whole global batch; whitening the shard on
    its own (what a rank would do without the protocol) gives different numbers."""
    samples = [_sample(g, r) for g, r in [("a", 1.0), ("a", 0.0), ("b", 5.0), ("b", 4.0), ("c", 2.0), ("c", 2.5)]]
    cfg = AdvantageConfig(kind="batch_whitened")
    assigned = assign_advantages(samples, cfg)
    whole = compute_advantages([s.reward for s in samples], ["x"] * 6, cfg)
    assert [s.advantage for s in assigned] == whole.tolist()
    plan = plan_step(samples, advantage=cfg, loss=LossConfig(), batch=BatchConfig(world_size=2),
                     pad_token_id=0, dtype=torch.float64)
    for shard, (mb,) in zip(shard_by_rank(assigned, 2), plan.shards, strict=True):
        assert mb.advantages.tolist() == [s.advantage for s in shard]
        local = compute_advantages([s.reward for s in shard], [s.group_id for s in shard], cfg)
        assert not torch.allclose(local, mb.advantages)


# --- DAPO's overlong shaping -------------------------------------------------------------------------
@pytest.mark.parametrize(("num_tokens", "penalty"), [(10, 0.0), (15, 0.0), (16, -0.2), (18, -0.6), (20, -1.0),
                                                     (31, -1.0)])
def test_overlong_penalty_falls_linearly_over_the_window(num_tokens: int, penalty: float) -> None:
    # max_tokens 20, window 5: free up to 15 tokens, then -1/5 per token, -1 from 20 on
    assert overlong_penalty(num_tokens, OverlongConfig(max_tokens=20, window=5)) == pytest.approx(penalty)


def test_shaped_rewards_add_the_penalty_before_the_advantages() -> None:
    cfg = OverlongConfig(max_tokens=20, window=5, penalty=0.5)
    assert shaped_rewards([1.0, 1.0, 0.0], [12, 18, 25], cfg) == pytest.approx([1.0, 0.7, -0.5])
    assert shaped_rewards([1.0, 0.0], [99, 99], None) == [1.0, 0.0]
    # two right answers of different lengths no longer tie: the long one gets the lower advantage
    adv = compute_advantages(shaped_rewards([1.0, 1.0, 0.0, 0.0], [12, 18, 12, 12], cfg), [0] * 4, AdvantageConfig())
    assert adv[0] > adv[1] > 0 > adv[2] == adv[3]
    with pytest.raises(ValueError, match="window"):
        OverlongConfig(max_tokens=4, window=5)


def test_uninformative_groups_are_those_with_one_reward() -> None:
    assert uninformative([1.0, 1.0, 1.0]) and uninformative([0.0, 0.0]) and uninformative([0.5])
    assert not uninformative([1.0, 0.0, 1.0]) and not uninformative([])
