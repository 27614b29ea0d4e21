"""The trainer's input: trajectories as `Sample`s, and their collation into padded tensors.

Token-in, token-out: a sample holds the exact token ids the sampler saw and produced. For a
multi-turn episode the completion is everything after the first prompt, the tool/environment
tokens included; `loss_mask` is 1 on tokens the model generated and 0 on the tool's, so the loss
and every count of "loss tokens" skip the tool's text while the model still reads it as context.

Layout of a collated batch (N sequences, T columns, L completion slots):

    input_ids   [p p p c c c c . .]    prompt, completion, right padding (position ids stay 0..)
    completion_index  [3 4 5 6 1]      column of each completion token; padded slots point at
                                       column 1 and have loss_mask 0

The token at column c is predicted by the logits at column c - 1 (see `step.completion_logprobs`).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sample:
    """One trajectory, as the sampler produced it."""

    prompt_ids: Sequence[int]        # (P,) P >= 1: the first completion token needs a predictor
    completion_ids: Sequence[int]    # (C,) C >= 1: model and tool/env tokens, in order
    loss_mask: Sequence[int]         # (C,) 1 model token, 0 tool/env token
    sampler_logprobs: Sequence[float]  # (C,) the sampler's logprob of each token (ignored where mask 0)
    reward: float                    # the trajectory's reward from the grader
    group_id: str                    # the prompt group (the G samples of one prompt) it belongs to
    policy_version: int              # the policy version that generated it
    advantage: float = 0.0           # filled by `batching.assign_advantages` over the global batch

    def __post_init__(self) -> None:
        c = len(self.completion_ids)
        if len(self.prompt_ids) < 1 or c < 1:
            raise ValueError("a Sample needs at least one prompt token and one completion token")
        if len(self.loss_mask) != c or len(self.sampler_logprobs) != c:
            raise ValueError(
                f"loss_mask ({len(self.loss_mask)}) and sampler_logprobs ({len(self.sampler_logprobs)}) "
                f"must have one entry per completion token ({c})"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def num_loss_tokens(self) -> int:
        return int(sum(self.loss_mask))


@dataclass(frozen=True)
class GlobalStats:
    """Denominators of one optimisation step, counted ONCE over the whole global batch before it
    is split across ranks and micro-batches (see the protocol in rl/losses.py)."""

    num_loss_tokens: int        # model tokens (loss_mask 1) in the global batch
    num_sequences: int          # sequences with at least one loss token in the global batch
    max_completion_tokens: int  # constant_normalizer's L: configured, or longest completion in the batch
    world_size: int = 1         # the gradient reduce-scatter averages over this many ranks


@dataclass(frozen=True)
class TrainBatch:
    """One micro-batch as padded tensors, plus the global denominators it is normalised by."""

    input_ids: Tensor         # (N, T) int64 prompt + completion, right-padded with pad_token_id
    attention_mask: Tensor    # (N, T) int64 1 real token, 0 padding
    completion_index: Tensor  # (N, L) int64 column in input_ids of each completion token
    loss_mask: Tensor         # (N, L) float 1 model token, 0 tool token or padding slot
    sampler_logprobs: Tensor  # (N, L) float sampler logprob of each completion token (0 on padding)
    advantages: Tensor        # (N,) float one advantage per sequence
    stats: GlobalStats        # the step's global denominators, identical in every micro-batch
    proximal_logprobs: Tensor | None = None  # (N, L) the trainer before the step's first update, when the
                                             # step takes several (rl/step.with_proximal_logprobs)

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> "TrainBatch":
        """The same batch with its tensors on `device`."""
        return TrainBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            completion_index=self.completion_index.to(device),
            loss_mask=self.loss_mask.to(device),
            sampler_logprobs=self.sampler_logprobs.to(device),
            advantages=self.advantages.to(device),
            stats=self.stats,
            proximal_logprobs=None if self.proximal_logprobs is None else self.proximal_logprobs.to(device),
        )


def collate(
    samples: Sequence[Sample], stats: GlobalStats, *, pad_token_id: int, dtype: torch.dtype = torch.float32
) -> TrainBatch:
    """Pad `samples` into one `TrainBatch`; an empty list gives a batch of zero rows.

    Sequences are right-padded, so each keeps the positions 0.. it had in the sampler and no
    real token attends to padding under the causal mask.
    """
    n = len(samples)
    t = max((s.num_tokens for s in samples), default=2)                     # T >= 2 (P >= 1, C >= 1)
    c = max((len(s.completion_ids) for s in samples), default=1)            # L (completion length)
    input_ids = torch.full((n, t), pad_token_id, dtype=torch.long)          # (N, T)
    attention_mask = torch.zeros((n, t), dtype=torch.long)                  # (N, T)
    completion_index = torch.ones((n, c), dtype=torch.long)                 # (N, L) padded slots -> col 1
    loss_mask = torch.zeros((n, c), dtype=dtype)                            # (N, L)
    sampler_logprobs = torch.zeros((n, c), dtype=dtype)                     # (N, L)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, : p + c] = torch.tensor([*s.prompt_ids, *s.completion_ids], dtype=torch.long)
        attention_mask[i, : p + c] = 1
        completion_index[i, :c] = torch.arange(p, p + c)
        loss_mask[i, :c] = torch.tensor(s.loss_mask, dtype=dtype)
        logprobs = torch.tensor(s.sampler_logprobs, dtype=dtype)
        sampler_logprobs[i, :c] = torch.where(loss_mask[i, :c] > 0, logprobs, 0.0)  # tool tokens may be -inf
    advantages = torch.tensor([s.advantage for s in samples], dtype=dtype)  # (N,)
    return TrainBatch(input_ids, attention_mask, completion_index, loss_mask, sampler_logprobs, advantages, stats)


def filler_batch(stats: GlobalStats, dtype: torch.dtype = torch.float32) -> TrainBatch:
    """A one-row micro-batch that weighs nothing (loss mask 0): what a rank without data of its own
    forwards when sharded ranks must run their passes in lockstep (rl/distributed.py)."""
    return TrainBatch(
        input_ids=torch.zeros((1, 2), dtype=torch.long),          # token 0 exists in every vocabulary
        attention_mask=torch.ones((1, 2), dtype=torch.long),
        completion_index=torch.ones((1, 1), dtype=torch.long),
        loss_mask=torch.zeros((1, 1), dtype=dtype),
        sampler_logprobs=torch.zeros((1, 1), dtype=dtype),
        advantages=torch.zeros(1, dtype=dtype),
        stats=stats,
    )
