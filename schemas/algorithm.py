"""Configuration of the learning algorithm: advantages, loss, optimiser and batch split.

Shapes only: no torch, so `rlpipe --help` and the workflow worker never pay for ML imports. The
lead's `RunConfig` composes these four models; each is complete on its own, so `LossConfig()` is a
working default (GRPO advantages, PPO clip 0.2, token-mean loss, no reference model, one rank).
The code that reads them lives in `rl/` (advantages.py, losses.py, batching.py, step.py).
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

AdvantageKind = Literal["grpo", "dr_grpo", "rloo", "batch_whitened"]
Aggregation = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant_normalizer"]
PolicyLoss = Literal["ppo_clip", "cispo"]
RatioLevel = Literal["token", "sequence"]
OffPolicyCorrection = Literal["none", "truncated_is", "sequence_truncate", "sequence_mask", "decoupled"]
CAPPED_BY_TIS_CAP = ("truncated_is", "sequence_truncate", "sequence_mask")
"""The corrections whose importance weight `tis_cap` (and `tis_floor`) bound."""
KLEstimator = Literal["k1", "k2", "k3"]
MicroBatchSplit = Literal["count", "tokens"]
Precision = Literal["fp32", "bf16"]


class OverlongConfig(BaseModel):
    """DAPO's soft overlong punishment (Yu et al. 2025): a trajectory whose model tokens run into the
    last `window` tokens of `max_tokens` loses reward linearly, `penalty` at `max_tokens` and beyond."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    max_tokens: int = Field(ge=1)
    """The length budget of a trajectory's model tokens (DAPO's L_max): usually sampling.max_tokens."""
    window: int = Field(ge=1)
    """The punished stretch before max_tokens (DAPO's L_cache): no penalty up to max_tokens - window."""
    penalty: float = Field(1.0, gt=0, allow_inf_nan=False)
    """The reward lost at max_tokens (and beyond)."""

    @model_validator(mode="after")
    def _window_fits(self) -> "OverlongConfig":
        if self.window > self.max_tokens:
            raise ValueError(f"advantage.overlong.window ({self.window}) must be <= max_tokens ({self.max_tokens})")
        return self


class AdvantageConfig(BaseModel):
    """How a trajectory's scalar reward becomes its advantage (see rl/advantages.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    kind: AdvantageKind = "grpo"
    """grpo: (r - group mean) / (group std + eps) (DeepSeekMath); dr_grpo: r - group mean, no std
    division, which removes GRPO's bias towards easy and hard prompts (Dr. GRPO, Liu et al. 2025);
    rloo: r - mean of the other samples of the group (Ahmadian et al. 2024); batch_whitened:
    (r - batch mean) / (batch std + eps) over the whole global batch of the step (REINFORCE++).
    Groups of one sample and groups whose rewards are all equal get advantage 0 in the group kinds."""
    std_eps: float = Field(1e-6, gt=0, allow_inf_nan=False)
    """Added to the std before dividing (grpo, batch_whitened) so a near-constant group cannot blow
    up; exactly constant groups are zeroed before this matters."""
    overlong: OverlongConfig | None = None
    """Shape each trajectory's reward by its length before the advantages (None: no shaping). The
    trajectory's stored reward is the shaped one; the grader's own score stays in `grades`."""


class LossConfig(BaseModel):
    """The per-token policy loss and how it is averaged (see rl/losses.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    # --- the policy-gradient term ---------------------------------------------------------------
    policy_loss: PolicyLoss = "ppo_clip"
    """ppo_clip: PPO's pessimistic clipped surrogate, max(-A r, -A clip(r)); a token whose clip is
    active gets no gradient. cispo: -sg(min(r, cispo_cap)) A log pi (CISPO, MiniMax-M1 2025; TRL's
    loss_type='cispo'): the importance weight is truncated and detached, so every token keeps a gradient."""
    ratio_level: RatioLevel = "token"
    """ppo_clip only. token: one ratio per token. sequence: GSPO (Zheng et al. 2025; TRL's
    importance_sampling_level='sequence'): one ratio per sequence, exp of the mean over its loss tokens
    of log pi_theta - log pi_anchor, clipped per sequence; GSPO uses far smaller clips (3e-4, 4e-4)."""
    cispo_cap: float = Field(5.0, gt=0, allow_inf_nan=False)
    """cispo only: the importance weight pi_theta / pi_anchor is truncated at this value (TRL's
    epsilon_high for loss_type='cispo')."""

    # --- PPO clip -------------------------------------------------------------------------------
    clip_low: float = Field(0.2, gt=0, lt=1, allow_inf_nan=False)
    """The ratio is clipped below at 1 - clip_low (PPO's epsilon)."""
    clip_high: float = Field(0.2, gt=0, allow_inf_nan=False)
    """The ratio is clipped above at 1 + clip_high; DAPO recommends 0.28 ("clip higher") to keep
    low-probability tokens able to grow and so entropy from collapsing."""

    # --- aggregation: which denominator the summed per-token loss is divided by -----------------
    aggregation: Aggregation = "token_mean"
    """token_mean: sum / loss tokens of the global batch (TRL 'dapo'); seq_mean_token_sum: sum /
    sequences of the global batch; seq_mean_token_mean: each sequence's token mean, then / sequences
    (TRL 'grpo', length-biased); constant_normalizer: sum / (sequences * max_completion_tokens)
    (Dr. GRPO). Every denominator is counted over the whole global batch, before the split."""
    max_completion_tokens: int | None = Field(None, ge=1)
    """The constant of constant_normalizer: set it to the sampler's max_tokens so the normaliser is
    the same every step (Dr. GRPO). None uses the longest completion of the step's global batch."""

    # --- off-policy correction ------------------------------------------------------------------
    off_policy: OffPolicyCorrection = "none"
    """none: PPO ratio against the sampler's logprobs; truncated_is: PPO ratio against the
    trainer's own logprobs before the step, times min(trainer_before / sampler, tis_cap) (TIS, Yao
    et al. 2025); sequence_truncate / sequence_mask: the same clip, weighted per sequence by the
    product of its tokens' trainer_before / sampler ratios, truncated at tis_cap or, above it, set to
    0 (the sequence is dropped) (TRL's vllm_importance_sampling_mode); decoupled: AReaL's decoupled
    PPO, clip around the proximal policy (the trainer's logprobs before the step) and weight by
    proximal / behaviour (sampler) probabilities."""
    tis_cap: float = Field(2.0, ge=1, allow_inf_nan=False)
    """truncated_is, sequence_truncate, sequence_mask: the cap of the importance weight (TIS uses 2,
    TRL's sequence modes 3)."""
    tis_floor: float | None = Field(None, gt=0, lt=1, allow_inf_nan=False)
    """truncated_is, sequence_truncate, sequence_mask: the lower bound of the importance weight
    (TRL's vllm_importance_sampling_clip_min): a smaller weight is raised to it (truncate modes) or,
    in sequence_mask, drops the sequence, since a sample the trainer finds far less likely than the
    sampler did is as untrustworthy as one it finds far more likely. None: no lower bound."""
    decoupled_weight_cap: float | None = Field(None, gt=1, allow_inf_nan=False)
    """decoupled only: tokens whose proximal/behaviour weight exceeds this are dropped from the
    loss (AReaL's behav_imp_weight_cap); None keeps every token."""

    # --- regularisers ---------------------------------------------------------------------------
    kl_coef: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Weight of the KL penalty to the reference model; 0 means no reference model is loaded."""
    kl_is_correction: bool = False
    """Multiply each token's KL estimate by its importance ratio pi_theta / pi_anchor: the tokens were
    sampled by the anchor policy, not by pi_theta, so the plain estimate of KL(pi_theta || ref) is biased
    (DeepSeek-V3.2; TRL's use_bias_correction_kl). Needs kl_coef > 0."""
    kl_estimator: KLEstimator = "k3"
    """Per-token estimator of KL(policy || reference) (Schulman's notation): k1 = log p/q; k2 =
    (log p/q)^2 / 2; k3 = q/p - 1 - log q/p, unbiased and never negative (GRPO's choice)."""
    entropy_coef: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Weight of the entropy bonus (subtracted from the loss); 0 turns it off."""

    mask_truncated: bool = False
    """DAPO's overlong filtering: a completion cut off at the token limit (finish_reason 'length')
    gets no loss tokens, since its reward judged an unfinished answer; its group's advantages still
    count it."""

    # --- sampling consistency -------------------------------------------------------------------
    temperature: float = Field(1.0, gt=0, allow_inf_nan=False)
    """The sampler's temperature: trainer logits are divided by it so that the trainer's logprobs
    and the sampler's (vLLM processed_logprobs) describe the same distribution."""
    logit_chunk_tokens: int | None = Field(None, ge=1)
    """Memory only: compute the vocabulary logits of this many completion tokens at a time (and
    again in the backward pass) instead of all (tokens x vocabulary) at once; None: all at once.
    The result is the same to float rounding; a 150k-token vocabulary makes it worth it."""

    @model_validator(mode="after")
    def _options_match_choices(self) -> "LossConfig":
        defaults = LossConfig.model_fields
        if self.policy_loss == "cispo":
            if self.ratio_level != "token":
                raise ValueError("loss.ratio_level='sequence' (GSPO) is a ppo_clip objective: with "
                                 "policy_loss='cispo' the weight is per token; use one or the other")
            changed = [n for n in ("clip_low", "clip_high") if getattr(self, n) != defaults[n].default]
            if changed:
                raise ValueError(f"loss.{'/'.join(changed)} is not read by policy_loss='cispo', which "
                                 "truncates the weight at cispo_cap instead: remove it or set cispo_cap")
        elif self.cispo_cap != defaults["cispo_cap"].default:
            raise ValueError(f"loss.cispo_cap is only read by policy_loss='cispo' (policy_loss is "
                             f"{self.policy_loss!r}): remove it or set policy_loss='cispo'")
        if self.max_completion_tokens is not None and self.aggregation != "constant_normalizer":
            raise ValueError(
                f"loss.max_completion_tokens is only read by aggregation='constant_normalizer' "
                f"(aggregation is {self.aggregation!r}): remove it or change the aggregation"
            )
        if self.kl_is_correction and self.kl_coef == 0:
            raise ValueError("loss.kl_is_correction corrects the KL penalty, which kl_coef=0 turns off: "
                             "set kl_coef > 0 or remove kl_is_correction")
        for bound in ("tis_cap", "tis_floor"):
            if getattr(self, bound) != defaults[bound].default and self.off_policy not in CAPPED_BY_TIS_CAP:
                raise ValueError(
                    f"loss.{bound} is only read by off_policy in {CAPPED_BY_TIS_CAP} (off_policy is "
                    f"{self.off_policy!r}): remove it or set off_policy='truncated_is'"
                )
        if self.decoupled_weight_cap is not None and self.off_policy != "decoupled":
            raise ValueError(
                f"loss.decoupled_weight_cap is only read by off_policy='decoupled' (off_policy is "
                f"{self.off_policy!r}): remove it or set off_policy='decoupled'"
            )
        return self


class OptimConfig(BaseModel):
    """AdamW and gradient clipping for the trainer (see rl/step.make_optimizer)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    lr: float = Field(1e-6, gt=0, allow_inf_nan=False)
    """Learning rate; RL fine-tuning of a pretrained LLM usually sits at 1e-6 to 3e-6."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW's moment decay rates; beta2 0.99 (not 0.999) adapts faster to RL's drifting gradients."""
    eps: float = Field(1e-8, gt=0, allow_inf_nan=False)
    """AdamW's denominator epsilon."""
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Decoupled weight decay; 0 because RL steps should move the policy only where rewards say."""
    grad_clip: float | None = Field(1.0, gt=0, allow_inf_nan=False)
    """Global gradient-norm clip applied after the all-reduce; None disables clipping (the norm is
    still reported)."""
    seed: int = 0
    """Seed of torch's generator in the trainer (initialisation of anything random, e.g. tests)."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"optim.betas {betas} must each lie in [0, 1): e.g. (0.9, 0.99)")
        return betas


class BatchConfig(BaseModel):
    """How a step's global batch is split over data-parallel ranks and micro-batches, and computed."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    world_size: int = Field(1, ge=1)
    """Data-parallel ranks (FSDP2: each holds 1/world_size of the weights, gradients and optimizer
    state); each gets whole groups where there are at least as many groups."""
    split: MicroBatchSplit = "count"
    """count: each rank's shard is cut into `micro_batches` pieces of near-equal size; tokens:
    sequences are packed into micro-batches of at most `micro_batch_tokens` padded tokens."""
    micro_batches: int = Field(1, ge=1)
    """split='count' only: micro-batches per rank (gradient-accumulation steps)."""
    mini_batches: int = Field(1, ge=1)
    """Optimiser steps per pass over a train step's batch: the batch (advantages already computed
    over all of it) is cut into this many mini-batches of whole groups, each a global batch with its
    own denominators, which ranks and micro-batches then split as usual."""
    epochs: int = Field(1, ge=1)
    """Passes over the step's batch (PPO epochs). With more than one optimiser step per batch, the
    trainer's log-probabilities before the first of them are recorded once and serve every update as
    the proximal policy (off_policy='truncated_is' / 'decoupled')."""
    micro_batch_tokens: int = Field(8192, ge=1)
    """split='tokens' only: budget of padded tokens (rows x longest row) per micro-batch; a sequence
    longer than the budget gets a micro-batch of its own."""
    activation_checkpointing: bool = False
    """Memory only: keep each decoder layer's input instead of its activations and recompute the
    layer in the backward pass (about one more forward of compute for a fraction of the memory)."""
    precision: Precision = "fp32"
    """The trainer's compute dtype. fp32: everything in float32. bf16: forward and backward passes
    in bfloat16 (the ranks' FSDP2 mixed-precision policy; autocast in a single process), while the
    master weights, the optimizer state and the gradient reduction stay float32, and logprobs,
    ratios and the loss are computed in float32 from the bf16 logits."""

    @model_validator(mode="after")
    def _options_match_split(self) -> "BatchConfig":
        if self.micro_batch_tokens != BatchConfig.model_fields["micro_batch_tokens"].default and self.split != "tokens":
            raise ValueError(
                "batch.micro_batch_tokens is only read by split='tokens': set split='tokens' "
                "or remove micro_batch_tokens"
            )
        if self.micro_batches != BatchConfig.model_fields["micro_batches"].default and self.split != "count":
            raise ValueError(
                "batch.micro_batches is only read by split='count': set split='count' "
                "or remove micro_batches"
            )
        return self
