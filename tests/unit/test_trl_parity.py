"""rlpipe's objectives equal TRL's where TRL implements the same one: the loss and its gradient with
respect to the per-token log-probabilities, on identical inputs, within 1e-6; and several optimiser
steps on one batch end with equal parameters.

TRL runs in the benchmark venv (`make bench-trl-venv`: TRL 1.16 beside the same torch), through
tests/unit/trl_loss_probe.py; without that venv the tests are skipped, saying so.

| rlpipe | TRL 1.16 GRPOTrainer |
|---|---|
| PPO clip, aggregation token_mean | loss_type="dapo" |
| PPO clip, aggregation seq_mean_token_mean | loss_type="grpo" |
| ratio_level="sequence" (GSPO) | importance_sampling_level="sequence" |
| policy_loss="cispo", cispo_cap | loss_type="cispo", epsilon_high |
| kl_coef, kl_estimator k3, kl_is_correction | beta, use_bias_correction_kl |
| off_policy="truncated_is", tis_cap, tis_floor | vllm_importance_sampling_mode="token_truncate", clip_max, clip_min |
| off_policy="sequence_truncate" / "sequence_mask" | vllm_importance_sampling_mode of the same name |
| off_policy="decoupled", decoupled_weight_cap | vllm_importance_sampling_mode="token_mask", clip_max |
| batch.epochs | num_iterations |

In TRL's sampler-mismatch modes the trainer's log-probabilities before the update ("old") anchor the
ratio and the sampler's weight it; in rlpipe these are the proximal and the sampler log-probabilities.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from rlpipe.rl.batch import GlobalStats, Sample, collate
from rlpipe.rl.losses import LossInputs, compute_loss
from rlpipe.rl.step import train_updates
from rlpipe.schemas.algorithm import LossConfig

REPO = Path(__file__).resolve().parents[2]
TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
PROBE = Path(__file__).with_name("trl_loss_probe.py")

pytestmark = pytest.mark.skipif(
    not TRL_PYTHON.exists(), reason="TRL is not installed: `make bench-trl-venv` makes the venv they compare with"
)

CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (rlpipe LossConfig fields, TRL options)
    "ppo-token-mean": ({"clip_high": 0.28}, {"loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.28}),
    "ppo-seq-mean": ({"aggregation": "seq_mean_token_mean"},
                     {"loss_type": "grpo", "epsilon_low": 0.2, "epsilon_high": 0.2}),
    "gspo": ({"ratio_level": "sequence", "clip_low": 0.03, "clip_high": 0.04},
             {"loss_type": "dapo", "importance_sampling_level": "sequence", "epsilon_low": 0.03,
              "epsilon_high": 0.04}),
    "gspo-seq-mean": ({"ratio_level": "sequence", "aggregation": "seq_mean_token_mean", "clip_low": 0.03,
                       "clip_high": 0.04},
                      {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon_low": 0.03,
                       "epsilon_high": 0.04}),
    "cispo": ({"policy_loss": "cispo", "cispo_cap": 1.1},
              {"loss_type": "cispo", "epsilon_low": 0.2, "epsilon_high": 1.1}),
    "kl-is-correction": ({"kl_coef": 0.05, "kl_is_correction": True},
                         {"loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.2, "beta": 0.05,
                          "use_bias_correction_kl": True}),
    "token-truncate": ({"off_policy": "truncated_is", "tis_cap": 1.2, "tis_floor": 0.8},
                       {"loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.2,
                        "vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 1.2,
                        "vllm_importance_sampling_clip_min": 0.8}),
    "token-mask": ({"off_policy": "decoupled", "decoupled_weight_cap": 1.2},
                   {"loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.2,
                    "vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_max": 1.2}),
    **{mode: ({"off_policy": mode, "tis_cap": 1.1, "tis_floor": 0.75},
              {"loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.2,
               "vllm_importance_sampling_mode": mode, "vllm_importance_sampling_clip_max": 1.1,
               "vllm_importance_sampling_clip_min": 0.75})
       for mode in ("sequence_truncate", "sequence_mask")},
}


@pytest.fixture(scope="module")
def inputs() -> dict[str, Tensor]:
    """Five sequences of up to 7 tokens (padding masked out), old logprobs near the trainer's (some
    tokens clip), sampler logprobs near those (some weights leave the bounds), a reference model
    further away, advantages of both signs."""
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3                     # (B, T)
    mask = torch.ones(5, 7, dtype=torch.float64)
    for row, length in enumerate((7, 3, 5, 1, 6)):
        mask[row, length:] = 0.0
    old = logprobs + 0.1 * torch.randn(5, 7, generator=g, dtype=torch.float64)
    return {
        "logprobs": logprobs,
        "old_logprobs": old,
        "sampling_logprobs": old + 0.2 * torch.randn(5, 7, generator=g, dtype=torch.float64),
        "ref_logprobs": logprobs + 0.5 * torch.randn(5, 7, generator=g, dtype=torch.float64),
        "advantages": torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75], dtype=torch.float64),
        "mask": mask,
    }


def rlpipe_loss(tensors: dict[str, Tensor], fields: dict[str, Any]) -> tuple[float, Tensor, float]:
    """The loss, its gradient and the fraction of loss tokens whose importance weight left its bounds."""
    logprobs = tensors["logprobs"].clone().requires_grad_()
    mask = tensors["mask"]
    cfg = LossConfig.model_validate(fields)
    stats = GlobalStats(num_loss_tokens=int(mask.sum()), num_sequences=int((mask.sum(-1) > 0).sum()),
                        max_completion_tokens=mask.shape[1])
    corrected = cfg.off_policy != "none"   # TRL's old log-probabilities are then rlpipe's proximal ones
    x = LossInputs(logprobs=logprobs, sampler_logprobs=tensors["sampling_logprobs" if corrected else "old_logprobs"],
                   advantages=tensors["advantages"], loss_mask=mask, entropy=torch.zeros_like(logprobs),
                   proximal_logprobs=tensors["old_logprobs"] if corrected else None,
                   ref_logprobs=tensors["ref_logprobs"])
    out = compute_loss(x, cfg, stats)
    out.loss.backward()
    assert logprobs.grad is not None
    return out.loss.item(), logprobs.grad, out.sums["is_capped_frac"].item() / stats.num_loss_tokens


def run_trl(tensors: dict[str, Tensor], options: dict[str, Any], tmp_path: Path) -> dict[str, Tensor]:
    torch.save(tensors, tmp_path / "inputs.pt")
    (tmp_path / "options.json").write_text(json.dumps(options))
    done = subprocess.run([str(TRL_PYTHON), str(PROBE), str(tmp_path / "inputs.pt"), str(tmp_path / "options.json"),
                           str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Tensor] = torch.load(tmp_path / "out.pt")
    return out


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradient_equal_trls(case: str, inputs: dict[str, Tensor], tmp_path: Path) -> None:
    fields, options = CASES[case]
    ours, our_grad, out_of_bounds = rlpipe_loss(inputs, fields)
    theirs = run_trl(inputs, options, tmp_path)
    assert ours == pytest.approx(theirs["loss"].item(), rel=1e-6, abs=1e-12)
    their_grad = theirs["grad"]
    assert float((our_grad - their_grad).abs().max()) <= 1e-6 * max(float(their_grad.abs().max()), 1e-12)
    assert float(their_grad.abs().max()) > 0   # a comparison of two zeros would prove nothing
    if "off_policy" in fields:   # the bounds act on part of the batch, so both of their branches are compared
        assert 0.0 < out_of_bounds < 1.0


def test_a_mismatched_option_differs(inputs: dict[str, Tensor], tmp_path: Path) -> None:
    """The comparison can fail: rlpipe's sequence_mask against TRL's sequence_truncate."""
    ours, _, _ = rlpipe_loss(inputs, CASES["sequence_mask"][0])
    theirs = run_trl(inputs, CASES["sequence_truncate"][1], tmp_path)
    assert abs(ours - theirs["loss"].item()) > 1e-3


# -- several optimiser steps on one batch --------------------------------------------------------
class TablePolicy(nn.Module):
    """A policy whose logits at completion slot j of the sequence named by its prompt token are
    table[sequence, j] -- the probe's policy, in the shape rlpipe's trainer calls (logits by column)."""

    def __init__(self, table: Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(table.clone())          # (B, L, V)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> SimpleNamespace:
        rows = self.table[input_ids[:, 0]]                # (N, L, V): slot j is predicted at column j
        pad = rows.new_zeros(rows.shape[0], input_ids.shape[1] - rows.shape[1], rows.shape[2])
        return SimpleNamespace(logits=torch.cat([rows, pad], 1))   # (N, T, V), T = 1 + L


ITERATION_CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # on-policy PPO: rlpipe's anchor is the sampler, which here is the policy before the first step
    "ppo": ({"clip_high": 0.28}, {"loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.28}),
    # a sampler that differs: the anchor is the policy before the first step, the sampler weights it
    "token-truncate": ({"off_policy": "truncated_is", "tis_cap": 1.2, "tis_floor": 0.8},
                       {"loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.2,
                        "vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 1.2,
                        "vllm_importance_sampling_clip_min": 0.8}),
}


@pytest.fixture(scope="module")
def table_batch() -> dict[str, Tensor]:
    """Six sequences of up to 5 completion tokens over a vocabulary of 11, a random logit table."""
    g = torch.Generator().manual_seed(1)
    batch, length, vocab = 6, 5, 11
    table = torch.randn(batch, length, vocab, generator=g, dtype=torch.float64)
    completion_ids = torch.randint(0, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.float64)
    for row, n in enumerate((5, 2, 4, 1, 3, 5)):
        mask[row, n:] = 0.0
    policy = table.log_softmax(-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)   # (B, L)
    return {"table": table, "completion_ids": completion_ids, "mask": mask,
            "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5], dtype=torch.float64),
            "policy_logprobs": policy,
            "sampling_logprobs": policy + 0.2 * torch.randn(batch, length, generator=g, dtype=torch.float64)}


def rlpipe_epochs(batch: dict[str, Tensor], fields: dict[str, Any], epochs: int,
                  lr: float) -> tuple[Tensor, dict[str, float]]:
    """rlpipe's trainer loop (`train_updates`) over the batch for `epochs` optimiser steps: the table
    after, and the step's metrics."""
    cfg = LossConfig.model_validate(fields)
    sampler = batch["sampling_logprobs"] if cfg.off_policy != "none" else batch["policy_logprobs"]
    samples = [Sample(prompt_ids=[row], completion_ids=batch["completion_ids"][row, :n].tolist(),
                      loss_mask=[1] * n, sampler_logprobs=sampler[row, :n].tolist(), reward=0.0, group_id="g",
                      policy_version=0, advantage=float(batch["advantages"][row]))
               for row, n in enumerate(batch["mask"].sum(-1).long().tolist())]
    stats = GlobalStats(num_loss_tokens=int(batch["mask"].sum()), num_sequences=len(samples),
                        max_completion_tokens=batch["mask"].shape[1])
    policy = TablePolicy(batch["table"])
    metrics = train_updates(policy, torch.optim.SGD(policy.parameters(), lr=lr),
                            [[collate(samples, stats, pad_token_id=0, dtype=torch.float64)]], cfg, epochs=epochs,
                            grad_clip=None)
    return policy.table.detach(), metrics


@pytest.mark.parametrize("case", ITERATION_CASES)
def test_several_optimiser_steps_on_one_batch_equal_trls_iterations(
        case: str, table_batch: dict[str, Tensor], tmp_path: Path) -> None:
    fields, options = ITERATION_CASES[case]
    lr = 5.0   # large enough that the second step's ratios leave the clip range
    ours, metrics = rlpipe_epochs(table_batch, fields, epochs=2, lr=lr)
    assert metrics["clip_frac"] > 0.1, "the second step's ratios reach the clip (the first one's are all 1)"
    theirs = run_trl(table_batch, {**options, "probe": "iterations", "num_iterations": 2, "lr": lr}, tmp_path)["table"]
    assert float((ours - theirs).abs().max()) <= 1e-6 * float((theirs - table_batch["table"]).abs().max())
    # the comparison can fail: a second step anchored anywhere else, or no second step, ends elsewhere
    one_step, _ = rlpipe_epochs(table_batch, fields, epochs=1, lr=lr)
    assert float((one_step - theirs).abs().max()) > 1e-3
