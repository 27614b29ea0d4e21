"""One optimisation step on a causal LM: per-token logprobs, loss, gradient accumulation, update.

Pure-function style: the caller owns the model (anything called as `model(input_ids=...,
attention_mask=...).logits`, e.g. a transformers `LlamaForCausalLM`), the optimizer and the
micro-batches from `batching.plan_step`; nothing here touches a database or Temporal.

    totals = accumulate_gradients(model, micro_batches, loss_cfg)   # forward + backward, per micro-batch
    (data parallel: FSDP reduce-scatters the gradients in backward; all-reduce the totals here, rl/distributed.py)
    grad_norm = apply_gradients(model, optimizer, grad_clip)         # clip, step, zero
    metrics = totals.summary(stats, grad_norm)

`train_step` chains the three for a single process. With one optimiser step per global batch, the
trainer's logprobs "before the step" (the proximal policy of truncated_is and decoupled) are the
current forward's logprobs, detached: no second forward pass is needed. `train_updates` takes
several (batch.epochs passes over batch.mini_batches mini-batches): it records those logprobs once,
in one forward pass without gradients before the first update, and every update reads them.
"""

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, cast

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from rlpipe.rl.batch import GlobalStats, TrainBatch, filler_batch
from rlpipe.rl.losses import EXTREME_METRICS, SUM_METRICS, LossInputs, LossOutput, compute_loss
from rlpipe.schemas.algorithm import LossConfig, OptimConfig

BATCH_SUMS = ("adv", "adv_sq", "sequences", "tokens")
"""Totals over sequences (advantages) and real tokens that the step adds to the loss's metrics."""
COUNT_METRICS = ("num_loss_tokens", "num_sequences", "num_tokens")
"""Step metrics that count the batch (MetricTotals.summary): summed over a pass's mini-batches."""


def make_optimizer(params: Iterable[nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW as configured (the clip is applied by `apply_gradients`, not here)."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def completion_logprobs(model: nn.Module, batch: TrainBatch, temperature: float = 1.0,
                        entropy_grad: bool = True, chunk_tokens: int | None = None) -> tuple[Tensor, Tensor]:
    """Logprob and entropy of every completion slot under `model`: two (N, L) tensors with grad
    (the entropy only with `entropy_grad`: without an entropy bonus it is a metric, and its graph
    would keep (N, L, V) tensors for nothing, ~15 % of a SmolLM2 step on CPU).

    The token at column c is predicted by the logits at column c - 1 (shift by one); prompts have
    at least one token and padded slots point at column 1, so c - 1 >= 0 always.
    `chunk_tokens`: see `chunked_completion_logprobs`; None computes all logits at once.
    """
    targets = batch.input_ids.gather(1, batch.completion_index)                         # (N, L)
    if chunk_tokens is not None:
        return chunked_completion_logprobs(model, batch, targets, temperature, entropy_grad, chunk_tokens)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # (N, T, V)
    predictor = (batch.completion_index - 1).unsqueeze(-1).expand(-1, -1, logits.shape[-1])  # (N, L, V)
    return token_logprobs(logits.gather(1, predictor), targets, temperature, entropy_grad)


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float, entropy_grad: bool) -> tuple[Tensor, Tensor]:
    """log p(target) and the entropy at each position of `logits` (..., V), targets (...)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logprobs are too coarse for ratios
    logp = (logits / temperature).log_softmax(-1)                                       # (..., V)
    logprobs = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)                        # (...)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp.exp() * logp).sum(-1)                                           # (...)
    return logprobs, entropy


class WithOutputLayer(Protocol):
    """A transformers causal LM whose output layer (hidden states -> vocabulary logits) can be called alone."""

    def get_output_embeddings(self) -> nn.Module: ...


UNCHUNKABLE_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config fields of models whose logits are more than lm_head(hidden): the chunked path would skip them."""


def chunked_completion_logprobs(model: nn.Module, batch: TrainBatch, targets: Tensor, temperature: float,
                                entropy_grad: bool, chunk_tokens: int) -> tuple[Tensor, Tensor]:
    """`completion_logprobs` without the (N, T, V) logits: the decoder's hidden states of the
    predicting columns go through the output layer `chunk_tokens` rows at a time, each chunk
    recomputed in the backward pass (activation checkpointing) instead of kept, so at most one
    chunk's (chunk_tokens, V) logits are alive at once.

    The hidden states come from a call of the whole model (its logits for the last column only),
    not of its decoder alone: a sharded model gathers its outer weights (embedding, output layer)
    in that call's hooks, and reduces their gradients after it."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"loss.logit_chunk_tokens needs a transformers model (its decoder and output layer apart), "
                        f"not {type(model).__name__}")
    scaled = [name for name in UNCHUNKABLE_LOGITS if getattr(model.config, name, None) not in (None, 1, 1.0)]
    if scaled:
        raise ValueError(f"loss.logit_chunk_tokens: this model's logits are scaled ({', '.join(scaled)}), which "
                         "the chunked path does not reproduce; set logit_chunk_tokens to None")
    hidden = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True,
                   logits_to_keep=1).hidden_states[-1]                                   # (N, T, H) after the norm
    predictor = (batch.completion_index - 1).unsqueeze(-1).expand(-1, -1, hidden.shape[-1])  # (N, L, H)
    rows = hidden.gather(1, predictor).flatten(0, 1)                                    # (N*L, H)
    head = cast(WithOutputLayer, model).get_output_embeddings()

    def chunk(h: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        return token_logprobs(head(h), t, temperature, entropy_grad)                     # (c,) x 2

    pieces = []
    for start in range(0, rows.shape[0], chunk_tokens):
        h, t = rows[start:start + chunk_tokens], targets.flatten()[start:start + chunk_tokens]
        pieces.append(checkpoint(chunk, h, t, use_reentrant=False) if torch.is_grad_enabled() else chunk(h, t))
    logprobs, entropy = (torch.cat(parts).view_as(targets) for parts in zip(*pieces, strict=True))
    return logprobs, entropy


@dataclass
class MetricTotals:
    """Sums, maxima and minima over a step's micro-batches; reduced across ranks before `summary`.
    Every rank holds the same keys, even one whose micro-batches were all empty."""

    sums: dict[str, Tensor] = field(default_factory=lambda: _filled(SUM_METRICS + BATCH_SUMS, 0.0))
    maxes: dict[str, Tensor] = field(default_factory=lambda: _filled(EXTREME_METRICS + ("adv",), -math.inf))
    mins: dict[str, Tensor] = field(default_factory=lambda: _filled(EXTREME_METRICS + ("adv",), math.inf))

    def add(self, out: LossOutput, batch: TrainBatch) -> None:
        """Fold in one micro-batch's loss metrics and its advantage and token counts."""
        adv = batch.advantages.detach().double()                                     # (N,)
        sums = {**out.sums, "adv": adv.sum(), "adv_sq": adv.pow(2).sum(),
                "sequences": torch.tensor(float(batch.num_sequences)),
                "tokens": batch.attention_mask.sum()}
        for k, v in sums.items():
            self.sums[k] += v.detach().double().cpu()
        for k, v in {**out.maxes, "adv": adv.max()}.items():
            self.maxes[k] = torch.maximum(self.maxes[k], v.detach().double().cpu())
        for k, v in {**out.mins, "adv": adv.min()}.items():
            self.mins[k] = torch.minimum(self.mins[k], v.detach().double().cpu())

    def summary(self, stats: GlobalStats, grad_norm: float) -> dict[str, float]:
        """Step metrics: token means over the global loss tokens, sequence means over sequences."""
        s = {k: float(v) for k, v in self.sums.items()}
        tokens, sequences = max(stats.num_loss_tokens, 1), max(s["sequences"], 1.0)
        adv_mean = s["adv"] / sequences

        def extreme(d: dict[str, Tensor], k: str) -> float:
            return float(d[k]) if math.isfinite(float(d[k])) else 0.0   # 0 when the step had no tokens

        return {
            "loss": s["loss"] / stats.world_size,           # shares carry x world_size (see rl/losses.py)
            "entropy": s["entropy"] / tokens,
            "kl_sampler": s["kl_sampler"] / tokens,         # KL(sampler || trainer), k3 per token
            "kl_ref": s["kl_ref"] / tokens,                 # 0 without a reference model
            "mismatch": s["mismatch"] / tokens,             # mean |log pi_trainer - log pi_sampler|
            "clip_frac": s["clip_frac"] / tokens,           # tokens whose clip (CISPO: cap) acted
            "clip_seq_frac": s["clipped_sequences"] / sequences,  # GSPO clips whole sequences
            "is_weight_mean": s["is_weight"] / tokens,      # pi_trainer / pi_sampler per token
            "is_weight_max": extreme(self.maxes, "is_weight"),
            "is_weight_min": extreme(self.mins, "is_weight"),
            "is_capped_frac": s["is_capped_frac"] / tokens,
            "adv_mean": adv_mean,
            "adv_std": math.sqrt(max(s["adv_sq"] / sequences - adv_mean**2, 0.0)),
            "adv_max": extreme(self.maxes, "adv"),
            "adv_min": extreme(self.mins, "adv"),
            "grad_norm": grad_norm,
            "num_loss_tokens": float(stats.num_loss_tokens),
            "num_sequences": s["sequences"],
            "num_tokens": s["tokens"],
        }


def _filled(keys: Sequence[str], value: float) -> dict[str, Tensor]:
    return {k: torch.tensor(value, dtype=torch.float64) for k in keys}


def accumulate_gradients(
    model: nn.Module, micro_batches: Sequence[TrainBatch], cfg: LossConfig, ref_model: nn.Module | None = None,
    *, lockstep: bool = False,
) -> MetricTotals:
    """Forward and backward over each micro-batch, summing gradients into `.grad`; no optimiser step.

    Each micro-batch's loss is already its share of the global mean (rl/losses.py), so the summed
    gradients need no further division by the number of micro-batches. `lockstep` (sharded ranks,
    which must all run every pass): an empty micro-batch runs the passes of a `filler_batch`.
    """
    if cfg.kl_coef > 0 and ref_model is None:
        raise ValueError("loss.kl_coef > 0 needs a reference model: pass ref_model or set kl_coef=0")
    device = next(model.parameters()).device
    totals = MetricTotals()
    for mb in micro_batches:
        if mb.num_sequences == 0:  # HF models cannot forward zero rows; an empty micro-batch adds nothing
            if lockstep:
                _filler_passes(model, mb.stats, cfg, ref_model, device)
            continue
        mb = mb.to(device)
        logprobs, entropy = completion_logprobs(model, mb, cfg.temperature,              # (N, L) x 2
                                                entropy_grad=cfg.entropy_coef > 0, chunk_tokens=cfg.logit_chunk_tokens)
        ref_logprobs = None
        if ref_model is not None and cfg.kl_coef > 0:
            with torch.no_grad():
                ref_logprobs, _ = completion_logprobs(ref_model, mb, cfg.temperature,    # (N, L)
                                                      chunk_tokens=cfg.logit_chunk_tokens)
        inputs = LossInputs(
            logprobs=logprobs,
            sampler_logprobs=mb.sampler_logprobs,
            advantages=mb.advantages,
            loss_mask=mb.loss_mask,
            entropy=entropy,
            # the trainer before the step's first update: recorded when the step takes several, else now
            proximal_logprobs=logprobs.detach() if mb.proximal_logprobs is None else mb.proximal_logprobs,
            ref_logprobs=ref_logprobs,
        )
        out = compute_loss(inputs, cfg, mb.stats)
        out.loss.backward()
        totals.add(out, mb)
    return totals


def _filler_passes(model: nn.Module, stats: GlobalStats, cfg: LossConfig, ref_model: nn.Module | None,
                   device: torch.device) -> None:
    """The passes of a micro-batch (policy, reference, backward) on a `filler_batch`, whose zero
    loss adds nothing to any gradient; without grad mode, the policy's forward only."""
    mb = filler_batch(stats).to(device)
    logprobs, _ = completion_logprobs(model, mb, cfg.temperature, entropy_grad=False,
                                      chunk_tokens=cfg.logit_chunk_tokens)
    if not torch.is_grad_enabled():
        return
    if ref_model is not None and cfg.kl_coef > 0:
        with torch.no_grad():
            completion_logprobs(ref_model, mb, cfg.temperature, chunk_tokens=cfg.logit_chunk_tokens)
    (logprobs.sum() * 0.0).backward()


def apply_gradients(model: nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float | None) -> float:
    """Clip the global gradient norm (None: no clip), step, zero the gradients; returns the norm before clipping.
    Sharded gradients (DTensors) give a sharded norm, which every rank gathers whole."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip is not None else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[TrainBatch],
    cfg: LossConfig,
    *,
    grad_clip: float | None,
    ref_model: nn.Module | None = None,
) -> dict[str, float]:
    """One single-process optimisation step over `micro_batches` (one rank's shard of a plan)."""
    stats = micro_batches[0].stats
    if stats.world_size != 1:
        raise ValueError(
            f"the plan has world_size={stats.world_size}: run it with rl.distributed.DataParallelGroup, "
            "or plan it with batch.world_size=1"
        )
    model.zero_grad(set_to_none=True)  # a step starts from no gradient, whatever the caller left
    totals = accumulate_gradients(model, micro_batches, cfg, ref_model)
    grad_norm = apply_gradients(model, optimizer, grad_clip)
    return totals.summary(stats, grad_norm)


def with_proximal_logprobs(
    model: nn.Module, micro_batches: Sequence[TrainBatch], cfg: LossConfig, *, lockstep: bool = False
) -> list[TrainBatch]:
    """The micro-batches with the model's current log-probabilities recorded (no gradient): the
    proximal policy of every update of a step that takes several over the same batch."""
    device = next(model.parameters()).device
    recorded = []
    with torch.no_grad():
        for mb in micro_batches:
            if mb.num_sequences == 0:
                if lockstep:
                    _filler_passes(model, mb.stats, cfg, None, device)
                recorded.append(mb)
                continue
            logprobs, _ = completion_logprobs(model, mb.to(device), cfg.temperature,     # (N, L)
                                              chunk_tokens=cfg.logit_chunk_tokens)
            recorded.append(replace(mb, proximal_logprobs=logprobs.to(mb.sampler_logprobs.device)))
    return recorded


def combine_updates(metrics: Sequence[dict[str, float]], epochs: int) -> dict[str, float]:
    """A step's metrics from those of its updates (`epochs` passes over the same mini-batches): the
    mean of each, except the batch's counts, which add up over the mini-batches of one pass."""
    if len(metrics) == 1:
        return dict(metrics[0])
    combined = {k: sum(m[k] for m in metrics) / len(metrics) for k in metrics[0]}
    for k in COUNT_METRICS:
        combined[k] = sum(m[k] for m in metrics) / epochs
    return combined | {"optimizer_steps": float(len(metrics))}


def train_updates(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    updates: Sequence[Sequence[TrainBatch]],
    cfg: LossConfig,
    *,
    epochs: int,
    grad_clip: float | None,
    ref_model: nn.Module | None = None,
) -> dict[str, float]:
    """`epochs` passes over `updates` (one rank's micro-batches of each mini-batch), one optimiser
    step per mini-batch; single process. One update is exactly `train_step`."""
    return run_epochs(model, updates, cfg, epochs,
                      lambda u: train_step(model, optimizer, u, cfg, grad_clip=grad_clip, ref_model=ref_model))


def run_epochs(
    model: nn.Module,
    updates: Sequence[Sequence[TrainBatch]],
    cfg: LossConfig,
    epochs: int,
    update: Callable[[Sequence[TrainBatch]], dict[str, float]],
    *,
    lockstep: bool = False,
) -> dict[str, float]:
    """`epochs` passes of `update` (one optimiser step) over `updates`, after recording the proximal
    log-probabilities when there is more than one step; the combined metrics. Shared by the
    single-process path and each data-parallel rank (`lockstep`: see `accumulate_gradients`)."""
    if epochs * len(updates) > 1:
        updates = [with_proximal_logprobs(model, u, cfg, lockstep=lockstep) for u in updates]
    return combine_updates([update(u) for _ in range(epochs) for u in updates], epochs)
