"""One optimisation step on a tiny Llama: logprob alignment, metrics, clipping, the data-parallel group."""

import functools
import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlpipe.rl.batch import Sample, collate
from rlpipe.rl.batching import global_stats, plan_step
from rlpipe.rl.distributed import DataParallelGroup
from rlpipe.rl.step import accumulate_gradients, completion_logprobs, make_optimizer, train_step
from rlpipe.schemas.algorithm import AdvantageConfig, BatchConfig, LossConfig, OptimConfig
from rlpipe.trainer.engine import EngineSpec, LocalEngine

F64 = torch.float64
TINY = LlamaConfig(
    vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(TINY, dtype=F64)


def draft_samples() -> list[Sample]:
    """Two groups, unequal lengths, a tool token; sampler logprobs are placeholders."""
    g = torch.Generator().manual_seed(3)
    spec = [("x", 4, 6, {2}, 1.0), ("x", 4, 3, set(), 0.0), ("y", 2, 8, {0, 5}, 0.2), ("y", 2, 2, set(), 0.8)]
    return [
        Sample(torch.randint(1, 48, (p,), generator=g).tolist(), torch.randint(1, 48, (c,), generator=g).tolist(),
               [0 if i in tool else 1 for i in range(c)], [0.0] * c, r, grp, 3)
        for grp, p, c, tool, r in spec
    ]


def on_policy(model: LlamaForCausalLM, drafts: list[Sample]) -> list[Sample]:
    """The samples with sampler logprobs equal to the model's own (a perfectly synced sampler)."""
    batch = collate(drafts, global_stats(drafts, world_size=1), pad_token_id=0, dtype=F64)
    with torch.no_grad():
        logprobs, _ = completion_logprobs(model, batch)                          # (N, L)
    return [
        Sample(s.prompt_ids, s.completion_ids, s.loss_mask, logprobs[i, : len(s.completion_ids)].tolist(),
               s.reward, s.group_id, s.policy_version)
        for i, s in enumerate(drafts)
    ]


def test_completion_logprobs_shift_by_one_and_ignore_padding(model: LlamaForCausalLM) -> None:
    samples = draft_samples()
    batch = collate(samples, global_stats(samples, world_size=1), pad_token_id=0, dtype=F64)
    with torch.no_grad():
        logprobs, entropy = completion_logprobs(model, batch, temperature=0.7)   # (N, L) x 2
        for i, s in enumerate(samples):
            p, c = len(s.prompt_ids), len(s.completion_ids)
            ids = torch.tensor([[*s.prompt_ids, *s.completion_ids]])
            logp = (model(input_ids=ids).logits[0, p - 1 : p + c - 1] / 0.7).log_softmax(-1)   # (C, V) unpadded
            expected = logp[torch.arange(c), torch.tensor(s.completion_ids)]
            torch.testing.assert_close(logprobs[i, :c], expected, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(entropy[i, :c], -(logp.exp() * logp).sum(-1), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk_tokens", [1, 5, 1000])
def test_chunked_logits_give_the_same_logprobs_entropy_and_gradients(model: LlamaForCausalLM,
                                                                      chunk_tokens: int) -> None:
    samples = draft_samples()
    batch = collate(samples, global_stats(samples, world_size=1), pad_token_id=0, dtype=F64)
    results = []
    for chunks in (None, chunk_tokens):
        model.zero_grad(set_to_none=True)
        logprobs, entropy = completion_logprobs(model, batch, temperature=0.7, chunk_tokens=chunks)   # (N, L) x 2
        ((logprobs * batch.loss_mask).sum() + entropy.sum()).backward()   # both terms carry a gradient
        results.append((logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
    (full_lp, full_ent, full_grads), (lp, ent, grads) = results
    torch.testing.assert_close(lp, full_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, full_ent, rtol=1e-12, atol=1e-12)
    for got, expected in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_a_chunked_step_trains_to_the_same_parameters(model: LlamaForCausalLM) -> None:
    samples = on_policy(model, draft_samples())
    after = []
    for loss in (LossConfig(entropy_coef=0.01), LossConfig(entropy_coef=0.01, logit_chunk_tokens=4)):
        torch.manual_seed(0)
        policy = LlamaForCausalLM._from_config(TINY, dtype=F64)
        plan = plan_step(samples, advantage=AdvantageConfig(), loss=loss, batch=BatchConfig(micro_batches=2),
                         pad_token_id=0, dtype=F64)
        train_step(policy, make_optimizer(policy.parameters(), OptimConfig(lr=1e-2)), plan.shards[0], loss,
                   grad_clip=1.0)
        after.append(list(policy.parameters()))
    for chunked, full in zip(after[1], after[0], strict=True):
        torch.testing.assert_close(chunked, full, rtol=1e-9, atol=1e-12)


def test_activation_checkpointing_trains_to_the_same_parameters(tmp_path: Path) -> None:
    torch.manual_seed(0)
    LlamaForCausalLM._from_config(TINY, dtype=torch.float32).save_pretrained(tmp_path)
    samples, after = draft_samples(), []
    for checkpointed in (False, True):
        engine = LocalEngine(EngineSpec(tmp_path, tmp_path, None, LossConfig(), OptimConfig(lr=1e-2), world_size=1,
                                        activation_checkpointing=checkpointed))
        assert engine.model.is_gradient_checkpointing == checkpointed
        plan = plan_step(samples, advantage=AdvantageConfig(), loss=LossConfig(), batch=BatchConfig(),
                         pad_token_id=0)
        engine.step([plan], seed=0)
        after.append(engine.state_dict())
    for name, full in after[0].items():
        torch.testing.assert_close(after[1][name], full, rtol=1e-6, atol=1e-7)


def test_chunked_logits_refuse_a_model_whose_logits_are_scaled(model: LlamaForCausalLM) -> None:
    samples = draft_samples()
    batch = collate(samples, global_stats(samples, world_size=1), pad_token_id=0, dtype=F64)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        completion_logprobs(model, batch, chunk_tokens=4)


def test_on_policy_step_metrics_match_hand_computation(model: LlamaForCausalLM) -> None:
    samples = on_policy(model, draft_samples())
    plan = plan_step(samples, advantage=AdvantageConfig(kind="dr_grpo"), loss=LossConfig(),
                     batch=BatchConfig(micro_batches=2), pad_token_id=0, dtype=F64)
    m = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), plan.shards[0], LossConfig(), grad_clip=None)
    # dr_grpo: x -> [+.5, -.5], y -> [-.3, +.3]; loss tokens per sample [5, 3, 6, 2] = 16.
    # On policy every ratio is 1, so the token-mean loss is -sum(A_i * n_i) / 16.
    assert m["loss"] == pytest.approx(-(0.5 * 5 - 0.5 * 3 - 0.3 * 6 + 0.3 * 2) / 16, rel=1e-9)
    assert (m["num_loss_tokens"], m["num_sequences"], m["num_tokens"]) == (16, 4, 10 + 7 + 10 + 4)
    assert m["is_weight_mean"] == pytest.approx(1.0) and m["is_weight_max"] == pytest.approx(1.0)
    assert m["mismatch"] == pytest.approx(0.0, abs=1e-9) and m["kl_sampler"] == pytest.approx(0.0, abs=1e-9)
    assert m["clip_frac"] == 0.0 and m["kl_ref"] == 0.0
    assert (m["adv_mean"], m["adv_std"], m["adv_max"], m["adv_min"]) == pytest.approx((0.0, math.sqrt(0.17), 0.5, -0.5))
    assert 0 < m["entropy"] < math.log(48)


def test_clip_and_step_use_the_accumulated_gradient(model: LlamaForCausalLM) -> None:
    samples = on_policy(model, draft_samples())
    shard = plan_step(samples, advantage=AdvantageConfig(), loss=LossConfig(), batch=BatchConfig(micro_batches=4),
                      pad_token_id=0, dtype=F64).shards[0]
    accumulate_gradients(model, shard, LossConfig())
    grad = [p.grad.clone() for p in model.parameters()]
    norm = torch.cat([g.reshape(-1) for g in grad]).norm().item()
    model.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in model.parameters()]
    m = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), shard, LossConfig(), grad_clip=norm / 4)
    assert m["grad_norm"] == pytest.approx(norm, rel=1e-9)                    # reported before clipping
    for p, b, g in zip(model.parameters(), before, grad, strict=True):
        torch.testing.assert_close(b - p.detach(), g / 4, rtol=1e-6, atol=1e-12)   # clipped to a quarter
        assert p.grad is None                                                  # zeroed for the next step


def test_step_refuses_a_misconfigured_call(model: LlamaForCausalLM) -> None:
    samples = on_policy(model, draft_samples())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    one_rank = plan_step(samples, advantage=AdvantageConfig(), loss=LossConfig(), batch=BatchConfig(),
                         pad_token_id=0).shards[0]
    with pytest.raises(ValueError, match="reference model"):
        train_step(model, opt, one_rank, LossConfig(kl_coef=0.1), grad_clip=None)
    two_ranks = plan_step(samples, advantage=AdvantageConfig(), loss=LossConfig(), batch=BatchConfig(world_size=2),
                          pad_token_id=0).shards[0]
    with pytest.raises(ValueError, match="DataParallelGroup"):
        train_step(model, opt, two_ranks, LossConfig(), grad_clip=None)


def test_make_optimizer_reads_the_config() -> None:
    cfg = OptimConfig(lr=3e-6, betas=(0.9, 0.95), weight_decay=0.01)
    opt = make_optimizer(torch.nn.Linear(2, 2).parameters(), cfg)
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.AdamW)
    assert (group["lr"], group["betas"], group["weight_decay"]) == (3e-6, (0.9, 0.95), 0.01)


class FailsOnRankOne(torch.nn.Module):
    """A tiny Llama whose forward raises on rank 1 only, after its weights were gathered."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaForCausalLM._from_config(TINY, dtype=F64)

    def forward(self, **kwargs: torch.Tensor) -> object:
        out = self.model(**kwargs)
        if torch.distributed.get_rank() == 1:
            raise RuntimeError("rank 1 broke in its forward pass")
        return out


def test_a_failing_rank_raises_in_the_caller_instead_of_hanging() -> None:
    """Rank 1 fails in its forward pass and never joins the gradient reduction that rank 0 waits in
    (rank 0 has no data: it runs a filler in lockstep). The caller must get rank 1's traceback and
    rank 0 must be stopped, rather than both waiting forever."""
    samples = draft_samples()
    stats = global_stats(samples, world_size=2)
    shards = [[collate([], stats, pad_token_id=0)], [collate(samples, stats, pad_token_id=0)]]
    group = DataParallelGroup(2, FailsOnRankOne, functools.partial(torch.optim.SGD, lr=0.1), timeout_s=60)
    with group, pytest.raises(RuntimeError, match="(?s)rank 1 failed.*broke in its forward"):
        group.step(shards, LossConfig(), grad_clip=None)
    assert not any(p.is_alive() for p in group._procs)
    with pytest.raises(ValueError, match="2 shards"):
        group.step(shards[:1], LossConfig(), grad_clip=None)


def test_configs_default_and_reject_what_they_would_ignore() -> None:
    assert (BatchConfig().micro_batches, OptimConfig().grad_clip) == (1, 1.0)
    with pytest.raises(ValueError, match="split='tokens'"):
        BatchConfig(micro_batch_tokens=4096)
    with pytest.raises(ValueError, match="split='count'"):
        BatchConfig(split="tokens", micro_batches=4)
    with pytest.raises(ValueError, match="betas"):
        OptimConfig(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="extra"):
        OptimConfig(learning_rate=1e-6)
