"""Ablation: the global-denominator protocol against per-micro-batch denominators.

A tiny Llama learns, by GRPO from random initialisation, to continue a digit: prompt [BOS, a],
reward = the share of the first three completion tokens equal to a+1, a+2, a+3 (mod 10), and 0
if the completion does not end with EOS within MAX_NEW_TOKENS. Everything runs in this process:
sampling, reward, training. Two runs start from the same weights and sampling seed and differ
only in how each micro-batch's loss is normalised:

  global           rl.batching.plan_step: denominators counted once over the step's whole batch
  per-micro-batch  rl.batching.per_micro_batch_stats: each micro-batch divides by its own counts
                   (and gradient accumulation by the number of micro-batches) -- the wrong protocol

Micro-batches are packed by a token budget (first-fit decreasing, so long completions share
micro-batches with few rows): under per-micro-batch denominators a token's weight depends on
which micro-batch it landed in. The PNG shows reward, entropy and completion length per step.

    python benchmarks/ablation_denominators.py reports/ablation_denominators.png --steps 120 --seeds 3
"""

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlpipe.rl.batch import Sample, TrainBatch, collate
from rlpipe.rl.batching import assign_advantages, pack_by_tokens, per_micro_batch_stats, plan_step
from rlpipe.rl.step import make_optimizer, train_step
from rlpipe.schemas.algorithm import AdvantageConfig, Aggregation, BatchConfig, LossConfig, OptimConfig

EOS, BOS, VOCAB = 10, 11, 12      # tokens 0..9 are digits
MAX_NEW_TOKENS = 8                # sampler's max_tokens
TARGET_LEN = 3                    # digits of the continuation that earn reward


Curves = dict[str, list[float]]  # reward, entropy, length: one value per step


@dataclass(frozen=True)
class Setup:
    """Everything both runs share."""

    steps: int
    prompts_per_step: int
    group_size: int
    micro_batch_tokens: int
    loss: LossConfig
    optim: OptimConfig


def build_model(seed: int) -> LlamaForCausalLM:
    """A 2-layer Llama, hidden 64: big enough to learn the task in a few dozen steps on CPU."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=32,
                      bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS)
    return LlamaForCausalLM._from_config(cfg)


def reward(prompt_digit: int, completion: Sequence[int]) -> float:
    """Share of the first TARGET_LEN tokens that continue the count; 0 unless the completion ends with EOS."""
    if completion[-1] != EOS:
        return 0.0
    hits = sum(1 for i, tok in enumerate(completion[:TARGET_LEN]) if tok == (prompt_digit + 1 + i) % 10)
    return hits / TARGET_LEN


@torch.no_grad()
def sample_groups(
    model: LlamaForCausalLM, digits: Sequence[int], group_size: int, g: torch.Generator
) -> tuple[list[Sample], float]:
    """G samples per prompt digit with their per-token sampler logprobs (the sampler is this model),
    and the policy's mean entropy over the sampled tokens (measured here, so that it does not
    depend on the denominators under test)."""
    prompts = torch.tensor([[BOS, d] for d in digits for _ in range(group_size)])          # (B, 2)
    ids, logprobs, entropies = prompts, [], []
    for _ in range(MAX_NEW_TOKENS):
        logp = model(input_ids=ids).logits[:, -1].float().log_softmax(-1)                   # (B, V)
        tok = torch.multinomial(logp.exp(), 1, generator=g)                                  # (B, 1)
        logprobs.append(logp.gather(-1, tok))
        entropies.append(-(logp.exp() * logp).sum(-1, keepdim=True))                        # (B, 1)
        ids = torch.cat([ids, tok], dim=1)
    completions = ids[:, 2:].tolist()                                                        # (B, MAX_NEW_TOKENS)
    lps, ents = torch.cat(logprobs, dim=1).tolist(), torch.cat(entropies, dim=1).tolist()
    samples, entropy_sum = [], 0.0
    for i, (c, lp) in enumerate(zip(completions, lps, strict=True)):
        n = c.index(EOS) + 1 if EOS in c else len(c)                                         # keep up to EOS
        digit = digits[i // group_size]
        samples.append(Sample([BOS, digit], c[:n], [1] * n, lp[:n], reward(digit, c[:n]), f"p{i // group_size}", 0))
        entropy_sum += sum(ents[i][:n])
    return samples, entropy_sum / sum(len(s.completion_ids) for s in samples)


def global_micro_batches(samples: list[Sample], setup: Setup) -> list[TrainBatch]:
    batch = BatchConfig(split="tokens", micro_batch_tokens=setup.micro_batch_tokens)
    return plan_step(samples, advantage=AdvantageConfig(), loss=setup.loss, batch=batch, pad_token_id=EOS).shards[0]


def per_micro_batch_micro_batches(samples: list[Sample], setup: Setup) -> list[TrainBatch]:
    """The same micro-batches, each normalised by its own counts (the wrong protocol)."""
    pieces = pack_by_tokens(assign_advantages(samples, AdvantageConfig()), setup.micro_batch_tokens)
    return [collate(p, per_micro_batch_stats(p, num_micro_batches=len(pieces), world_size=1), pad_token_id=EOS)
            for p in pieces]


def run(setup: Setup, protocol: str, seed: int) -> Curves:
    """Train from the seed's initial weights and sampling stream (the same for both protocols);
    per-step reward, entropy and completion length."""
    model = build_model(seed)
    optimizer = make_optimizer(model.parameters(), setup.optim)
    g = torch.Generator().manual_seed(seed + 1)
    split = global_micro_batches if protocol == "global" else per_micro_batch_micro_batches
    curves: Curves = {"reward": [], "entropy": [], "length": []}
    for step in range(setup.steps):
        digits = torch.randint(0, 10, (setup.prompts_per_step,), generator=g).tolist()
        samples, entropy = sample_groups(model, digits, setup.group_size, g)
        train_step(model, optimizer, split(samples, setup), setup.loss, grad_clip=setup.optim.grad_clip)
        curves["reward"].append(sum(s.reward for s in samples) / len(samples))
        curves["entropy"].append(entropy)
        curves["length"].append(sum(len(s.completion_ids) for s in samples) / len(samples))
        if step % 10 == 0 or step == setup.steps - 1:
            print(f"{protocol:>15} seed {seed} step {step:3d}  reward {curves['reward'][-1]:.3f}  "
                  f"entropy {curves['entropy'][-1]:.3f}  length {curves['length'][-1]:.2f}", flush=True)
    return curves


def plot(results: dict[str, list[Curves]], setup: Setup, out: Path) -> None:
    """One panel per quantity; a line per protocol (mean over seeds) and a band from min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    titles = ("mean reward", "policy entropy per sampled token (nats)", "completion tokens")
    for ax, key, title in zip(axes, ("reward", "entropy", "length"), titles, strict=True):
        for protocol, runs in results.items():
            values = np.array([r[key] for r in runs])                                # (seeds, steps)
            (line,) = ax.plot(values.mean(0), label=protocol)
            ax.fill_between(range(values.shape[1]), values.min(0), values.max(0), color=line.get_color(), alpha=0.2)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(title="denominators")
    fig.suptitle(f"GRPO, aggregation={setup.loss.aggregation}, micro-batches of <= {setup.micro_batch_tokens} padded "
                 f"tokens, {setup.prompts_per_step} prompts x {setup.group_size} samples per step, "
                 f"{len(next(iter(results.values())))} seeds (line: mean, band: min-max)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="PNG to write")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seeds", type=int, default=3, help="runs per protocol, seeds 0..N-1")
    parser.add_argument("--aggregation", choices=get_args(Aggregation), default="token_mean")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--micro-batch-tokens", type=int, default=160)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()
    setup = Setup(steps=args.steps, prompts_per_step=args.prompts, group_size=args.group_size,
                  micro_batch_tokens=args.micro_batch_tokens, loss=LossConfig(aggregation=args.aggregation),
                  optim=OptimConfig(lr=args.lr, grad_clip=1.0))
    torch.set_num_threads(1)  # the model is tiny: extra threads only spin, and stall when cores are shared
    start = time.monotonic()
    results = {p: [run(setup, p, seed) for seed in range(args.seeds)] for p in ("global", "per-micro-batch")}
    plot(results, setup, args.out)
    tail = max(1, setup.steps // 5)
    for protocol, runs in results.items():
        rewards = ", ".join(f"{sum(r['reward'][-tail:]) / tail:.3f}" for r in runs)
        entropies = ", ".join(f"{sum(r['entropy'][-tail:]) / tail:.3f}" for r in runs)
        print(f"{protocol:>15}: last {tail} steps, per seed: reward {rewards}; entropy {entropies}")
    print(f"wrote {args.out} in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
