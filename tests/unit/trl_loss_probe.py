"""TRL's GRPO loss on given per-token tensors: run by tests/unit/test_trl_parity.py with the Python
of the benchmark venv (`make bench-trl-venv`, TRL 1.16), never imported by rlpipe.

    python trl_loss_probe.py INPUTS.pt OPTIONS.json OUTPUT.pt

The trainer is built without `__init__` (no model, no dataset, one process, no accumulation), and its
model forward is replaced by the given log-probabilities, so what runs is `GRPOTrainer._compute_loss`
itself: importance ratios, clipping or CISPO weights, the KL term and the loss type's normaliser. The
output holds the loss and its gradient with respect to the log-probabilities.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import torch
from trl import GRPOTrainer


class OneProcess:
    """The parts of accelerate's Accelerator that `_compute_loss` touches, for one process."""

    num_processes = 1
    sync_gradients = True

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    gather_for_metrics = gather

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor


def trl_loss(inputs: dict[str, torch.Tensor], options: dict[str, Any]) -> dict[str, torch.Tensor]:
    logprobs = inputs["logprobs"].clone().requires_grad_()                       # (B, T)
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
    trainer.use_vllm = False
    trainer.vllm_importance_sampling_correction = False
    trainer.max_completion_length = logprobs.shape[1]
    trainer.current_gradient_accumulation_steps = 1
    trainer.model = SimpleNamespace(training=True)
    trainer.accelerator = OneProcess()
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logprobs, torch.zeros_like(logprobs), None)
    batch, length = logprobs.shape
    mask = inputs["mask"]
    trl_inputs = {
        "prompt_ids": torch.ones(batch, 1, dtype=torch.long), "prompt_mask": torch.ones(batch, 1, dtype=torch.long),
        "completion_ids": torch.ones(batch, length, dtype=torch.long), "completion_mask": mask.long(),
        "advantages": inputs["advantages"], "old_per_token_logps": inputs["old_logprobs"],
        "ref_per_token_logps": inputs["ref_logprobs"], "num_items_in_batch": mask.sum(),
    }
    loss = trainer._compute_loss(None, trl_inputs)
    loss.backward()
    return {"loss": loss.detach(), "grad": logprobs.grad}


if __name__ == "__main__":
    tensors = torch.load(sys.argv[1])
    torch.save(trl_loss(tensors, json.loads(open(sys.argv[2]).read())), sys.argv[3])
