"""Policy-gradient losses: pure functions over per-token tensors of one micro-batch.

The denominator protocol. A step's loss is a mean over the GLOBAL batch (every rank, every
micro-batch). Each denominator it needs -- loss tokens, sequences, the constant normaliser's
max completion length -- is counted once over the global batch before the split
(`batching.global_stats`) and travels with every micro-batch as `GlobalStats`. A micro-batch
returns a partial SUM divided by that global denominator and multiplied by `world_size`, because
the gradient reduction averages over ranks (DDP's and FSDP's semantics). Summing the micro-batch gradients on
a rank and averaging over ranks then gives exactly the single-process full-batch gradient, for any
split. A per-micro-batch or per-rank count instead (TRL's 'bnpo') weights each token by the size
of the micro-batch it happened to land in. Per-sequence quantities (seq_mean_token_mean's token
count) stay exact because a sequence is never split.

An empty micro-batch (no loss tokens) returns a zero loss that is still tied to the graph, so
backward runs on every rank and every micro-batch alike.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rlpipe.rl.batch import GlobalStats
from rlpipe.schemas.algorithm import Aggregation, KLEstimator, LossConfig

SUM_METRICS = ("loss", "clip_frac", "clipped_sequences", "is_weight", "is_capped_frac", "kl_sampler", "mismatch",
               "entropy", "kl_ref")
"""Keys of `LossOutput.sums`: totals over loss tokens (the loss itself is already a share), except
`clipped_sequences`, a count of sequences with a clipped (or, for CISPO, capped) loss token."""
EXTREME_METRICS = ("is_weight",)
"""Keys of `LossOutput.maxes` and `LossOutput.mins`."""


@dataclass(frozen=True)
class LossInputs:
    """Per-token tensors of one micro-batch: N sequences x L completion slots."""

    logprobs: Tensor                  # (N, L) trainer logprobs of the completion tokens (with grad)
    sampler_logprobs: Tensor          # (N, L) behaviour policy: the sampler's logprobs
    advantages: Tensor                # (N,) one per sequence
    loss_mask: Tensor                 # (N, L) 1 model token, 0 tool token or padding
    entropy: Tensor                   # (N, L) trainer entropy at each position (with grad if entropy_coef > 0)
    proximal_logprobs: Tensor | None = None  # (N, L) trainer before the step: truncated_is, decoupled
    ref_logprobs: Tensor | None = None       # (N, L) reference model: KL penalty


@dataclass(frozen=True)
class LossOutput:
    """A micro-batch's share of the step loss, and metric totals to be reduced across the step."""

    loss: Tensor               # () partial sum: global-denominator share x world_size (see above)
    sums: dict[str, Tensor]    # () each, detached, summed over this micro-batch's loss tokens
    maxes: dict[str, Tensor]   # () each, detached, max over loss tokens (-inf if none)
    mins: dict[str, Tensor]    # () each, detached, min over loss tokens (+inf if none)


def ppo_clip_loss(
    logprobs: Tensor, anchor_logprobs: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic clipped surrogate, per token, and where the clip is active.

    logprobs, anchor_logprobs: (N, L); advantages broadcastable to (N, L).
    Returns loss (N, L) = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) with r = exp(logprobs -
    anchor), and clipped (N, L) bool: the clipped branch is strictly larger, so the token's gradient is 0.
    """
    ratio = (logprobs - anchor_logprobs).exp()                               # (N, L)
    unclipped = -advantages * ratio                                          # (N, L)
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)    # (N, L)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def sequence_log_ratio(logprobs: Tensor, anchor_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """GSPO's per-sequence log importance ratio: the mean over a sequence's loss tokens of
    log pi_theta - log pi_anchor: (N, L) x 3 -> (N, 1). A sequence without loss tokens gets 0
    (ratio 1). Sequences are never split across micro-batches, so the mean is exact."""
    log_ratio = torch.where(loss_mask > 0, logprobs - anchor_logprobs, 0.0)      # (N, L)
    return (log_ratio.sum(-1) / loss_mask.sum(-1).clamp(min=1)).unsqueeze(-1)   # (N, 1)


def gspo_loss(
    logprobs: Tensor, anchor_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor, clip_low: float,
    clip_high: float,
) -> tuple[Tensor, Tensor]:
    """GSPO: PPO's clipped surrogate on one ratio per sequence, s = exp(sequence_log_ratio).

    logprobs, anchor_logprobs, loss_mask: (N, L); advantages (N, 1). Returns loss (N, L), every token of a
    sequence carrying its sequence's term max(-A s, -A clip(s, 1 - clip_low, 1 + clip_high)) (so a
    token-sum aggregation weights a sequence by its length, as TRL does), and clipped (N, L) bool.
    The gradient reaches every token through the mean of its sequence's log-ratio.
    """
    log_ratio = sequence_log_ratio(logprobs, anchor_logprobs, loss_mask)      # (N, 1)
    loss, clipped = ppo_clip_loss(log_ratio, torch.zeros_like(log_ratio), advantages, clip_low, clip_high)
    return loss.expand_as(logprobs), clipped.expand_as(logprobs)


def cispo_loss(logprobs: Tensor, anchor_logprobs: Tensor, advantages: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """CISPO: -sg(min(r, cap)) * A * log pi_theta per token, r = pi_theta / pi_anchor.

    logprobs, anchor_logprobs: (N, L); advantages broadcastable to (N, L). Unlike the PPO clip, no
    token loses its gradient: the truncated weight only scales it (d loss / d logprob = -min(r, cap) A).
    Returns loss (N, L) and capped (N, L) bool, where the weight was truncated.
    """
    ratio = (logprobs - anchor_logprobs).exp().detach()                      # (N, L)
    return -ratio.clamp(max=cap) * advantages * logprobs, ratio > cap


def policy_gradient_term(
    logprobs: Tensor, anchor_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor, cfg: LossConfig
) -> tuple[Tensor, Tensor]:
    """The per-token policy-gradient loss (N, L) of `cfg.policy_loss` / `cfg.ratio_level`, and where its
    clip or cap acted (N, L)."""
    if cfg.policy_loss == "cispo":
        return cispo_loss(logprobs, anchor_logprobs, advantages, cfg.cispo_cap)
    if cfg.ratio_level == "sequence":
        return gspo_loss(logprobs, anchor_logprobs, advantages, loss_mask, cfg.clip_low, cfg.clip_high)
    return ppo_clip_loss(logprobs, anchor_logprobs, advantages, cfg.clip_low, cfg.clip_high)


def truncated_is_weights(
    proximal_logprobs: Tensor, sampler_logprobs: Tensor, cap: float, floor: float | None = None
) -> Tensor:
    """TIS: clamp(pi_prox / mu, floor, cap), detached: (N, L) -> (N, L). It corrects for the sampler's
    distribution differing from the trainer's (stale weights, kernel mismatch); the bounds limit variance."""
    return (proximal_logprobs - sampler_logprobs).exp().clamp(min=floor, max=cap).detach()


def sequence_is_weights(
    proximal_logprobs: Tensor, sampler_logprobs: Tensor, cap: float, floor: float | None = None, *, drop: bool
) -> tuple[Tensor, Tensor]:
    """A sequence's importance weight pi_prox(y) / mu(y), the product of its tokens' ratios, detached:
    clamped to [floor, cap], or with `drop`, 0 outside it. (N, L) x 2 -> weight (N, 1), out of bounds
    (N, 1) bool. Masked slots must hold equal values in both (ratio 1), as compute_loss makes them."""
    log_weight = (proximal_logprobs - sampler_logprobs).sum(-1, keepdim=True).detach()   # (N, 1)
    log_floor = None if floor is None else math.log(floor)
    out_of_bounds = log_weight > math.log(cap)
    if log_floor is not None:
        out_of_bounds |= log_weight < log_floor
    weight = log_weight.clamp(min=log_floor, max=math.log(cap)).exp()                    # never overflows
    return (weight.masked_fill(out_of_bounds, 0.0) if drop else weight), out_of_bounds


def decoupled_weights(proximal_logprobs: Tensor, sampler_logprobs: Tensor, cap: float | None) -> Tensor:
    """AReaL's behaviour weight pi_prox / mu, detached: (N, L) -> (N, L); tokens above `cap` get
    weight 0 (dropped, not truncated), None keeps all. The PPO clip itself is taken around pi_prox."""
    weight = (proximal_logprobs - sampler_logprobs).exp().detach()          # (N, L)
    return weight if cap is None else weight.masked_fill(weight > cap, 0.0)


def kl_estimate(logprobs_p: Tensor, logprobs_q: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token estimate of KL(p || q) from tokens sampled from p: (N, L) x 2 -> (N, L).

    With log_r = log q - log p: k1 = -log_r (unbiased, can be negative); k2 = log_r^2 / 2 (biased,
    low variance); k3 = exp(log_r) - 1 - log_r (unbiased, never negative).
    """
    log_r = logprobs_q - logprobs_p                                          # (N, L)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.pow(2)
    return log_r.exp() - 1.0 - log_r


def aggregate(values: Tensor, loss_mask: Tensor, mode: Aggregation, stats: GlobalStats) -> Tensor:
    """This micro-batch's share of the global mean of per-token `values`: (N, L) -> ().

    Summed over a rank's micro-batches and averaged over ranks, the shares give the full-batch value.
    """
    masked = torch.where(loss_mask > 0, values, 0.0)                         # (N, L)
    if mode == "token_mean":
        # sum / loss tokens of the global batch                                  (TRL 'dapo')
        share = masked.sum() / max(stats.num_loss_tokens, 1)
    elif mode == "seq_mean_token_sum":
        # sum / sequences of the global batch
        share = masked.sum() / max(stats.num_sequences, 1)
    elif mode == "seq_mean_token_mean":
        # sum over each sequence's tokens / that sequence's loss tokens (a sequence is never split),
        # then sum / sequences of the global batch                               (TRL 'grpo')
        per_sequence = masked.sum(-1) / loss_mask.sum(-1).clamp(min=1)      # (N,)
        share = per_sequence.sum() / max(stats.num_sequences, 1)
    else:
        # constant_normalizer: sum / (sequences of the global batch * max_completion_tokens)
        #                                                                        (Dr. GRPO, TRL 'dr_grpo')
        share = masked.sum() / max(stats.num_sequences * stats.max_completion_tokens, 1)
    return share * stats.world_size  # the gradient reduction divides by world_size (DDP/FSDP averaging)


def off_policy_terms(
    proximal_logprobs: Tensor | None, sampler_logprobs: Tensor, cfg: LossConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """The PPO ratio's anchor, the per-token weight and where a bound acted, each (N, L), by correction:
    1) none: clip around the sampler mu, weight 1;
    2) truncated_is: clip around pi_prox, weight clamp(pi_prox / mu, tis_floor, tis_cap);
       sequence_truncate / sequence_mask: the same, one weight per sequence (sequence_is_weights);
    3) decoupled: clip around pi_prox, weight pi_prox / mu, 0 above decoupled_weight_cap."""
    no_cap = torch.zeros_like(sampler_logprobs, dtype=torch.bool)
    if cfg.off_policy == "none":
        return sampler_logprobs, torch.ones_like(sampler_logprobs), no_cap
    if proximal_logprobs is None:
        raise ValueError(f"off_policy={cfg.off_policy!r} needs proximal_logprobs (the trainer before the step)")
    prox_over_mu = (proximal_logprobs - sampler_logprobs).exp()                       # (N, L)
    if cfg.off_policy == "truncated_is":
        weight = truncated_is_weights(proximal_logprobs, sampler_logprobs, cfg.tis_cap, cfg.tis_floor)
        below = prox_over_mu < cfg.tis_floor if cfg.tis_floor is not None else no_cap
        return proximal_logprobs, weight, (prox_over_mu > cfg.tis_cap) | below
    if cfg.off_policy in ("sequence_truncate", "sequence_mask"):
        weight, capped = sequence_is_weights(proximal_logprobs, sampler_logprobs, cfg.tis_cap, cfg.tis_floor,
                                             drop=cfg.off_policy == "sequence_mask")
        return proximal_logprobs, weight.expand_as(sampler_logprobs), capped.expand_as(sampler_logprobs)
    cap = cfg.decoupled_weight_cap
    weight = decoupled_weights(proximal_logprobs, sampler_logprobs, cap)
    return proximal_logprobs, weight, no_cap if cap is None else prox_over_mu > cap


def compute_loss(x: LossInputs, cfg: LossConfig, stats: GlobalStats) -> LossOutput:
    """The policy loss of one micro-batch (PPO clip, GSPO or CISPO, off-policy correction, KL, entropy), aggregated
    by `cfg.aggregation` with the step's global denominators, and its metric totals."""
    mask = x.loss_mask > 0                                                   # (N, L) bool
    current = x.logprobs.detach()                                            # (N, L)
    # Masked slots (tool tokens, padding) get ratio 1 and KL 0, so no inf/nan can leak into the graph.
    sampler = torch.where(mask, x.sampler_logprobs, current)                 # (N, L)
    proximal = None if x.proximal_logprobs is None else torch.where(mask, x.proximal_logprobs, current)
    raw_weight = (current - sampler).exp()                                   # (N, L) pi_theta / mu
    # 1) the ratio's anchor and the per-token off-policy weight
    anchor, weight, capped = off_policy_terms(proximal, sampler, cfg)
    # 2) the clipped surrogate, weighted, plus the regularisers
    adv = x.advantages[:, None].to(current.dtype)                            # (N, 1)
    pg, clipped = policy_gradient_term(x.logprobs, anchor, adv, x.loss_mask, cfg)
    per_token = weight * pg                                                  # (N, L)
    kl_ref = torch.zeros_like(current)
    if cfg.kl_coef > 0:
        if x.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs: pass a reference model or set kl_coef=0")
        ref = torch.where(mask, x.ref_logprobs, current)
        kl_ref = kl_estimate(x.logprobs, ref, cfg.kl_estimator)              # (N, L) KL(pi_theta || ref)
        if cfg.kl_is_correction:  # the tokens came from the anchor policy: reweight them to pi_theta
            kl_ref = kl_ref * (x.logprobs - anchor).exp()
        per_token = per_token + cfg.kl_coef * kl_ref
    if cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * x.entropy                 # a bonus: lower loss, more entropy
    loss = aggregate(per_token, x.loss_mask, cfg.aggregation, stats)
    # 3) metric totals over loss tokens (divided by the global token count once the step is reduced)
    on = mask.to(current.dtype)

    def total(v: Tensor) -> Tensor:
        return (v.detach().to(current.dtype) * on).sum()

    sums = {
        "loss": loss.detach(),
        "clip_frac": total(clipped & mask),
        "clipped_sequences": ((clipped & mask).any(-1)).sum().to(current.dtype),
        "is_weight": total(raw_weight),
        "is_capped_frac": total(capped & mask),
        "kl_sampler": total(kl_estimate(sampler, current, "k3")),            # KL(mu || pi_theta)
        "mismatch": total((current - sampler).abs()),                        # |log pi_theta - log mu|
        "entropy": total(x.entropy),
        "kl_ref": total(kl_ref),
    }
    maxes = {"is_weight": _masked_extreme(raw_weight, mask, largest=True)}
    mins = {"is_weight": _masked_extreme(raw_weight, mask, largest=False)}
    return LossOutput(loss=loss, sums=sums, maxes=maxes, mins=mins)


def _masked_extreme(values: Tensor, mask: Tensor, *, largest: bool) -> Tensor:
    """Max (or min) of `values` where `mask`: (N, L) -> (); -inf (+inf) when nothing is masked in."""
    fill = -torch.inf if largest else torch.inf
    if mask.numel() == 0:
        return torch.tensor(fill, dtype=values.dtype)
    filled = torch.where(mask, values, fill)                                 # (N, L)
    return filled.amax() if largest else filled.amin()
