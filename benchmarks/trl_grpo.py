"""Peer comparison: seconds per training step of TRL's GRPOTrainer next to rlpipe's (issue #8, item 6).

Both train the tiny model (`rlpipe model prepare tiny`) on CPU, on the same prompts (tiny-calculator's
train set, in rlpipe's order: group i asks train prompt i), with the same step shape: 2 prompts × 4
samples = 8 trained samples per optimizer step, temperature 1, up to 24 new tokens per generation, lr
1e-4, AdamW betas (0.9, 0.99), grad clip 1, PPO clip 0.2, no KL term. Each runs in its natural
configuration:

- TRL: GRPOTrainer as its docs set it up without vLLM: transformers generates, one process, one turn
  per sample (TRL cannot run rlpipe's <calc> tool turn, so a sample that calls the calculator scores 0).
  The reward is rlpipe's `answer_match` rule on rlpipe's own answer parser (the first <answer>…</answer>
  must hold exactly the reference integer). It runs in its own virtual environment, .venv-trl
  (`make bench-trl-venv`), because TRL brings its own dependency ranges; this module, run there with
  `--trl-side`, imports only the standard library, envs/toolcalls.py (stdlib only), torch, transformers,
  datasets and trl.
- rlpipe: the tiny-calculator config as shipped (no injected tool latency), async (max_staleness 1)
  and sync, on a private stack of real servers (Temporal, Postgres, SeaweedFS, vLLM, workers).

Seconds per step: TRL, the time between the Trainer's step-begin and step-end callbacks (generation,
reward, loss, backward, optimizer) of each step after the warm-up; rlpipe, per run, the mean time
between consecutive train-step commits (the first step, which also waits for start-up, is left out). The
headline benchmark's rlpipe walls (1-s median injected tool latency) are shown beside them by the report.

    .venv/bin/python -m benchmarks.trl_grpo [--trl-steps 8 --rlpipe-steps 6 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from rlpipe.envs.toolcalls import INTEGER_ANSWER, extract_answer

NAME = "trl_grpo"
TRL_PYTHON = Path(__file__).resolve().parents[1] / ".venv-trl" / "bin" / "python"
CONFIG = "tiny-calculator.toml"


def answer_match(completion: str, reference: str) -> float:
    """rlpipe's answer_match grader (graders/rules.py) on the same answer rule (envs/toolcalls.py,
    stdlib only, so the TRL venv imports it too): 1.0 if the first <answer>…</answer> holds
    exactly the reference integer."""
    answer = extract_answer(completion).answer
    return float(answer is not None and INTEGER_ANSWER.fullmatch(answer) is not None
                 and int(answer) == int(reference))


def trl_side(spec: dict[str, Any]) -> dict[str, Any]:
    """GRPOTrainer for warmup + steps optimizer steps on CPU; per-step seconds and TRL's own logs."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepClock(TrainerCallback):
        """Step-begin to step-end of every optimizer step, and what TRL logs after it."""

        def __init__(self) -> None:
            self.t0, self.step_s, self.logs = 0.0, [], []

        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.step_s.append(time.perf_counter() - self.t0)
            print(f"TRL step {state.global_step}/{state.max_steps}: {self.step_s[-1]:.2f} s", flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            self.logs.append(dict(logs or {}))

    generate_s: list[float] = []

    class TimedGRPOTrainer(GRPOTrainer):
        """Times generation + scoring (one call per optimizer step here); the rest of a step is
        the loss, backward and optimizer."""

        def _generate_and_score_completions(self, inputs):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            generate_s.append(time.perf_counter() - t0)
            return out

    def reward(completions: list[list[dict[str, str]]], reference: list[str], **kwargs: Any) -> list[float]:
        return [answer_match(c[-1]["content"], r) for c, r in zip(completions, reference)]

    torch.manual_seed(0)
    total = spec["warmup"] + spec["steps"]
    prompts = spec["prompts"][: total * spec["groups_per_step"]]
    data = Dataset.from_list([{"prompt": [{"role": "system", "content": p["system"]},
                                          {"role": "user", "content": p["question"]}],
                               "reference": p["reference"]} for p in prompts])
    clock = StepClock()
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as out_dir:
        args = GRPOConfig(
            output_dir=out_dir, use_cpu=True, use_vllm=False, max_steps=total, seed=0,
            per_device_train_batch_size=spec["group_size"] * spec["groups_per_step"], gradient_accumulation_steps=1,
            num_generations=spec["group_size"], max_completion_length=spec["max_tokens"], temperature=1.0,
            learning_rate=spec["lr"], lr_scheduler_type="constant", adam_beta2=0.99, weight_decay=0.0,
            max_grad_norm=1.0, beta=0.0, epsilon=0.2, shuffle_dataset=False, logging_steps=1, report_to="none",
            save_strategy="no")
        trainer = TimedGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(spec["model"]), reward_funcs=reward,
                                   args=args, train_dataset=data,
                                   processing_class=AutoTokenizer.from_pretrained(spec["model"]), callbacks=[clock])
        trainer.train()
    logs = [log for log in clock.logs if "reward" in log]
    return {"step_s": clock.step_s, "generate_s": generate_s,
            "reward": [log["reward"] for log in logs],
            "completion_tokens_mean": [log["completions/mean_length"] for log in logs],
            "versions": {"trl": _version("trl"), "transformers": _version("transformers"),
                         "torch": torch.__version__, "torch_threads": torch.get_num_threads()}}


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def run_trl(model: Path, cfg, warmup: int, steps: int) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """TRL's side in .venv-trl, on the run config's prompts (written by rlpipe's own environment)."""
    from rlpipe.envs.registry import build_environment

    if not TRL_PYTHON.exists():
        raise SystemExit(f"{TRL_PYTHON} is missing: run `make bench-trl-venv` first")
    env = build_environment(cfg.env)
    n = (warmup + steps) * cfg.rollout.groups_per_step
    spec = {"model": str(model), "warmup": warmup, "steps": steps, "group_size": cfg.rollout.group_size,
            "groups_per_step": cfg.rollout.groups_per_step, "max_tokens": cfg.sampling.max_tokens,
            "lr": cfg.optim.lr, "prompts": [{"system": env.system_prompt, "question": t.question,
                                             "reference": t.reference}
                                            for t in (env.task("train", i) for i in range(n))]}
    with tempfile.TemporaryDirectory(prefix="trl-spec-") as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        subprocess.run([str(TRL_PYTHON), "-m", f"benchmarks.{NAME}", "--trl-side", str(path)],
                       cwd=TRL_PYTHON.parents[2], check=True)
        return json.loads((Path(tmp) / "result.json").read_text())


def run_rlpipe(model: Path, steps: int, repeats: int) -> dict[str, list[dict[str, Any]]]:
    """rlpipe's tiny-calculator as shipped (no injected tool latency), sync then async, repeated."""
    import asyncio

    from benchmarks.common import private_stack, progress_bar
    from rlpipe.cli.run_commands import start_run
    from rlpipe.infra.endpoints import resolve_endpoints
    from rlpipe.observe.queries import step_metrics
    from rlpipe.storage.db import Database
    from rlpipe.workers.common import connect
    from tests.integration.runs import tiny_config

    async def runs(stack) -> dict[str, list[dict[str, Any]]]:  # type: ignore[no-untyped-def]
        endpoints = resolve_endpoints(stack.settings)
        client, db = await connect(endpoints), Database(endpoints.database_url)
        out: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
        with progress_bar() as bar:
            task = bar.add_task("rlpipe runs", total=repeats * len(out))
            for _ in range(repeats):
                for mode in out:
                    bar.update(task, description=f"rlpipe {mode}")
                    cfg = tiny_config(model, CONFIG, name=f"b-trl-{mode}-{time.time_ns()}", steps=steps, mode=mode,
                                      max_staleness=1 if mode == "async" else None, eval={"prompts": 0})
                    t0 = time.perf_counter()
                    await asyncio.wait_for((await start_run(client, cfg)).result(), 1200)
                    wall = time.perf_counter() - t0
                    with db.begin() as s:
                        rows = step_metrics(s, cfg.name)
                    ends = [r.finished_at for r in rows]
                    out[mode].append({"run_id": cfg.name, "wall_s": wall, "steps": len(rows),
                                      "step_s": [(b - a).total_seconds() for a, b in zip(ends, ends[1:])],
                                      "train_s": [r.duration_s for r in rows],
                                      "samples_per_step": [r.n_trajectories for r in rows],
                                      "reward": [float(r.reward_mean or 0.0) for r in rows],
                                      "completion_tokens_mean": [r.response_length_mean for r in rows]})
                    bar.advance(task)
        db.dispose()
        return out

    with private_stack(inference_model=model, workers=True) as stack:
        return asyncio.run(runs(stack))


def analyse(trl: dict[str, Any], rlpipe: dict[str, list[dict[str, Any]]], warmup: int,
            samples_per_step: int) -> dict[str, Any]:
    from benchmarks.common import summarize

    measured = trl["step_s"][warmup:]
    generate = trl["generate_s"][warmup:]
    out = {"trl": {"step_s": summarize(measured), "generate_score_s": summarize(generate),
                   "loss_backward_optimizer_s": summarize([s - g for s, g in zip(measured, generate)]),
                   "samples_per_step": samples_per_step, "completion_tokens_mean": statistics.mean(trl["completion_tokens_mean"]),
                   "reward_mean": statistics.mean(trl["reward"])}}
    for mode, rs in rlpipe.items():
        out[f"rlpipe_{mode}"] = {
            # per run, the mean interval: async trains in bursts (two steps back to back, then a wait)
            "step_s": summarize([statistics.mean(r["step_s"]) for r in rs]),
            "completion_tokens_mean": statistics.mean(t for r in rs for t in r["completion_tokens_mean"] if t is not None),
            "reward_mean": statistics.mean(x for r in rs for x in r["reward"])}
    # the trainer's recorded step (claim .. commit incl. publish): its cost alone in sync mode only,
    # where nothing else runs beside it (in async mode it shares the 2 cores with generation)
    out["rlpipe_sync"]["train_s"] = summarize([s for r in rlpipe["sync"] for s in r["train_s"]])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2, help="TRL steps left out of the timing")
    parser.add_argument("--trl-steps", type=int, default=8)
    parser.add_argument("--rlpipe-steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="rlpipe runs per mode")
    parser.add_argument("--trl-side", type=Path, metavar="SPEC_JSON",
                        help="internal: run TRL's side only (in .venv-trl); writes result.json beside SPEC_JSON")
    args = parser.parse_args()
    if args.trl_side:
        result = trl_side(json.loads(args.trl_side.read_text()))
        (args.trl_side.parent / "result.json").write_text(json.dumps(result))
        return

    from benchmarks.common import tiny_model, write_result
    from tests.integration.runs import tiny_config

    model = tiny_model()
    cfg = tiny_config(model, CONFIG)
    trl = run_trl(model, cfg, args.warmup, args.trl_steps)   # first, while no stack competes for the cores
    rlpipe = run_rlpipe(model, args.rlpipe_steps, args.repeats)
    results = analyse(trl, rlpipe, args.warmup, cfg.rollout.group_size * cfg.rollout.groups_per_step)
    print(write_result(NAME, {
        "params": {"config": CONFIG, "group_size": cfg.rollout.group_size,
                   "groups_per_step": cfg.rollout.groups_per_step, "max_tokens": cfg.sampling.max_tokens,
                   "max_turns": cfg.env.max_turns, "lr": cfg.optim.lr, "trl_warmup": args.warmup,
                   "trl_steps": args.trl_steps, "rlpipe_steps": args.rlpipe_steps, "repeats": args.repeats,
                   "trl_versions": trl["versions"], "trl_python": str(TRL_PYTHON.relative_to(TRL_PYTHON.parents[2]))},
        "results": results, "raw": {"trl": trl, "rlpipe": rlpipe}}))


if __name__ == "__main__":
    main()
