"""The trainer's engines with AdamW, as a run uses them: in fp32 two FSDP2 ranks (RankEngine) train
to the parameters and optimizer state of one process (LocalEngine), and the full state one world
size checkpoints restores into the other; in bf16 both keep fp32 master weights and take the fp32
step to within bf16 rounding."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlpipe.policy.checkpoint import save_checkpoint
from rlpipe.rl.batch import Sample
from rlpipe.rl.batching import plan_updates
from rlpipe.schemas.algorithm import AdvantageConfig, BatchConfig, LossConfig, OptimConfig, Precision
from rlpipe.trainer.engine import Engine, EngineSpec, LocalEngine, RankEngine, compute_in, step_seed

TINY = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True,
)
OPTIM = OptimConfig(lr=1e-2, grad_clip=1.0)
STEPS = 3
# (group, prompt length, completion length, tool-token positions)
SHAPES = [("a", 3, 5, {2}), ("a", 3, 9, {4, 5}), ("a", 3, 2, set()), ("b", 6, 7, {0}), ("b", 6, 3, set()),
          ("c", 2, 11, {3, 4}), ("c", 2, 4, set()), ("c", 2, 6, {1})]

LAYOUTS: dict[str, tuple[LossConfig, BatchConfig]] = {
    "token_mean": (LossConfig(aggregation="token_mean"), BatchConfig(micro_batches=2)),
    "seq_mean": (LossConfig(aggregation="seq_mean_token_mean"), BatchConfig(micro_batches=2)),
    # ranks with unequal micro-batch counts (a token budget), chunked logits, a sharded reference,
    # two mini-batches over two epochs (a proximal pass), checkpointed layers: every lockstep path
    "everything": (LossConfig(kl_coef=0.05, logit_chunk_tokens=3, off_policy="decoupled", clip_high=0.28),
                   BatchConfig(split="tokens", micro_batch_tokens=12, mini_batches=2, epochs=2,
                               activation_checkpointing=True)),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-fp32")
    torch.manual_seed(0)
    LlamaForCausalLM._from_config(TINY, dtype=torch.float32).save_pretrained(path)
    return path


def step_samples(step: int) -> list[Sample]:
    """Step `step`'s batch: random tokens and rewards, noisy sampler logprobs, some tool tokens."""
    g = torch.Generator().manual_seed(step)
    samples = []
    for group, prompt, completion, tool in SHAPES:
        mask = [0 if i in tool else 1 for i in range(completion)]
        logprobs = (-2.0 + 0.3 * torch.randn(completion, generator=g)).tolist()
        samples.append(Sample(torch.randint(1, 64, (prompt,), generator=g).tolist(),
                              torch.randint(1, 64, (completion,), generator=g).tolist(), mask,
                              [lp if m else math.nan for lp, m in zip(logprobs, mask, strict=True)],
                              float(torch.rand((), generator=g)), group, 0))
    return samples


def open_at(world_size: int, model_dir: Path, layout: str, weights_dir: Path | None = None,
            optimizer_state: dict[str, Any] | None = None, precision: Precision = "fp32",
            train_state_dir: Path | None = None) -> Engine:
    loss, batch = LAYOUTS[layout]
    spec = EngineSpec(base_dir=model_dir, weights_dir=weights_dir or model_dir, optimizer_state=optimizer_state,
                      loss=loss, optim=OPTIM, world_size=world_size, epochs=batch.epochs,
                      activation_checkpointing=batch.activation_checkpointing, precision=precision,
                      train_state_dir=train_state_dir)
    return LocalEngine(spec) if world_size == 1 else RankEngine(spec)


def train(engine: Engine, world_size: int, layout: str, steps: range) -> list[dict[str, float]]:
    loss, batch = LAYOUTS[layout]
    batch = batch.model_copy(update={"world_size": world_size})
    return [engine.step(plan_updates(step_samples(s), advantage=AdvantageConfig(kind="grpo"), loss=loss,
                                     batch=batch, pad_token_id=0), step_seed(OPTIM.seed, s)) for s in steps]


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[k].reshape(-1).double() for k in sorted(state)])


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def optimizer_moments(state: dict[str, Any]) -> torch.Tensor:
    return torch.cat([s[k].reshape(-1).double() for _, s in sorted(state["state"].items())
                      for k in ("exp_avg", "exp_avg_sq")])


def test_the_lockstep_layout_leaves_ranks_with_unequal_micro_batch_counts() -> None:
    loss, batch = LAYOUTS["everything"]
    plans = plan_updates(step_samples(1), advantage=AdvantageConfig(kind="grpo"), loss=loss,
                         batch=batch.model_copy(update={"world_size": 2}), pad_token_id=0)
    assert any(len(plan.shards[0]) != len(plan.shards[1]) for plan in plans)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_sharded_ranks_train_to_the_parameters_of_one_process(model_dir: Path, layout: str) -> None:
    local = open_at(1, model_dir, layout)
    single = train(local, 1, layout, range(1, STEPS + 1))
    sharded = open_at(2, model_dir, layout)
    try:
        both = train(sharded, 2, layout, range(1, STEPS + 1))
        weights, optimizer = sharded.state_dict(), sharded.optimizer_state_dict()
    finally:
        sharded.close()
    want = local.state_dict()
    assert weights.keys() == want.keys()
    assert relative_error(flat(weights), flat(want)) < 1e-5
    assert relative_error(flat(weights), flat(LlamaForCausalLM.from_pretrained(model_dir).state_dict())) > 1e-3
    # the optimizer state in the single-process format: same indices, groups and moments
    mine = local.optimizer_state_dict()
    assert optimizer["state"].keys() == mine["state"].keys()
    assert optimizer["param_groups"] == mine["param_groups"]
    assert relative_error(optimizer_moments(optimizer), optimizer_moments(mine)) < 1e-4
    for a, b in zip(both, single, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["num_sequences"] == b["num_sequences"]


@pytest.mark.parametrize(("before", "after", "state"), [(2, 1, "per rank"), (1, 2, "per rank"), (2, 1, "one file"),
                                                      (1, 2, "one file")])
def test_a_recovery_state_of_one_world_size_resumes_at_the_other(model_dir: Path, tmp_path: Path, before: int,
                                                               after: int, state: str) -> None:
    """Two steps at `before` ranks, their recovery state, the third step at `after`: the parameters of
    three undisturbed steps in one process. The state as the trainer writes it (a file per rank,
    torch.distributed.checkpoint), or as runs stored it before (published weights + full optimizer)."""
    layout = "token_mean"
    undisturbed = open_at(1, model_dir, layout)
    train(undisturbed, 1, layout, range(1, STEPS + 1))
    first = open_at(before, model_dir, layout)
    try:
        train(first, before, layout, range(1, STEPS))
        if state == "per rank":
            first.save_train_state(tmp_path / "state")
        else:
            save_checkpoint(first.state_dict(), tmp_path / "v2", model_dir)
            optimizer = first.optimizer_state_dict()
    finally:
        first.close()
    if state == "per rank":
        assert len(list((tmp_path / "state").glob("*.distcp"))) == before, "one file per rank"
        second = open_at(after, model_dir, layout, train_state_dir=tmp_path / "state")
    else:
        second = open_at(after, model_dir, layout, weights_dir=tmp_path / "v2", optimizer_state=optimizer)
    try:
        train(second, after, layout, range(STEPS, STEPS + 1))
        resumed = second.state_dict()
    finally:
        second.close()
    assert relative_error(flat(resumed), flat(undisturbed.state_dict())) < 1e-5


@pytest.mark.parametrize(("world_size", "layout"), [(1, "token_mean"), (2, "token_mean"), (2, "everything")])
def test_bf16_compute_keeps_fp32_master_weights_and_takes_the_fp32_step(model_dir: Path, world_size: int,
                                                                        layout: str) -> None:
    """One process autocasts, ranks use FSDP2's mixed-precision policy: either way the weights and the
    optimizer state stay fp32 and the update is the fp32 one up to bf16 rounding (measured: 5 % relative
    for token_mean, 11-22 % over the six optimiser steps of the layout with everything)."""
    base = flat(LlamaForCausalLM.from_pretrained(model_dir).state_dict())
    reference = open_at(1, model_dir, layout)
    train(reference, 1, layout, range(1, STEPS + 1))
    fp32_update = flat(reference.state_dict()) - base
    engine = open_at(world_size, model_dir, layout, precision="bf16")
    try:
        train(engine, world_size, layout, range(1, STEPS + 1))
        weights, optimizer = engine.state_dict(), engine.optimizer_state_dict()
    finally:
        engine.close()
    assert {t.dtype for t in weights.values()} == {torch.float32}
    assert {t.dtype for s in optimizer["state"].values() for t in (s["exp_avg"], s["exp_avg_sq"])} == {torch.float32}
    update = flat(weights) - base
    assert torch.nn.functional.cosine_similarity(update, fp32_update, dim=0) > 0.95
    # and bf16 really computed: fp32 takes the step to ~1e-6
    assert 1e-3 < relative_error(update, fp32_update) < 0.3


def test_bf16_compute_covers_the_output_layer_called_alone() -> None:
    """The chunked logits call the output layer outside the model's forward: it must compute in bf16 too."""
    torch.manual_seed(0)
    model = compute_in(LlamaForCausalLM._from_config(TINY, dtype=torch.float32), "bf16")
    ids = torch.randint(0, 64, (1, 5))
    assert model(input_ids=ids).logits.dtype == torch.bfloat16
    assert model.get_output_embeddings()(torch.randn(3, 32)).dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32
