"""rlpipe's objectives equal TRL's where TRL implements the same one: the loss and its gradient with
respect to the per-token log-probabilities, on identical inputs, within 1e-6.

TRL runs in the benchmark venv (`make bench-trl-venv`: TRL 1.16 beside the same torch), through
tests/unit/trl_loss_probe.py; without that venv the tests are skipped, saying so.

| rlpipe | TRL 1.16 GRPOTrainer |
|---|---|
| PPO clip, aggregation token_mean | loss_type="dapo" |
| PPO clip, aggregation seq_mean_token_mean | loss_type="grpo" |
| ratio_level="sequence" (GSPO) | importance_sampling_level="sequence" |
| policy_loss="cispo", cispo_cap | loss_type="cispo", epsilon_high |
| kl_coef, kl_estimator k3, kl_is_correction | beta, use_bias_correction_kl |
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from rlpipe.rl.batch import GlobalStats
from rlpipe.rl.losses import LossInputs, compute_loss
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
}


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    """Five sequences of up to 7 tokens (padding masked out), sampler logprobs near the trainer's
    (some tokens clip), a reference model further away, advantages of both signs."""
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3                     # (B, T)
    mask = torch.ones(5, 7, dtype=torch.float64)
    for row, length in enumerate((7, 3, 5, 1, 6)):
        mask[row, length:] = 0.0
    return {
        "logprobs": logprobs,
        "old_logprobs": logprobs + 0.1 * torch.randn(5, 7, generator=g, dtype=torch.float64),
        "ref_logprobs": logprobs + 0.5 * torch.randn(5, 7, generator=g, dtype=torch.float64),
        "advantages": torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75], dtype=torch.float64),
        "mask": mask,
    }


def rlpipe_loss(tensors: dict[str, torch.Tensor], fields: dict[str, Any]) -> tuple[float, torch.Tensor]:
    logprobs = tensors["logprobs"].clone().requires_grad_()
    mask = tensors["mask"]
    stats = GlobalStats(num_loss_tokens=int(mask.sum()), num_sequences=int((mask.sum(-1) > 0).sum()),
                        max_completion_tokens=mask.shape[1])
    x = LossInputs(logprobs=logprobs, sampler_logprobs=tensors["old_logprobs"], advantages=tensors["advantages"],
                   loss_mask=mask, entropy=torch.zeros_like(logprobs), ref_logprobs=tensors["ref_logprobs"])
    out = compute_loss(x, LossConfig.model_validate(fields), stats)
    out.loss.backward()
    assert logprobs.grad is not None
    return out.loss.item(), logprobs.grad


def trl_loss(tensors: dict[str, torch.Tensor], options: dict[str, Any], tmp_path: Path) -> tuple[float, torch.Tensor]:
    torch.save(tensors, tmp_path / "inputs.pt")
    (tmp_path / "options.json").write_text(json.dumps(options))
    done = subprocess.run([str(TRL_PYTHON), str(PROBE), str(tmp_path / "inputs.pt"), str(tmp_path / "options.json"),
                           str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    return out["loss"].item(), out["grad"]


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradient_equal_trls(case: str, inputs: dict[str, torch.Tensor], tmp_path: Path) -> None:
    fields, options = CASES[case]
    ours, our_grad = rlpipe_loss(inputs, fields)
    theirs, their_grad = trl_loss(inputs, options, tmp_path)
    assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-12)
    assert float((our_grad - their_grad).abs().max()) <= 1e-6 * max(float(their_grad.abs().max()), 1e-12)
    assert float(their_grad.abs().max()) > 0   # a comparison of two zeros would prove nothing
