"""Trainer efficiency: the trainer worker's whole step against a bare PyTorch loop (issue #8, item 4).

The profile (this module alone, `main`): a private Postgres + SeaweedFS (no vLLM, no Temporal), a
buffer of synthetic completed groups at the benchmark's tiny shape (2 groups x 4 samples, ~1k
tokens), and the trainer's own `Trainer.train_step` in this process -- claim, read and plan the
batch, engine step, metrics, checkpoint publish (safetensors, hash, optimizer state, probe logprobs;
on a CPU trainer the S3 upload), commit. Every step publishes (sync.interval 1, the default) and
the steps run back to back, so each one carries the previous version's upload as the pipeline's
trainer does (its wait, and the cores the upload takes); then a bare loop (forward, policy-gradient
loss, backward, clip, AdamW) runs on each step's very batch. The same steps run a second time with
each upload in a thread beside the next step (the trainer's default on a GPU), for the comparison. The phases are the
seconds the trainer records in `train_steps.metrics`; "commit and rest" is the step's wall time less
them.

`make bench` also calls `record` at the end of benchmarks/async_vs_sync.py: the Temporal worker's
recorded steps of its sync runs (worker process, beside vLLM and four other workers), replayed
through the engine and the bare loop; they go under "worker" beside the profile.

    .venv/bin/python -m benchmarks.trainer_efficiency
    .venv/bin/python -m benchmarks.trainer_efficiency --model smollm2 --steps 8 --repeats 1
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, summarize, timed, write_result

NAME = "trainer_efficiency"


def step_samples(db, run_id: str, step: int):  # type: ignore[no-untyped-def]
    """The samples (with GRPO advantages) that step `step` of the run trained on."""
    from rlpipe.rl.batching import assign_advantages
    from rlpipe.schemas.algorithm import AdvantageConfig
    from rlpipe.storage import buffer
    from rlpipe.trainer.samples import to_samples

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

    from rlpipe.observe.queries import step_metrics
    from rlpipe.rl.batch import collate
    from rlpipe.rl.batching import global_stats, plan_step
    from rlpipe.schemas.config import RunConfig
    from rlpipe.trainer.engine import EngineSpec, LocalEngine, load_policy

    cfg = RunConfig()   # the benchmark runs keep the default advantage, loss, batch and optimiser
    pad = AutoTokenizer.from_pretrained(model_dir).pad_token_id or 0
    engine = LocalEngine(EngineSpec(model_dir, model_dir, None, cfg.loss, cfg.optim, world_size=1))
    model = load_policy(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas)

    def engine_step(samples) -> None:  # type: ignore[no-untyped-def]
        engine.step([plan_step(samples, advantage=cfg.advantage, loss=cfg.loss, batch=cfg.batch, pad_token_id=pad)], 0)

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
    """The worker's recorded steps of `run_ids` (made by `command`) into trainer_efficiency.json
    under "worker", keeping the profile that is there."""
    return write_result(NAME, {**_previous(), "worker": {"runs": run_ids, "command": command,
                                                         **compare(db, run_ids, model_dir)}})


def _previous() -> dict[str, Any]:
    """The fields of the current trainer_efficiency.json that a benchmark writes (not the stamps)."""
    path = RESULTS / f"{NAME}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    return {k: v for k, v in old.items() if k not in ("benchmark", "command", "finished_at", "machine")}


def fill_buffer(db, run_id: str, groups: int, group_size: int, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
    """`groups` completed groups of random tokens generated by version 0: a 50-token prompt and
    50-89 completion tokens per sample (the tiny calculator runs' ~1k tokens per 8-sample step)."""
    from rlpipe.schemas.trajectory import AssembledTrajectory
    from rlpipe.storage import buffer

    rng = random.Random(seed)
    for g in range(groups):
        prompt = [rng.randrange(3, 384) for _ in range(50)]
        with db.begin() as s:   # one transaction per group: claims take them in this order
            ids = buffer.start_group(s, run_id=run_id, group_index=g, prompt_index=g, task_id=f"task-{g}",
                                     workflow_id=f"{run_id}-group-{g}", n_samples=group_size, prompt_ids=prompt)
            samples = []
            for trajectory_id in ids:
                n = rng.randrange(50, 90)
                trajectory = AssembledTrajectory(prompt_ids=prompt, completion_ids=[rng.randrange(3, 384) for _ in range(n)],
                                                 loss_mask=[1] * n, sampler_logprobs=[-6.0] * n, version_spans=[[0, 0, n]])
                samples.append(buffer.FinishedSample(trajectory_id, rng.choice([0.0, 1.0]), None, trajectory, "stop", 1))
            buffer.finish_group(s, run_id=run_id, group_index=g, samples=samples, discarded_ids=[],
                                status="completed", reason=None)


PHASES = ("claim_s", "read_s", "plan_s", "engine_s", "upload_wait_s", "save_s", "hash_s", "train_state_s", "probe_s",
          "upload_s")
"""What `Trainer.train_step` records, in step order; from upload_wait_s on they make up its publish_s (a
step that does not publish records only the wait, for the upload of the version before it)."""


def profile(db, store, model_dir: Path, steps: int = 24, repeats: int = 3,  # type: ignore[no-untyped-def]
            group_size: int = 4, groups_per_step: int = 2, background_uploads: bool | None = None) -> dict[str, Any]:
    """`steps` publishing steps of `Trainer.train_step` in this process back to back, then `repeats`
    bare-loop steps on each one's batch; the first two steps warm up and are not counted.
    `background_uploads`: the Trainer's (None: its default, beside the next step only on a GPU)."""
    import tempfile
    import uuid

    from rlpipe.observe.queries import step_metrics
    from rlpipe.rl.batch import collate
    from rlpipe.rl.batching import global_stats
    from rlpipe.rollout.context import RunContexts
    from rlpipe.schemas.config import RunConfig
    from rlpipe.schemas.payloads import TrainStepInput
    from rlpipe.storage.runs import register_run
    from rlpipe.trainer.engine import load_policy
    from rlpipe.trainer.trainer import Trainer

    cfg = RunConfig.model_validate({"name": f"b-trainer-{uuid.uuid4().hex[:8]}", "steps": steps,
                                    "model": {"path": str(model_dir)},
                                    "rollout": {"group_size": group_size, "groups_per_step": groups_per_step}})
    with db.begin() as s:
        register_run(s, cfg)
    fill_buffer(db, cfg.name, steps * groups_per_step, group_size)
    model = load_policy(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas)
    work = tempfile.TemporaryDirectory(prefix="rlpipe-bench-trainer-")   # the trainer's checkpoint cache
    trainer = Trainer(db, store, RunContexts(db), Path(work.name), background_uploads=background_uploads)
    pad = trainer.contexts.get(cfg.name).tokenizer.pad_token_id or 0
    walls, bares = {}, {}
    try:
        trainer.init_policy(cfg.name)
        for step in range(1, steps + 1):
            inp = TrainStepInput(run_id=cfg.name, step=step, policy_version=step - 1, min_trained_steps=0,
                                 groups_per_step=groups_per_step, publish=True)
            walls[step] = timed(lambda: trainer.train_step(inp))  # noqa: B023 - called at once
    finally:
        trainer.shutdown()
        work.cleanup()
    for step in range(1, steps + 1):
        samples = step_samples(db, cfg.name, step)
        batch = collate(samples, global_stats(samples, world_size=1), pad_token_id=pad)
        bares[step] = summarize([timed(lambda: bare_step(model, opt, batch))  # noqa: B023 - called at once
                                 for _ in range(repeats)]).median
    with db.begin() as s:
        recorded = step_metrics(s, cfg.name)
    rows = [{"step": st.step, "tokens": st.n_tokens,
             "wall_s": walls[st.step], "bare_s": bares[st.step],
             **{k: st.metrics.get(k, 0.0) for k in PHASES + ("publish_s",)}} for st in recorded if st.step > 2]
    return {"run": cfg.name, "model": str(model_dir), "steps": rows, "repeats": repeats,
            "shape": {"group_size": group_size, "groups_per_step": groups_per_step},
            **summaries(rows)}


def summaries(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Tokens/s and ratios over the bare loop of the (publishing) steps, and the median seconds of
    every phase."""
    phases = {k: summarize([r[k] for r in rows]).median for k in PHASES}
    phases["commit_and_rest_s"] = summarize([r["wall_s"] - sum(r[k] for k in PHASES) for r in rows]).median
    phases["wall_s"] = summarize([r["wall_s"] for r in rows]).median
    return {"trainer_tokens_per_s": summarize([r["tokens"] / r["wall_s"] for r in rows]),
            "engine_tokens_per_s": summarize([r["tokens"] / r["engine_s"] for r in rows]),
            "bare_tokens_per_s": summarize([r["tokens"] / r["bare_s"] for r in rows]),
            "engine_over_bare": summarize([r["bare_s"] / r["engine_s"] for r in rows]),
            "trainer_over_bare": summarize([r["bare_s"] / r["wall_s"] for r in rows]),
            "publish_share": summarize([r["publish_s"] / r["wall_s"] for r in rows]),
            "phases": phases}



def main() -> None:
    import argparse

    from benchmarks.common import private_stack, smollm2_model, tiny_model
    from rlpipe.infra.endpoints import resolve_endpoints
    from rlpipe.storage.db import Database
    from rlpipe.storage.object_store import ObjectStore

    parser = argparse.ArgumentParser(description="The trainer's step against a bare PyTorch loop on the same batch.")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                        help="tiny: results/trainer_efficiency.json; smollm2: results/trainer_efficiency_smollm2.json")
    parser.add_argument("--steps", type=int, default=24, help="train steps, every second one publishing")
    parser.add_argument("--repeats", type=int, default=3, help="bare-loop steps after each train step")
    args = parser.parse_args()
    model = tiny_model() if args.model == "tiny" else smollm2_model()
    with private_stack(only=["postgres", "seaweedfs"]) as stack:
        endpoints = resolve_endpoints(stack.settings)
        db, store = Database(endpoints.database_url), ObjectStore.from_endpoints(endpoints)
        store.ensure_bucket()
        try:
            result = profile(db, store, model, steps=args.steps, repeats=args.repeats)   # the trainer's default
            # the same steps with each upload in a thread beside the next step (a GPU trainer's default)
            beside = profile(db, store, model, steps=args.steps, repeats=args.repeats, background_uploads=True)
            result["background_uploads"] = {k: beside[k] for k in ("run", "trainer_over_bare", "publish_share",
                                                                   "trainer_tokens_per_s", "phases")}
        finally:
            db.dispose()
    if args.model == "tiny":
        worker = {k: v for k, v in _previous().items() if k == "worker"}   # async_vs_sync's, if any
        print(write_result(NAME, {**result, **worker}))
    else:
        command = (f".venv/bin/python -m benchmarks.{NAME} --model smollm2 --steps {args.steps} "
                   f"--repeats {args.repeats}")
        print(write_result(f"{NAME}_smollm2", result, command=command))


if __name__ == "__main__":
    main()
