"""The probe: a fixed prompt whose teacher-forced logprobs and greedy continuation the trainer
records when it publishes a version; an inference server must reproduce both after loading it
(weights/sync.py), or the sync is rolled back."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from rlpipe.envs.base import ChatMessage
from rlpipe.policy.chat import chat_prompt_ids

PROBE_MESSAGES: list[ChatMessage] = [{"role": "user", "content": "What is 17 + 25? Answer in <answer></answer>."}]
PROBE_ANSWER = "<answer>42</answer>"
GREEDY_TOKENS = 16

ProbeRecord = dict[str, list[int] | list[float]]
"""token_ids and their teacher-forced logprobs; prompt_ids, their greedy_ids continuation and, per
greedy token, its greedy_margins."""


def probe_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """(prompt ids, prompt + a fixed answer ids)."""
    prompt = chat_prompt_ids(tokenizer, PROBE_MESSAGES)
    return prompt, prompt + list(tokenizer.encode(PROBE_ANSWER, add_special_tokens=False))


@torch.no_grad()
def teacher_forced_logprobs(model: torch.nn.Module, token_ids: list[int]) -> list[float]:
    """log p(token_ids[i] | token_ids[:i]) for i >= 1 under raw logits (temperature 1), the same
    quantity vLLM returns as prompt logprobs."""
    ids = torch.tensor([token_ids], device=_device(model))                       # (1, T)
    logits = model(input_ids=ids).logits[0, :-1].float()                          # (T-1, V)
    logprobs = torch.log_softmax(logits, dim=-1)                                  # (T-1, V)
    return logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()             # (T-1,)


@torch.no_grad()
def greedy_continuation(model: torch.nn.Module, prompt_ids: list[int],
                        tokens: int = GREEDY_TOKENS) -> tuple[list[int], list[float]]:
    """Exactly `tokens` argmax tokens after the prompt, end-of-sequence included like any other
    token (the server is asked with ignore_eos, which keeps sampling past it the same way), and the
    margin of each: how far its logit leads the runner-up's. A server whose logprobs differ from
    these by less than half the margin picks the same token; below that (a near-tie, common in
    bf16) the two continuations may part without either being wrong (weights/sync.py).

    Decoded with the KV cache, as the server decodes: one pass over the prompt, then one token per
    forward (a full forward per token made the probe ~4x slower on a CPU trainer's publish path)."""
    device = _device(model)
    out = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True, logits_to_keep=1)
    greedy: list[int] = []
    margins: list[float] = []
    while True:
        top = out.logits[0, -1].float().topk(2)                                        # logits: (1, 1, V)
        greedy.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        if len(greedy) == tokens:
            return greedy, margins
        out = model(input_ids=torch.tensor([[greedy[-1]]], device=device), past_key_values=out.past_key_values,
                    use_cache=True)


def make_probe(model: torch.nn.Module, prompt_ids: list[int], scored_ids: list[int]) -> ProbeRecord:
    """The probe record of `model` for the ids of `probe_ids`. Takes ids, not the tokenizer, so that
    it can run where the weights live (a data-parallel rank: `functools.partial` of it pickles small)."""
    was_training = model.training
    model.eval()
    greedy, margins = greedy_continuation(model, prompt_ids)
    probe: ProbeRecord = {"token_ids": scored_ids, "logprobs": teacher_forced_logprobs(model, scored_ids),
                          "prompt_ids": prompt_ids, "greedy_ids": greedy, "greedy_margins": margins}
    model.train(was_training)
    return probe


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
