"""The probe's greedy continuation: decoded with the KV cache, it must be the continuation a full
recomputation of every prefix gives (the server is held to it token for token)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlpipe.trainer.probe import GREEDY_TOKENS, greedy_continuation, make_probe


def random_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def recomputed_greedy(model: torch.nn.Module, prompt_ids: list[int], tokens: int) -> list[int]:
    """The continuation by definition: each token the argmax after the whole prefix, no cache."""
    ids = list(prompt_ids)
    for _ in range(tokens):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def test_cached_greedy_decoding_equals_recomputing_every_prefix() -> None:
    for seed in range(3):
        model = random_llama(seed)
        prompt = [int(t) for t in torch.randint(0, 97, (11,), generator=torch.Generator().manual_seed(seed))]
        greedy, margins = greedy_continuation(model, prompt)
        assert greedy == recomputed_greedy(model, prompt, GREEDY_TOKENS)
        assert len(margins) == GREEDY_TOKENS and all(m >= 0 for m in margins)
        assert len(greedy_continuation(model, prompt, tokens=1)[0]) == 1


def test_the_probe_leaves_a_training_model_in_training_mode() -> None:
    model = random_llama(0).train()
    probe = make_probe(model, [1, 2, 3], [1, 2, 3, 4, 5])
    assert model.training
    assert len(probe["greedy_ids"]) == GREEDY_TOKENS and len(probe["logprobs"]) == 4
