"""A tiny Llama and its tokenizer, built in code in seconds, for tests.

A random model gives every sample the same (zero) reward, so an RL test on it cannot fail.
The builder therefore warms the model up with a few seconds of supervised training on short
arithmetic chats, some of them deliberately wrong or malformed: sampled answers are then
well-formed sometimes and right sometimes, and rewards vary across a group.

The build is reproducible byte for byte: it runs in a child process with a fixed thread count
and the math libraries held to one code path (`REPRODUCIBLE_ENV`), so neither the caller's
thread settings nor the machine's vector units change the weights; and its cache key covers
everything that shapes them (this module's code, the corpus, the seed, the library versions).
A test model cached on one machine is then the one any other machine builds.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rlpipe.policy import chat
from rlpipe.policy.chat import CHATML_TEMPLATE, IM_END, IM_START
from rlpipe.policy.checkpoint import build_once

ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2 (the SmolLM2 order)

BUILD_THREADS = 2
# The build's child process: a fixed thread count (float sums split the same way on every
# machine), and MKL, oneDNN and ATen held to their AVX2 code paths, which every x86-64 machine
# of the last decade runs, instead of whatever the CPU offers (AVX-512 rounds differently).
# MKL's fully portable path (MKL_CBWR=COMPATIBLE) doubled the build time for no machine we run.
REPRODUCIBLE_ENV = {
    "OMP_NUM_THREADS": str(BUILD_THREADS),
    "MKL_NUM_THREADS": str(BUILD_THREADS),
    "MKL_DYNAMIC": "FALSE",  # else MKL may use fewer threads on a busy machine, splitting sums differently
    "OMP_DYNAMIC": "FALSE",
    "MKL_CBWR": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "RAYON_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "CUDA_VISIBLE_DEVICES": "",
}

# Model shape: small enough to train for seconds on 2 cores, shaped the way vLLM-CPU accepts.
HIDDEN = 128
HEAD_DIM = 64  # vLLM CPU attention supports head_dim in {32, 64, 80, 96, 112, 128, ...}
LAYERS = 2
INTERMEDIATE = 256
MAX_POSITIONS = 512  # room for multi-turn test prompts
BPE_VOCAB = 384  # 256 byte symbols + 3 specials + merges learnt from the corpus

# Warm-up: enough to learn the format and some sums, far from learning them all.
WARMUP_STEPS = 300
WARMUP_BATCH = 32
WARMUP_LR = 3e-3
CORPUS_SIZE = 2000
WRONG_ANSWER_RATE = 0.25  # answer replaced by a near-miss number
MALFORMED_RATE = 0.10  # answer tags dropped or broken


def arithmetic_question(a: int, b: int) -> str:
    """The user turn of the warm-up task (the test environments can ask the same)."""
    return f"What is {a}+{b}? Answer in <answer></answer>."


def arithmetic_chat_corpus(seed: int, size: int = CORPUS_SIZE) -> list[str]:
    """ChatML conversations `a+b` with 0 <= a, b <= 9, some answers wrong or malformed on purpose."""
    rng = random.Random(seed)
    conversations = []
    for _ in range(size):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        answer = a + b
        roll = rng.random()
        # 1) a near miss  2) broken tags  3) the right answer, well-formed
        if roll < WRONG_ANSWER_RATE:
            reply = f"<answer>{max(0, answer + rng.choice((-2, -1, 1, 2)))}</answer>"
        elif roll < WRONG_ANSWER_RATE + MALFORMED_RATE:
            reply = rng.choice((f"{answer}", f"<answer>{answer}", f"answer {answer}</answer>"))
        else:
            reply = f"<answer>{answer}</answer>"
        conversations.append(
            f"{IM_START}user\n{arithmetic_question(a, b)}{IM_END}\n{IM_START}assistant\n{reply}{IM_END}"
        )
    return conversations


def build_tiny_tokenizer(corpus: Sequence[str], vocab_size: int = BPE_VOCAB) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `corpus`, with ChatML specials and template.

    Digits are split one by one (numbers tokenise the same everywhere); byte-level fallback
    means any text encodes, even text unlike the corpus.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_llama_config(vocab_size: int, eos_token_id: int, pad_token_id: int) -> LlamaConfig:
    """The tiny model's shape (see the module constants for the reasons)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HIDDEN // HEAD_DIM,
        num_key_value_heads=HIDDEN // HEAD_DIM,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype="float32",
    )


def warm_up(
    model: LlamaForCausalLM, sequences: list[list[int]], pad_id: int, steps: int, generator: torch.Generator
) -> float:
    """Next-token training on random batches of `sequences`; returns the last loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARMUP_LR, weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        picks = torch.randint(len(sequences), (WARMUP_BATCH,), generator=generator).tolist()
        batch = [sequences[i] for i in picks]
        T = max(len(s) for s in batch)
        ids = torch.full((len(batch), T), pad_id, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(batch), T), dtype=torch.long)  # (B, T) 1 on real tokens
        for row, seq in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        labels = ids.masked_fill(mask == 0, -100)  # padding is not a target
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    return loss.item()


def build_tiny_llama(
    out_dir: Path,
    seed: int = 0,
    corpus: Sequence[str] | None = None,
    warmup_steps: int = WARMUP_STEPS,
) -> Path:
    """Build (or reuse) the tiny model directory; deterministic given the arguments.

    `corpus` trains both the tokenizer and the warm-up; None means the arithmetic chats.
    `warmup_steps=0` leaves the model random.
    """
    texts = list(corpus) if corpus is not None else arithmetic_chat_corpus(seed)
    return build_once(Path(out_dir), build_fingerprint(texts, seed, warmup_steps),
                      lambda tmp: _build_in_child(tmp, seed, texts, warmup_steps))


def build_fingerprint(texts: Sequence[str], seed: int, warmup_steps: int) -> dict[str, object]:
    """The cache key of a build: everything that shapes the weights and the tokenizer."""
    builder_code = hashlib.sha256(Path(__file__).read_bytes() + Path(chat.__file__).read_bytes()).hexdigest()
    return {
        "builder": "tiny_llama",
        "builder_code_sha256": builder_code,
        "seed": seed,
        "warmup_steps": warmup_steps,
        "corpus_sha256": _texts_sha256(texts),
        "libraries": {"torch": torch.__version__, "transformers": transformers.__version__,
                      "tokenizers": tokenizers.__version__},
        "environment": REPRODUCIBLE_ENV,
    }


def _build_in_child(out_dir: Path, seed: int, texts: list[str], warmup_steps: int) -> None:
    """Run `_build` in a fresh interpreter under REPRODUCIBLE_ENV (thread pools and CPU dispatch
    are fixed when torch loads, so the caller's process cannot be pinned after the fact)."""
    with tempfile.TemporaryDirectory() as scratch:
        corpus_file = Path(scratch) / "corpus.json"
        corpus_file.write_text(json.dumps(texts))
        command = [sys.executable, "-m", "rlpipe.policy.tiny", str(out_dir), str(seed), str(warmup_steps),
                   str(corpus_file)]
        done = subprocess.run(command, env={**os.environ, **REPRODUCIBLE_ENV}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the tiny model failed (exit {done.returncode}):\n{done.stderr[-4000:]}")


def _build(out_dir: Path, seed: int, texts: list[str], warmup_steps: int) -> None:
    torch.set_num_threads(BUILD_THREADS)
    torch.use_deterministic_algorithms(True)
    tokenizer = build_tiny_tokenizer(texts)
    eos_id, pad_id = _special_id(tokenizer, IM_END), _special_id(tokenizer, ENDOFTEXT)
    config = tiny_llama_config(len(tokenizer), eos_token_id=eos_id, pad_token_id=pad_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    sequences = [tokenizer.encode(t, add_special_tokens=False)[:MAX_POSITIONS] for t in texts]
    generator = torch.Generator().manual_seed(seed)
    warm_up(model, sequences, pad_id, warmup_steps, generator)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _special_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(token_id, int), f"{token} is one token"
    return token_id


def _texts_sha256(texts: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode())
        digest.update(b"\x00")
    return digest.hexdigest()


if __name__ == "__main__":  # the child process of `_build_in_child`
    out, seed_arg, steps_arg, corpus_path = sys.argv[1:]
    _build(Path(out), int(seed_arg), json.loads(Path(corpus_path).read_text()), int(steps_arg))
