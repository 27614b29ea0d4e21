"""Loss functions against hand-computed values and gradients."""

import math
from typing import get_args

import pytest
import torch

from rlpipe.rl.batch import GlobalStats
from rlpipe.rl.losses import (
    LossInputs,
    aggregate,
    compute_loss,
    decoupled_weights,
    kl_estimate,
    ppo_clip_loss,
    truncated_is_weights,
)
from rlpipe.schemas.algorithm import Aggregation, LossConfig


def logs(*probs: float) -> torch.Tensor:
    """log of each value, (1, n) float64 -- handy for ratios and probabilities."""
    return torch.tensor([probs], dtype=torch.float64).log()


def test_ppo_clip_values_and_gradients() -> None:
    # ratio, advantage -> loss, clipped, d loss / d logprob
    # 1.5, +1 -> max(-1.5, -1.2) = -1.2, clip active, grad 0
    # 0.5, +1 -> max(-0.5, -0.8) = -0.5, inactive, grad -A r = -0.5
    # 1.1, +1 -> inside the range: -1.1, inactive, grad -1.1
    # 1.5, -1 -> max(1.5, 1.2) = 1.5, inactive, grad 1.5
    # 0.5, -1 -> max(0.5, 0.8) = 0.8, clip active, grad 0
    logprobs = logs(1.5, 0.5, 1.1, 1.5, 0.5).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    loss, clipped = ppo_clip_loss(logprobs, torch.zeros_like(logprobs), adv, 0.2, 0.2)
    assert loss.tolist()[0] == pytest.approx([-1.2, -0.5, -1.1, 1.5, 0.8], rel=1e-12)
    assert clipped.tolist()[0] == [True, False, False, False, True]
    loss.sum().backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -0.5, -1.1, 1.5, 0.0], rel=1e-12, abs=1e-15)


def test_ppo_clip_high_is_asymmetric() -> None:
    # ratio 1.25 with A > 0: clipped at 1.2 by clip_high 0.2, free under DAPO's 0.28
    logprobs = logs(1.25)
    anchor, adv = torch.zeros_like(logprobs), torch.ones_like(logprobs)
    assert ppo_clip_loss(logprobs, anchor, adv, 0.2, 0.2)[0].item() == pytest.approx(-1.2)
    assert ppo_clip_loss(logprobs, anchor, adv, 0.2, 0.28)[0].item() == pytest.approx(-1.25)


def test_truncated_is_weights_truncate_at_cap() -> None:
    w = truncated_is_weights(logs(3.0, 0.5, 1.0), torch.zeros(1, 3, dtype=torch.float64), cap=2.0)
    assert w.tolist()[0] == pytest.approx([2.0, 0.5, 1.0], rel=1e-12)
    assert not w.requires_grad


def test_truncated_is_weights_raise_to_the_floor() -> None:
    w = truncated_is_weights(logs(3.0, 0.05, 1.0), torch.zeros(1, 3, dtype=torch.float64), cap=2.0, floor=0.1)
    assert w.tolist()[0] == pytest.approx([2.0, 0.1, 1.0], rel=1e-12)


def two_sequences_on_proximal(logprobs: torch.Tensor, sampler: torch.Tensor) -> LossInputs:
    """Two sequences of two loss tokens and a padding slot, A = 1, one update (proximal = current)."""
    return LossInputs(logprobs=logprobs, sampler_logprobs=sampler, advantages=torch.ones(2, dtype=torch.float64),
                      loss_mask=torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.float64),
                      entropy=torch.zeros_like(logprobs), proximal_logprobs=logprobs.detach())


@pytest.mark.parametrize(("mode", "loss", "first_weight"), [("sequence_truncate", -(0.5 * 2 + 2.5 * 2) / 4, 0.5),
                                                            ("sequence_mask", -(2.5 * 2) / 4, 0.0)])
def test_sequence_weights_below_the_floor(mode: str, loss: float, first_weight: float) -> None:
    # proximal / sampler per token: row 1 [0.5, 0.5, -] -> 0.25 under the floor 0.5: raised to 0.5 or masked
    # to 0; row 2 [2, 1.25, -] -> 2.5 inside [0.5, 3]. A = 1, ratio to proximal 1: per token -weight
    logprobs = torch.cat([logs(0.2, 0.2, 0.3), logs(0.5, 0.5, 0.3)]).requires_grad_()
    sampler = torch.cat([logs(0.4, 0.4, 0.0), logs(0.25, 0.4, 0.0)])
    x = two_sequences_on_proximal(logprobs, sampler)
    out = compute_loss(x, LossConfig(off_policy=mode, tis_cap=3.0, tis_floor=0.5), GlobalStats(4, 2, 3))
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    out.loss.backward()
    want = [-first_weight / 4, -first_weight / 4, 0.0, -2.5 / 4, -2.5 / 4, 0.0]   # d loss / d logprob: -w / 4
    assert logprobs.grad.reshape(-1).tolist() == pytest.approx(want, abs=1e-15)
    assert out.sums["is_capped_frac"].item() == 2.0   # the two loss tokens of row 1, out of bounds


def test_compute_loss_truncated_is_with_a_floor() -> None:
    # proximal / sampler = [3, 0.25] -> weights [2 (capped), 0.5 (floored)]; A = 1, ratio 1: token mean
    # (-2 - 0.5) / 2 = -1.25; both tokens out of bounds
    logprobs = logs(0.6, 0.1).requires_grad_()
    x = one_sequence(logprobs, logs(0.2, 0.4), 1.0, [1, 1], proximal_logprobs=logprobs.detach())
    out = compute_loss(x, LossConfig(off_policy="truncated_is", tis_cap=2.0, tis_floor=0.5), TWO_TOKENS)
    assert out.loss.item() == pytest.approx(-1.25, rel=1e-12)
    assert out.sums["is_capped_frac"].item() == 2.0


def test_decoupled_weights_drop_tokens_above_cap() -> None:
    sampler = torch.zeros(1, 3, dtype=torch.float64)
    assert decoupled_weights(logs(3.0, 0.5, 1.0), sampler, cap=2.0).tolist()[0] == pytest.approx([0.0, 0.5, 1.0])
    assert decoupled_weights(logs(3.0, 0.5, 1.0), sampler, cap=None).tolist()[0] == pytest.approx([3.0, 0.5, 1.0])


def test_kl_estimators() -> None:
    # p = 0.5, q = 0.25: log_r = log q/p = -log 2
    p, q, ln2 = logs(0.5), logs(0.25), math.log(2)
    assert kl_estimate(p, q, "k1").item() == pytest.approx(ln2)
    assert kl_estimate(p, q, "k2").item() == pytest.approx(0.5 * ln2**2)
    assert kl_estimate(p, q, "k3").item() == pytest.approx(0.5 - 1 + ln2)
    assert kl_estimate(p, p, "k3").item() == 0.0


STATS = GlobalStats(num_loss_tokens=10, num_sequences=4, max_completion_tokens=5, world_size=2)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", 7 / 10 * 2),                      # masked sum 1+2+4 = 7 over 10 global tokens, x world_size 2
        ("seq_mean_token_sum", 7 / 4 * 2),               # over 4 global sequences
        ("seq_mean_token_mean", (3 / 2 + 4 / 1) / 4 * 2),  # sequence means 3/2 and 4/1, over 4 sequences
        ("constant_normalizer", 7 / (4 * 5) * 2),        # over 4 sequences x 5 max completion tokens
    ],
)
def test_aggregate_denominators(mode: str, expected: float) -> None:
    values = torch.tensor([[1.0, 2.0, math.inf], [4.0, math.nan, 6.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    assert aggregate(values, mask, mode, STATS).item() == pytest.approx(expected, rel=1e-12)  # masked inf/nan ignored


def one_sequence(
    logprobs: torch.Tensor, sampler: torch.Tensor, adv: float, mask: list[float], **kw: torch.Tensor
) -> LossInputs:
    return LossInputs(
        logprobs=logprobs,
        sampler_logprobs=sampler,
        advantages=torch.tensor([adv], dtype=torch.float64),
        loss_mask=torch.tensor([mask], dtype=torch.float64),
        entropy=kw.pop("entropy", torch.zeros_like(logprobs)),
        **kw,
    )


TWO_TOKENS = GlobalStats(num_loss_tokens=2, num_sequences=1, max_completion_tokens=3)


def test_compute_loss_on_policy_none_correction() -> None:
    # ratios vs sampler [1.5, 1.0, -] (third slot a tool token with sampler logprob -inf), A = 2:
    # token 1 clipped: -2 * 1.2 = -2.4; token 2: -2 * 1 = -2; token mean over 2: -2.2
    logprobs = logs(0.6, 0.4, 0.3).requires_grad_()
    sampler = logs(0.4, 0.4, 0.0)
    out = compute_loss(one_sequence(logprobs, sampler, 2.0, [1, 1, 0]), LossConfig(), TWO_TOKENS)
    assert out.loss.item() == pytest.approx(-2.2, rel=1e-12)
    out.loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -1.0, 0.0], abs=1e-12)   # -A r / 2 tokens
    assert out.sums["clip_frac"].item() == 1.0
    assert out.sums["is_weight"].item() == pytest.approx(2.5)
    assert (out.maxes["is_weight"].item(), out.mins["is_weight"].item()) == pytest.approx((1.5, 1.0))
    assert out.sums["mismatch"].item() == pytest.approx(math.log(1.5))
    assert out.sums["kl_sampler"].item() == pytest.approx(1.5 - 1 - math.log(1.5))   # k3 of KL(mu || pi)


def test_compute_loss_truncated_is() -> None:
    # proximal = current (one step per batch); proximal / sampler = [3, 0.5] -> weights [2 (capped), 0.5]
    # A = 1, ratio 1: per token -w -> token mean (-2 - 0.5) / 2 = -1.25; grads -w / 2
    logprobs = logs(0.6, 0.2).requires_grad_()
    sampler = logs(0.2, 0.4)
    cfg = LossConfig(off_policy="truncated_is", tis_cap=2.0)
    x = one_sequence(logprobs, sampler, 1.0, [1, 1], proximal_logprobs=logprobs.detach())
    out = compute_loss(x, cfg, TWO_TOKENS)
    assert out.loss.item() == pytest.approx(-1.25, rel=1e-12)
    out.loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([-1.0, -0.25], rel=1e-12)
    assert out.sums["is_capped_frac"].item() == 1.0
    with pytest.raises(ValueError, match="proximal_logprobs"):
        compute_loss(one_sequence(logprobs, sampler, 1.0, [1, 1]), cfg, TWO_TOKENS)


@pytest.mark.parametrize(("mode", "loss", "second_weight"), [("sequence_truncate", -2.75, 3.0),
                                                             ("sequence_mask", -1.25, 0.0)])
def test_compute_loss_sequence_level_importance_weights(mode: str, loss: float, second_weight: float) -> None:
    # proximal = current (one update per batch); proximal / sampler per token: row 1 [2, 1.25, -] -> 2.5 under
    # the cap 3; row 2 [2, 2, -] -> 4 over it: truncated to 3, or masked to 0. A = 1, ratio to proximal 1:
    # per token -weight; token mean over 4 loss tokens
    logprobs = torch.cat([logs(0.5, 0.5, 0.3), logs(0.5, 0.4, 0.3)]).requires_grad_()
    sampler = torch.cat([logs(0.25, 0.4, 0.0), logs(0.25, 0.2, 0.0)])
    x = two_sequences_on_proximal(logprobs, sampler)
    out = compute_loss(x, LossConfig(off_policy=mode, tis_cap=3.0), GlobalStats(4, 2, 3))
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    out.loss.backward()
    want = [-2.5 / 4, -2.5 / 4, 0.0, -second_weight / 4, -second_weight / 4, 0.0]   # d loss / d logprob: -w / 4
    assert logprobs.grad.reshape(-1).tolist() == pytest.approx(want, abs=1e-15)
    assert out.sums["is_capped_frac"].item() == 2.0   # the two loss tokens of row 2


def test_compute_loss_decoupled_clips_around_the_proximal_policy() -> None:
    # token 1: pi/prox = 1.5 (clipped to 1.2 for A = 1), prox/mu = 0.5 -> 0.5 * -1.2 = -0.6, grad 0
    # token 2: pi/prox = 1, prox/mu = 3 > cap 2 -> dropped (weight 0)
    logprobs = logs(0.6, 0.3).requires_grad_()
    proximal = logs(0.4, 0.3)
    sampler = logs(0.8, 0.1)
    cfg = LossConfig(off_policy="decoupled", decoupled_weight_cap=2.0)
    out = compute_loss(one_sequence(logprobs, sampler, 1.0, [1, 1], proximal_logprobs=proximal), cfg, TWO_TOKENS)
    assert out.loss.item() == pytest.approx(-0.3, rel=1e-12)
    out.loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, 0.0], abs=1e-15)
    assert out.sums["clip_frac"].item() == 1.0
    assert out.sums["is_capped_frac"].item() == 1.0


def test_compute_loss_kl_penalty_and_entropy_bonus() -> None:
    # A = 0, on policy: only the regularisers. KL k3 with pi = .5, ref = .25: .5 - 1 + ln 2 per token.
    # entropy [2, 4], coef .5: -.5 * 3 = -1.5 on the token mean.
    logprobs = logs(0.5, 0.5).requires_grad_()
    entropy = torch.tensor([[2.0, 4.0]], dtype=torch.float64, requires_grad=True)
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.5)
    x = one_sequence(logprobs, logprobs.detach(), 0.0, [1, 1], entropy=entropy, ref_logprobs=logs(0.25, 0.25))
    out = compute_loss(x, cfg, TWO_TOKENS)
    k3 = 0.5 - 1 + math.log(2)
    assert out.loss.item() == pytest.approx(0.1 * k3 - 1.5, rel=1e-12)
    out.loss.backward()
    assert entropy.grad.tolist()[0] == pytest.approx([-0.25, -0.25])
    assert logprobs.grad.tolist()[0] == pytest.approx([0.1 * (1 - 0.5) / 2] * 2)   # d k3 / d log pi = 1 - ref/pi
    assert out.sums["kl_ref"].item() == pytest.approx(2 * k3)
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_loss(one_sequence(logprobs, logprobs.detach(), 0.0, [1, 1]), cfg, TWO_TOKENS)


def test_compute_loss_gspo_clips_whole_sequences() -> None:
    # token ratios vs sampler [1.5, 1.0, -] (third slot a tool token): s = exp((ln 1.5 + ln 1) / 2) = sqrt(1.5)
    logprobs = logs(0.6, 0.4, 0.3).requires_grad_()
    sampler = logs(0.4, 0.4, 0.0)
    s = math.sqrt(1.5)
    gspo = LossConfig(ratio_level="sequence")
    # A = +1: s = 1.22 > 1.2, so the whole sequence is clipped: loss -1.2 on each token, no gradient
    out = compute_loss(one_sequence(logprobs, sampler, 1.0, [1, 1, 0]), gspo, TWO_TOKENS)
    assert out.loss.item() == pytest.approx(-1.2, rel=1e-12)
    out.loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, 0.0, 0.0], abs=1e-15)
    assert (out.sums["clip_frac"].item(), out.sums["clipped_sequences"].item()) == (2.0, 1.0)
    # A = -1: max(s, 1.2) = s, not clipped; token mean of [s, s] = s. d s / d logprob_t = s / 2 for
    # each of the 2 loss tokens, and the token mean of two equal terms gives d loss / d logprob_t = s / 2
    logprobs.grad = None
    out = compute_loss(one_sequence(logprobs, sampler, -1.0, [1, 1, 0]), gspo, TWO_TOKENS)
    assert out.loss.item() == pytest.approx(s, rel=1e-12)
    out.loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([s / 2, s / 2, 0.0], rel=1e-12, abs=1e-15)
    assert out.sums["clipped_sequences"].item() == 0.0
    # a token-level clip would have clipped token 1 only, and differs
    token_level = compute_loss(one_sequence(logprobs, sampler, 1.0, [1, 1, 0]), LossConfig(), TWO_TOKENS)
    assert token_level.loss.item() == pytest.approx((-1.2 - 1.0) / 2, rel=1e-12)


def test_compute_loss_cispo_keeps_every_tokens_gradient() -> None:
    # ratios vs sampler [10 (capped at 5), 0.5]; A = 1: loss per token -min(r, 5) * log pi,
    # gradient -min(r, 5) * A even where the weight is capped (a PPO clip would give 0 there)
    logprobs = logs(0.5, 0.1).requires_grad_()
    sampler = logs(0.05, 0.2)
    out = compute_loss(one_sequence(logprobs, sampler, 1.0, [1, 1]), LossConfig(policy_loss="cispo"), TWO_TOKENS)
    assert out.loss.item() == pytest.approx((-5 * math.log(0.5) - 0.5 * math.log(0.1)) / 2, rel=1e-12)
    out.loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([-5 / 2, -0.5 / 2], rel=1e-12)
    assert (out.sums["clip_frac"].item(), out.sums["clipped_sequences"].item()) == (1.0, 1.0)
    assert out.maxes["is_weight"].item() == pytest.approx(10.0)   # the raw weight is still reported
    capped_lower = LossConfig(policy_loss="cispo", cispo_cap=2.0)
    out = compute_loss(one_sequence(logprobs.detach(), sampler, 1.0, [1, 1]), capped_lower, TWO_TOKENS)
    assert out.loss.item() == pytest.approx((-2 * math.log(0.5) - 0.5 * math.log(0.1)) / 2, rel=1e-12)


def test_kl_is_correction_reweights_the_penalty_by_the_ratio() -> None:
    # A = 0: only the KL term. pi = .5, ref = .25 -> k3 = .5 - 1 + ln 2 per token, kl_coef .1.
    k3, coef = 0.5 - 1 + math.log(2), 0.1
    cfg = LossConfig(kl_coef=coef, kl_is_correction=True)
    # off policy: sampler .25 -> ratio 2 on both tokens: the penalty doubles
    logprobs = logs(0.5, 0.5).requires_grad_()
    out = compute_loss(one_sequence(logprobs, logs(0.25, 0.25), 0.0, [1, 1], ref_logprobs=logs(0.25, 0.25)), cfg,
                       TWO_TOKENS)
    assert out.loss.item() == pytest.approx(coef * 2 * k3, rel=1e-12)
    assert out.sums["kl_ref"].item() == pytest.approx(2 * 2 * k3)
    # on policy: ratio 1, the value is unchanged, but the ratio's gradient adds k3:
    # d (k3 r) / d log pi = (1 - ref / pi) r + k3 r = .5 + k3 per token, over 2 tokens
    logprobs = logs(0.5, 0.5).requires_grad_()
    x = one_sequence(logprobs, logprobs.detach(), 0.0, [1, 1], ref_logprobs=logs(0.25, 0.25))
    out = compute_loss(x, cfg, TWO_TOKENS)
    assert out.loss.item() == pytest.approx(coef * k3, rel=1e-12)
    out.loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([coef * (0.5 + k3) / 2] * 2, rel=1e-12)


@pytest.mark.parametrize("rows", [0, 2])
@pytest.mark.parametrize("aggregation", get_args(Aggregation))
def test_empty_micro_batch_gives_zero_loss_tied_to_the_graph(rows: int, aggregation: str) -> None:
    logprobs = torch.randn(rows, 3, dtype=torch.float64, requires_grad=True)
    x = LossInputs(
        logprobs=logprobs,
        sampler_logprobs=torch.full((rows, 3), -math.inf, dtype=torch.float64),   # tool tokens only
        advantages=torch.ones(rows, dtype=torch.float64),
        loss_mask=torch.zeros(rows, 3, dtype=torch.float64),
        entropy=torch.zeros(rows, 3, dtype=torch.float64),
    )
    out = compute_loss(x, LossConfig(aggregation=aggregation), TWO_TOKENS)
    assert out.loss.item() == 0.0 and out.loss.requires_grad
    out.loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros_like(logprobs))
    assert out.maxes["is_weight"].item() == -math.inf


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_completion_tokens": 512}, "aggregation='constant_normalizer'"),
        ({"tis_cap": 3.0}, "off_policy in"),
        ({"tis_floor": 0.5}, "tis_floor is only read by off_policy in"),
        ({"off_policy": "truncated_is", "tis_floor": 1.5}, "tis_floor"),
        ({"decoupled_weight_cap": 5.0}, "off_policy='decoupled'"),
        ({"aggregation": "bnpo"}, "aggregation"),
        ({"clip_low": 1.5}, "clip_low"),
        ({"cispo_cap": 4.0}, "policy_loss='cispo'"),
        ({"policy_loss": "cispo", "ratio_level": "sequence"}, "GSPO"),
        ({"policy_loss": "cispo", "clip_high": 0.28}, "clip_high is not read by policy_loss='cispo'"),
        ({"policy_loss": "gspo"}, "policy_loss"),
        ({"kl_is_correction": True}, "kl_coef=0"),
    ],
)
def test_loss_config_rejects_options_that_would_be_ignored_or_invalid(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LossConfig(**fields)
    assert LossConfig(aggregation="constant_normalizer", max_completion_tokens=512).max_completion_tokens == 512
