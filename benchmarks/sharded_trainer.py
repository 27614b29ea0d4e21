"""The sharded trainer (issue #18): memory per rank and step time of the trainer's engines at world
size 1 and 2 on SmolLM2-135M, and what the same sharding means for 7B and 70B policies.

Measured, each layout in a child process of its own (so that one's peak memory is not the
other's): `LocalEngine` (world 1, the model in the process) and `RankEngine` (world 2: two FSDP2
ranks over gloo on this machine's cores, forked, then launched by torchrun) train the same synthetic
batches (8 sequences of ~128 tokens, GRPO, token-mean loss, AdamW, fp32), a warm-up step then the
timed ones; then each writes its recovery state (a file per rank, rl/train_state.py). Per rank:
- model state: the bytes of the parameters this rank holds (a DTensor's local shard) x 4, because
  its gradients and AdamW's two moments are fp32 tensors sharded exactly like the parameters;
- peak RSS (VmHWM) of the process holding the model: the rank, or the world-1 child; it includes
  Python, torch and transformers (~0.5 GiB) and the step's activations.

Computed, from the model configs alone (built on the meta device, so the parameter counts are
exact and nothing is allocated): Llama-2-7B's and 70B's fp32 parameters + gradients + AdamW state
per rank, replicated (the old engine's full replica on every rank) and sharded over 8, 16 and 64
ranks, plus the largest unit FSDP gathers whole during its passes (a decoder layer, or the
embedding and output layer of the root).

    .venv/bin/python -m benchmarks.sharded_trainer
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import summarize, write_result

NAME = "sharded_trainer"
BYTES_PER_PARAM = 16
"""fp32 parameter + fp32 gradient + AdamW's two fp32 moments."""
LARGE = {
    # Llama-2's published shapes
    "Llama-2-7B": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32},
    "Llama-2-70B": {"vocab_size": 32000, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8},
}
RANKS = (8, 16, 64)
LAYOUTS = ((1, "fork"), (2, "fork"), (2, "torchrun"))
"""(world size, how its ranks start): world 1 is the model in the child process itself."""


def held_bytes(model: Any) -> dict[str, float]:
    """On the rank that runs it: its model state (local parameter bytes x 4) and its peak RSS."""
    from torch.distributed.tensor import DTensor

    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())
    peak_kib = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("VmHWM"))
    return {"model_state_bytes": float(local * 4), "peak_rss_bytes": float(peak_kib * 1024)}


def batch(step: int, vocab_size: int = 40000) -> list[Any]:
    """Step `step`'s synthetic batch: 8 sequences (2 groups) of 64 prompt + 64 completion tokens."""
    import torch

    from rlpipe.rl.batch import Sample

    g = torch.Generator().manual_seed(step)
    return [Sample(torch.randint(10, vocab_size, (64,), generator=g).tolist(),
                   torch.randint(10, vocab_size, (64,), generator=g).tolist(), [1] * 64, [-2.0] * 64, float(i % 2),
                   f"g{i // 4}", 0) for i in range(8)]


def measure(world_size: int, steps: int, launch: str) -> dict[str, Any]:
    """This process's measurement of one layout (run in a child by `main`)."""
    from benchmarks.common import smollm2_model
    from benchmarks.sharded_trainer import held_bytes as module_held_bytes  # pickled by module name, not __main__
    from rlpipe.infra.process import free_port
    from rlpipe.rl.batching import plan_updates
    from rlpipe.rl.torchrun import TorchrunRanks
    from rlpipe.schemas.algorithm import AdvantageConfig, BatchConfig, LossConfig, OptimConfig
    from rlpipe.trainer.engine import EngineSpec, open_engine

    model_dir, loss = smollm2_model(), LossConfig()
    ranks = TorchrunRanks(rendezvous=f"127.0.0.1:{free_port()}", controller_port=free_port()) \
        if launch == "torchrun" else None
    engine = open_engine(EngineSpec(base_dir=model_dir, weights_dir=model_dir, optimizer_state=None, loss=loss,
                                    optim=OptimConfig(), world_size=world_size, ranks=ranks))
    try:
        step_s = []
        for step in range(steps + 1):
            plans = plan_updates(batch(step), advantage=AdvantageConfig(), loss=loss,
                                 batch=BatchConfig(world_size=world_size), pad_token_id=0)
            t0 = time.perf_counter()
            engine.step(plans, step)
            if step > 0:  # the first step is the warm-up
                step_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        engine.state_dict()   # what a publish gathers onto rank 0
        gather_s = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            engine.save_train_state(Path(tmp))   # what recovery stores: a file per rank
            state_s = time.perf_counter() - t0
            files = [p.stat().st_size for p in Path(tmp).glob("*.distcp")]
        held = engine.evaluate(module_held_bytes)
    finally:
        engine.close()
    return {"world_size": world_size, "launch": launch, "step_s": step_s, "gather_full_weights_s": gather_s,
            "train_state_s": state_s, "train_state_file_bytes": max(files), "train_state_bytes": sum(files), **held}


def large_models() -> dict[str, Any]:
    """Per-rank bytes of fp32 training state for Llama-2-7B and 70B, replicated and sharded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = {}
    for name, shape in LARGE.items():
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**shape))
        params = sum(p.numel() for p in model.parameters())
        layer = sum(p.numel() for p in model.model.layers[0].parameters())
        root = params - layer * len(model.model.layers)
        out[name] = {"params": params, "layer_params": layer, "root_params": root,
                     "replicated_gib": params * BYTES_PER_PARAM / 2**30,
                     "sharded_gib": {n: params * BYTES_PER_PARAM / n / 2**30 for n in RANKS},
                     # gathered whole while it runs: fp32 weights of the largest unit (and its gradient in backward)
                     "largest_gathered_gib": max(layer, root) * 4 * 2 / 2**30}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Memory per rank and step time of the trainer at world size 1 and 2.")
    parser.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)   # measure one layout, print JSON
    parser.add_argument("--launch", default="fork", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.child, args.steps, args.launch)))
        return
    measured = {}
    for world_size, launch in LAYOUTS:
        out = subprocess.run([sys.executable, "-m", f"benchmarks.{NAME}", "--steps", str(args.steps),
                              "--child", str(world_size), "--launch", launch],
                             check=True, capture_output=True, text=True).stdout
        m = json.loads(out.strip().splitlines()[-1])
        measured[f"{world_size} {launch}"] = {**m, "step_s": summarize(m["step_s"])}
    one, two, torchrun = measured["1 fork"], measured["2 fork"], measured["2 torchrun"]
    result = {"params": {"model": "SmolLM2-135M-Instruct", "steps": args.steps, "sequences": 8, "tokens_per_sequence": 128},
              "measured": measured,
              "ratios": {"model_state_per_rank_2_over_1": two["model_state_bytes"] / one["model_state_bytes"],
                         "peak_rss_per_rank_2_over_1": two["peak_rss_bytes"] / one["peak_rss_bytes"],
                         "step_time_2_over_1": two["step_s"].median / one["step_s"].median,
                         "step_time_torchrun_over_forked": torchrun["step_s"].median / two["step_s"].median,
                         "train_state_file_2_over_1": two["train_state_file_bytes"] / one["train_state_file_bytes"]},
              "large_models": large_models()}
    print(write_result(NAME, result))


if __name__ == "__main__":
    main()
