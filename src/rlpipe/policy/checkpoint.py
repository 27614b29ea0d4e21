"""Model directories on disk: content hashes, safetensors checkpoints, build-once markers.

A checkpoint directory is a complete model directory (config, tokenizer, generation config,
`model.safetensors`) so that both vLLM (`reload_weights` with `weights_path=DIR`) and
transformers (`from_pretrained(DIR)`) load it. Its identity is the sha256 of the weights file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlpipe.storage.digest import sha256_file

WEIGHTS_FILE = "model.safetensors"
BUILD_MARKER = ".rlpipe-build.json"
# Everything in a model directory except the weights: what a checkpoint copies from its base.
MODEL_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class CheckpointInfo:
    """What a saved checkpoint is: where it lies, its content hash and its size."""

    path: Path
    sha256: str  # of model.safetensors: the content address of the weights
    size_bytes: int


def weights_sha256(model_dir: Path) -> str:
    """Content address of a model directory's weights.

    One `*.safetensors` file: its sha256 (the same value `save_checkpoint` returns).
    Several shards: sha256 over the lines `name:sha256` in name order.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    if len(files) == 1:
        return sha256_file(files[0])
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}:{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def _unshared(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies, keeping only the first name of tensors that share storage.

    Tied weights (`lm_head.weight` is `embed_tokens.weight` in SmolLM2) share memory, which
    safetensors refuses to save; the loaders of vLLM and transformers re-tie them from config.
    """
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


def save_checkpoint(
    state_dict: Mapping[str, torch.Tensor],
    out_dir: Path,
    base_dir: Path,
    dtype: torch.dtype | None = None,
) -> CheckpointInfo:
    """Write `state_dict` as `out_dir/model.safetensors` plus the base's config/tokenizer files.

    Written to a temporary name and renamed, so a reader never sees half a file.
    `dtype` casts floating tensors (e.g. bf16 to halve transfer size); None keeps them.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = _unshared(state_dict)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    for name in MODEL_SIDE_FILES:
        source = Path(base_dir) / name
        if source.exists() and source.resolve() != (out_dir / name).resolve():
            shutil.copyfile(source, out_dir / name)
    weights = out_dir / WEIGHTS_FILE
    partial = out_dir / f".{WEIGHTS_FILE}.partial"
    save_file(tensors, str(partial), metadata={"format": "pt"})
    os.replace(partial, weights)
    return CheckpointInfo(path=out_dir, sha256=sha256_file(weights), size_bytes=weights.stat().st_size)


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor from the `*.safetensors` files of a model directory, on CPU."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file), device="cpu"))
    return state


def build_once(out_dir: Path, fingerprint: Mapping[str, object], build: Callable[[Path], None]) -> Path:
    """Run `build(tmp_dir)` unless `out_dir` already holds a build with the same fingerprint.

    The build goes to a sibling temporary directory and is renamed into place, so a crash
    never leaves a directory that looks finished. An existing `out_dir` is replaced only if it
    is empty or was made by a previous build (it has the marker); anything else is an error,
    so a wrong path never deletes someone's files.
    """
    out_dir = Path(out_dir)
    marker = out_dir / BUILD_MARKER
    wanted = json.loads(json.dumps(dict(fingerprint), sort_keys=True))
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()) and not marker.exists():
        raise FileExistsError(f"{out_dir} exists and was not built by rlpipe; choose an empty path")
    tmp_dir = out_dir.with_name(f".{out_dir.name}.building-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    try:
        build(tmp_dir)
        (tmp_dir / BUILD_MARKER).write_text(json.dumps(wanted, sort_keys=True, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp_dir, out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir
