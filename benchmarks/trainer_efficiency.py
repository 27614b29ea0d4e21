"""Trainer efficiency: the trainer worker's whole step against a bare PyTorch loop (issue #8, item 4).

Three timings of the very same batch (the trajectories a step claimed, read back from Postgres):
1) the trainer worker's step as `train_steps` records it, start to commit: claim, advantages and
   global denominators, forward/backward/AdamW, metrics, checkpoint publish (safetensors + S3 upload +
   probe logprobs), commit -- in the worker process, during sync-mode runs (nothing else runs beside it);
2) the trainer's engine path in this process: rl.batching.plan_step + LocalEngine.step (the PPO-clip
   loss with its metrics, global denominators, grad clip, AdamW);
3) a bare PyTorch loop in this process: forward, a policy-gradient loss, backward, clip, AdamW.
2) and 3) alternate repeat by repeat, so the shared machine's noise hits both.

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


def step_samples(db, run_id: str, step: int):  # type: ignore[no-untyped-def]
    """The samples (with GRPO advantages) that step `step` of the run trained on."""
    from rl.batching import assign_advantages
    from schemas.algorithm import AdvantageConfig
    from storage import buffer
    from trainer.samples import to_samples

    with db.begin() as s:
        return assign_advantages(to_samples(buffer.claimed_trajectories(s, run_id, step)), AdvantageConfig())


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
    """Per trained step of the runs, three timings of the same batch: the trainer worker's recorded
    step (claim .. commit, from train_steps), and, alternating in this process, the trainer's engine
    path (rl.batching.plan_step + LocalEngine.step: the worker's `train_s` without its database reads)
    and the bare loop."""
    from transformers import AutoTokenizer

    from observe.queries import step_metrics
    from rl.batch import collate
    from rl.batching import global_stats, plan_step
    from schemas.config import RunConfig
    from trainer.engine import EngineSpec, LocalEngine, load_policy

    cfg = RunConfig()   # the benchmark runs keep the default advantage, loss, batch and optimiser
    pad = AutoTokenizer.from_pretrained(model_dir).pad_token_id or 0
    engine = LocalEngine(EngineSpec(model_dir, model_dir, None, cfg.loss, cfg.optim, world_size=1))
    model = load_policy(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas)

    def engine_step(samples) -> None:  # type: ignore[no-untyped-def]
        engine.step(plan_step(samples, advantage=cfg.advantage, loss=cfg.loss, batch=cfg.batch, pad_token_id=pad), 0)

    def plain_step(samples) -> None:  # type: ignore[no-untyped-def]
        bare_step(model, opt, collate(samples, global_stats(samples, world_size=1), pad_token_id=pad))

    rows = []
    for run_id in run_ids:
        with db.begin() as s:
            steps = step_metrics(s, run_id)
        for st in steps:
            samples = step_samples(db, run_id, st.step)
            engine_step(samples), plain_step(samples)            # warm-up (allocator, optimizer state)
            times: dict[str, list[float]] = {"engine": [], "bare": []}
            for _ in range(repeats):                             # alternate: the machine's noise hits both
                for kind, fn in (("engine", engine_step), ("bare", plain_step)):
                    t0 = time.perf_counter()
                    fn(samples)
                    times[kind].append(time.perf_counter() - t0)
            rows.append({"run": run_id, "step": st.step, "tokens": sum(x.num_tokens for x in samples),
                         "trainer_s": st.duration_s, "train_s": st.metrics.get("train_s"),
                         "claim_s": st.metrics.get("claim_s"), "publish_s": st.metrics.get("publish_s"),
                         "engine_s": summarize(times["engine"]).median, "bare_s": summarize(times["bare"]).median})
    return {"steps": rows, "repeats": repeats,
            "trainer_tokens_per_s": summarize([r["tokens"] / r["trainer_s"] for r in rows]),
            "engine_tokens_per_s": summarize([r["tokens"] / r["engine_s"] for r in rows]),
            "bare_tokens_per_s": summarize([r["tokens"] / r["bare_s"] for r in rows]),
            "engine_over_bare": summarize([r["bare_s"] / r["engine_s"] for r in rows]),
            "trainer_over_bare": summarize([r["bare_s"] / r["trainer_s"] for r in rows]),
            "publish_share": summarize([(r["publish_s"] or 0.0) / r["trainer_s"] for r in rows])}


def record(db, run_ids: list[str], model_dir: Path, command: str | None = None) -> Path:  # type: ignore[no-untyped-def]
    """trainer_efficiency.json; `command` names the benchmark that made the runs, when not this one."""
    extra = {"command": command} if command else {}
    return write_result(NAME, {"runs": run_ids, "model": str(model_dir), **compare(db, run_ids, model_dir), **extra})


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
