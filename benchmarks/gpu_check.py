"""The trainer's CUDA path, checked in two steps (issue #18, item 6): the trainer's engine on every
visible GPU (one rank per GPU over NCCL, FSDP2 from two ranks on), bf16 compute over fp32 master
weights, two timed train steps, then a bf16 publish the trainer's way (the full weights gathered
on rank 0, saved as safetensors, probed in fp32 from the file) — and what each took: step time,
rank 0's peak memory, publish time, checkpoint size. Never part of `make test`.

Without a GPU it runs the same path on CPU (gloo, two ranks unless told otherwise): that is how it
is exercised on the project's CPU machines; the CUDA run is its purpose.

    .venv/bin/python -m benchmarks.gpu_check [--model smollm2|tiny] [--world-size N] [--precision bf16]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.common import smollm2_model, tiny_model, write_result
from benchmarks.sharded_trainer import batch, held_bytes
from rlpipe.schemas.algorithm import Precision

NAME = "gpu_check"
STEPS = 2
MODELS = {"smollm2": smollm2_model, "tiny": tiny_model}


def peak_memory(model: torch.nn.Module) -> dict[str, float]:
    """On the rank that runs it: its model state and peak RSS (sharded_trainer.held_bytes) and, on a
    GPU, the most CUDA memory its tensors held at once."""
    cuda = next(model.parameters()).is_cuda
    return {**held_bytes(model), "peak_gpu_bytes": float(torch.cuda.max_memory_allocated()) if cuda else 0.0}


def check(model_dir: Path, world_size: int, precision: Precision) -> dict[str, Any]:
    from rlpipe.policy.chat import load_tokenizer
    from rlpipe.policy.checkpoint import load_state_dict, save_checkpoint
    from rlpipe.rl.batching import plan_updates
    from rlpipe.schemas.algorithm import AdvantageConfig, BatchConfig, LossConfig, OptimConfig
    from rlpipe.trainer.engine import EngineSpec, load_policy, open_engine
    from rlpipe.trainer.probe import make_probe, probe_ids

    loss = LossConfig()
    spec = EngineSpec(base_dir=model_dir, weights_dir=model_dir, optimizer_state=None, loss=loss, optim=OptimConfig(),
                      world_size=world_size, precision=precision)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    engine = open_engine(spec)
    try:
        step_s, losses = [], []
        for step in range(1, STEPS + 1):
            plans = plan_updates(batch(step, vocab_size), advantage=AdvantageConfig(), loss=loss,
                                 batch=BatchConfig(world_size=world_size), pad_token_id=0)
            t0 = time.perf_counter()
            losses.append(engine.step(plans, step)["loss"])
            step_s.append(time.perf_counter() - t0)
        memory = engine.evaluate(peak_memory)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            weights = engine.state_dict()   # gathered onto rank 0's CPU
            gather_s = time.perf_counter() - t0
            saved = save_checkpoint(weights, Path(tmp), model_dir, dtype=torch.bfloat16)
            published = load_state_dict(saved.path)
            probe = make_probe(load_policy(saved.path), *probe_ids(load_tokenizer(model_dir)))
            publish_s = time.perf_counter() - t0
    finally:
        engine.close()
    return {"world_size": world_size, "precision": precision, "step_s": step_s, "losses": losses, **memory,
            "master_dtypes": sorted({str(t.dtype) for t in weights.values()}),
            "published_dtypes": sorted({str(t.dtype) for t in published.values()}),
            "checkpoint_bytes": saved.size_bytes, "gather_s": gather_s, "publish_s": publish_s,
            "probe_logprob_mean": sum(probe["logprobs"]) / len(probe["logprobs"])}


def show(result: dict[str, Any], device: str) -> None:
    gib = 2**30
    table = Table(title=f"trainer on {device}: {result['world_size']} rank(s), {result['precision']} compute")
    for column in ("what", "value"):
        table.add_column(column)
    rows = [("train steps", ", ".join(f"{s:.2f} s" for s in result["step_s"])),
            ("losses", ", ".join(f"{x:.4f}" for x in result["losses"])),
            ("rank 0: model state / peak RSS", f"{result['model_state_bytes'] / gib:.2f} / "
                                               f"{result['peak_rss_bytes'] / gib:.2f} GiB"),
            ("rank 0: peak GPU memory", f"{result['peak_gpu_bytes'] / gib:.2f} GiB"),
            ("master weights / published", f"{result['master_dtypes']} / {result['published_dtypes']}"),
            ("publish: gather / gather + save + probe", f"{result['gather_s']:.2f} / {result['publish_s']:.2f} s"),
            ("checkpoint", f"{result['checkpoint_bytes'] / 2**20:.1f} MiB")]
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="smollm2")
    parser.add_argument("--world-size", type=int, default=torch.cuda.device_count() if cuda else 2,
                        help="ranks: every visible GPU by default (2 on CPU)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    args = parser.parse_args()
    device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if cuda else "CPU (no GPU found)"
    result = check(MODELS[args.model](), args.world_size, cast(Precision, args.precision))
    show(result, device)
    command = f".venv/bin/python -m benchmarks.{NAME} --model {args.model} --world-size {args.world_size} " \
              f"--precision {args.precision}"
    print(write_result(f"{NAME}_{'cuda' if cuda else 'cpu'}", {"device": device, **result}, command))


if __name__ == "__main__":
    main()
