"""TRL's GRPO loss on given per-token tensors, and TRL's reuse of one generation batch for several
optimiser steps: run by tests/unit/test_trl_parity.py with the Python of the benchmark venv
(`make bench-trl-venv`, TRL 1.16), never imported by rlpipe.

    python trl_loss_probe.py INPUTS.pt OPTIONS.json OUTPUT.pt

The trainer is built without `__init__` (no model, no dataset, one process, no accumulation):
- `loss`: its model forward is replaced by the given log-probabilities, so what runs is
  `GRPOTrainer._compute_loss` itself: importance ratios, clipping or CISPO weights, the KL term, the
  sampler-mismatch weight and the loss type's normaliser. The output holds the loss and its gradient
  with respect to the log-probabilities.
- `iterations`: the policy is a table of logits per (sequence, position), and `num_iterations`
  optimiser steps go through TRL's own `_prepare_inputs` (which generates once and hands the buffered
  batch, with its old log-probabilities, to every iteration) and `_compute_loss`. The output holds
  the table after the last step.

The sampler-mismatch weight ("importance_sampling_ratio") is computed inline in TRL's
`_generate_and_score_completions`, between generation and scoring; `sampler_mismatch_weight` runs
that block of TRL's installed source on the given tensors, and fails loudly if it cannot be found.
"""

from __future__ import annotations

import inspect
import json
import math
import sys
import textwrap
from collections import defaultdict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from trl import GRPOTrainer

IS_BLOCK = "if self.use_vllm and self.vllm_importance_sampling_correction:"
"""The first line of the block of `_generate_and_score_completions` that computes the weight."""


class OneProcess:
    """The parts of accelerate's Accelerator that `_compute_loss` touches, for one process."""

    num_processes = 1
    sync_gradients = True
    is_main_process = True

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    gather_for_metrics = gather

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor


def make_trainer(options: dict[str, Any], max_completion_length: int) -> GRPOTrainer:
    trainer = object.__new__(GRPOTrainer)
    trainer.loss_type = options["loss_type"]
    trainer.importance_sampling_level = options.get("importance_sampling_level", "token")
    trainer.epsilon_low, trainer.epsilon_high = options["epsilon_low"], options["epsilon_high"]
    trainer.beta = options.get("beta", 0.0)
    trainer.args = SimpleNamespace(use_bias_correction_kl=options.get("use_bias_correction_kl", False), delta=None,
                                   steps_per_generation=1)
    trainer.top_entropy_quantile = 1.0
    trainer.off_policy_mask_threshold = None
    trainer.aux_loss_enabled = False
    trainer._entropy_bonus_enabled = False
    trainer.vllm_importance_sampling_mode = options.get("vllm_importance_sampling_mode")
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = trainer.vllm_importance_sampling_mode is not None
    trainer.vllm_importance_sampling_clip_max = options.get("vllm_importance_sampling_clip_max")
    trainer.vllm_importance_sampling_clip_min = options.get("vllm_importance_sampling_clip_min")
    trainer.num_iterations = options.get("num_iterations", 1)
    trainer.max_completion_length = max_completion_length
    trainer.current_gradient_accumulation_steps = 1
    trainer.model = SimpleNamespace(training=True)
    trainer.accelerator = OneProcess()
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._step, trainer._buffered_inputs = 0, None
    return trainer


def sampler_mismatch_weight(trainer: GRPOTrainer, old_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor,
                            mask: torch.Tensor) -> torch.Tensor:
    """TRL's importance_sampling_ratio: its own source block, run on these tensors."""
    source = textwrap.dedent(inspect.getsource(GRPOTrainer._generate_and_score_completions)).splitlines()
    starts = [i for i, line in enumerate(source) if line.strip() == IS_BLOCK]
    if not starts:
        raise RuntimeError(f"TRL's _generate_and_score_completions has no line {IS_BLOCK!r}: the probe needs updating")
    first = starts[0]
    indent = len(source[first]) - len(source[first].lstrip())
    block = [source[first]]
    for line in source[first + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        block.append(line)
    scope = {"self": trainer, "torch": torch, "math": math, "old_per_token_logps": old_logprobs,
             "sampling_per_token_logps": sampling_logprobs, "completion_mask": mask, "tool_mask": None}
    exec(textwrap.dedent("\n".join(block)), scope)  # noqa: S102 - TRL's own code, from its installed source
    return scope["vllm_importance_sampling_ratio"]


def trl_loss(inputs: dict[str, torch.Tensor], options: dict[str, Any]) -> dict[str, torch.Tensor]:
    logprobs = inputs["logprobs"].clone().requires_grad_()                       # (B, T)
    trainer = make_trainer(options, logprobs.shape[1])
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logprobs, torch.zeros_like(logprobs), None)
    batch, length = logprobs.shape
    mask = inputs["mask"]
    trl_inputs = {
        "prompt_ids": torch.ones(batch, 1, dtype=torch.long), "prompt_mask": torch.ones(batch, 1, dtype=torch.long),
        "completion_ids": torch.ones(batch, length, dtype=torch.long), "completion_mask": mask.long(),
        "advantages": inputs["advantages"], "old_per_token_logps": inputs["old_logprobs"],
        "ref_per_token_logps": inputs["ref_logprobs"], "num_items_in_batch": mask.sum(),
    }
    if trainer.use_vllm:
        trl_inputs["importance_sampling_ratio"] = sampler_mismatch_weight(
            trainer, inputs["old_logprobs"], inputs["sampling_logprobs"], mask)
    loss = trainer._compute_loss(None, trl_inputs)
    loss.backward()
    return {"loss": loss.detach(), "grad": logprobs.grad}


def table_policy(table: torch.Tensor) -> Callable[..., tuple[torch.Tensor, torch.Tensor, None]]:
    """`_get_per_token_logps_and_entropies` of a policy whose logits at completion position j of the
    sequence named by its first (prompt) token are table[sequence, j]: (B, L, V)."""

    def forward(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, None]:
        logp = table[input_ids[:, 0]].log_softmax(-1)                                   # (B, L, V)
        completion = input_ids[:, -logits_to_keep:]                                      # (B, L)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, completion.unsqueeze(-1)).squeeze(-1), entropy, None

    return forward


def trl_iterations(inputs: dict[str, torch.Tensor], options: dict[str, Any]) -> dict[str, torch.Tensor]:
    table = torch.nn.Parameter(inputs["table"].clone())                          # (B, L, V)
    completion_ids, mask = inputs["completion_ids"], inputs["mask"]              # (B, L) each
    batch = completion_ids.shape[0]
    trainer = make_trainer(options, completion_ids.shape[1])
    trainer._get_per_token_logps_and_entropies = table_policy(table)
    prompt_ids = torch.arange(batch).unsqueeze(1)                                # each sequence names its row

    def generate_and_score(_: Any) -> dict[str, torch.Tensor]:
        """What TRL's generation hands on: with several iterations per generation it records the
        policy's log-probabilities once, here, before the first optimiser step."""
        with torch.no_grad():
            old, _, _ = trainer._get_per_token_logps_and_entropies(
                None, torch.cat([prompt_ids, completion_ids], 1), None, completion_ids.shape[1])
        out = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
               "completion_mask": mask.long(), "advantages": inputs["advantages"], "old_per_token_logps": old,
               "num_items_in_batch": mask.sum()}
        if trainer.use_vllm:
            out["importance_sampling_ratio"] = sampler_mismatch_weight(trainer, old, inputs["sampling_logprobs"], mask)
        return out

    trainer._generate_and_score_completions = generate_and_score
    optimizer = torch.optim.SGD([table], lr=options["lr"])
    for _ in range(trainer.num_iterations):
        loss = trainer._compute_loss(None, trainer._prepare_inputs(None))  # generates once, then reuses the buffer
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        trainer._step += 1   # as GRPOTrainer.training_step does
    return {"table": table.detach()}


if __name__ == "__main__":
    tensors = torch.load(sys.argv[1])
    options = json.loads(open(sys.argv[2]).read())
    probe = trl_iterations if options.pop("probe", "loss") == "iterations" else trl_loss
    torch.save(probe(tensors, options), sys.argv[3])
