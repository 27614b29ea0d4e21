"""Trainer efficiency: the trainer worker's whole step against a bare PyTorch loop (issue #8, item 4).

The trainer's step (trainer/trainer.py) as the `train_steps` table records it, wall time from start
to commit: claim from the Postgres buffer, advantages and global denominators, forward/backward/AdamW,
batch metrics, checkpoint publish (safetensors + S3 upload + probe logprobs), commit. The bare loop
gets the very same batch (the trajectories that step claimed, read back and padded with the
project's `collate`) and does only forward, a policy-gradient loss, backward, clip and AdamW.
Trainer steps are taken from sync-mode runs, where nothing else runs beside the trainer.

`make bench` measures this at the end of benchmarks/async_vs_sync.py (same stack, same runs).
Alone it starts its own stack and one short sync run:

    .venv/bin/python -m benchmarks.trainer_efficiency
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import summarize, write_result

NAME = "trainer_efficiency"


def step_batch(db, run_id: str, step: int, pad_token_id: int):  # type: ignore[no-untyped-def]
    """The padded batch that step `step` of the run trained on, with GRPO advantages."""
    from rl.batch import collate
    from rl.batching import assign_advantages, global_stats
    from schemas.algorithm import AdvantageConfig
    from storage import buffer
    from trainer.samples import to_samples

    with db.begin() as s:
        samples = assign_advantages(to_samples(buffer.claimed_trajectories(s, run_id, step)), AdvantageConfig())
    return collate(samples, global_stats(samples, world_size=1), pad_token_id=pad_token_id)


def bare_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch) -> None:  # type: ignore[no-untyped-def]
    """Forward, token-mean policy-gradient loss, backward, clip, AdamW: nothing else."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits   # (N, T, V)
    logp = logits[:, :-1].log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)  # (N, T-1)
    logp = logp.gather(1, batch.completion_index - 1)                                      # (N, L)
    loss = -(logp * batch.advantages[:, None] * batch.loss_mask).sum() / batch.loss_mask.sum().clamp(min=1)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def compare(db, run_ids: list[str], model_dir: Path, repeats: int = 5) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Per trained step of the runs: trainer wall (claim..commit) and its parts vs the bare step."""
    from transformers import AutoTokenizer

    from observe.queries import step_metrics
    from trainer.engine import load_policy

    pad = AutoTokenizer.from_pretrained(model_dir).pad_token_id or 0
    model = load_policy(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.99))
    rows = []
    for run_id in run_ids:
        with db.begin() as s:
            steps = step_metrics(s, run_id)
        for st in steps:
            batch = step_batch(db, run_id, st.step, pad)
            bare_step(model, opt, batch)                       # warm-up (allocator, optimizer state)
            bare = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                bare_step(model, opt, batch)
                bare.append(time.perf_counter() - t0)
            tokens = int(batch.attention_mask.sum())
            rows.append({"run": run_id, "step": st.step, "tokens": tokens, "trainer_s": st.duration_s,
                         "train_s": st.metrics.get("train_s"), "claim_s": st.metrics.get("claim_s"),
                         "publish_s": st.metrics.get("publish_s"), "bare_s": summarize(bare).median})
    return {"steps": rows,
            "trainer_tokens_per_s": summarize([r["tokens"] / r["trainer_s"] for r in rows]),
            "trainer_compute_only_tokens_per_s": summarize([r["tokens"] / r["train_s"] for r in rows if r["train_s"]]),
            "bare_tokens_per_s": summarize([r["tokens"] / r["bare_s"] for r in rows]),
            "trainer_over_bare": summarize([r["bare_s"] / r["trainer_s"] for r in rows]),
            "compute_only_over_bare": summarize([r["bare_s"] / r["train_s"] for r in rows if r["train_s"]]),
            "publish_share": summarize([(r["publish_s"] or 0.0) / r["trainer_s"] for r in rows])}


def record(db, run_ids: list[str], model_dir: Path) -> Path:  # type: ignore[no-untyped-def]
    return write_result(NAME, {"runs": run_ids, "model": str(model_dir), **compare(db, run_ids, model_dir)})


def main() -> None:
    import asyncio

    from benchmarks.async_vs_sync import run_config, run_once
    from benchmarks.common import private_stack, tiny_model
    from infra.endpoints import resolve_endpoints
    from storage.db import Database
    from workers.common import connect

    model = tiny_model()
    with private_stack(inference_model=model, workers=True) as stack:
        endpoints = resolve_endpoints(stack.settings)
        db = Database(endpoints.database_url)
        cfg = run_config(model, "sync", {"kind": "none"}, steps=4)

        async def go() -> None:
            await run_once(await connect(endpoints), db, cfg)

        asyncio.run(go())
        print(record(db, [cfg.name], model))
        db.dispose()


if __name__ == "__main__":
    main()
