"""How far a vLLM server's probe is from the trainer's, by dtype on each side, and how far a wrong
tensor moves it: the numbers a weight sync's verification tolerance (`sync.verify_tolerance`) is
derived from. docs/vllm-cpu-notes.md has the fp32-on-both-sides numbers behind today's 2e-4.

The probe is what a sync verifies (trainer/probe.py, weights/sync.py): the teacher-forced logprobs
of a fixed chat and its 16-token greedy continuation. Per served state this asks the server what
the sync asks: `probe_logprob_diff` (max |server - trainer| over the probe tokens, prompt logprobs)
and `probe_greedy_matches` (here strict, every token, where the sync stops at the first near-tie),
against each trainer side's probe of the same weights.

Trainer sides, transformers on the fp32 weights (`make_probe`):
  fp32            fp32 compute                                                        (T1)
  autocast-bf16   torch.autocast("cpu", bfloat16) over the fp32 weights: a one-process bf16 trainer (T2)
  bf16-params     every parameter cast to bf16: FSDP2 MixedPrecisionPolicy(param_dtype=bf16) (T3)
  fp32-of-bf16    fp32 compute over the weights rounded to bf16                       (T4)
The trainer records T1 when it publishes fp32 weights and T4 when it publishes bf16 ones: the fp32
forward of the published bytes, whatever it trained in (trainer/trainer.py). `reference` in the
summary is that side's difference, the one the sync's bound (weights/tolerance.py) is held to.

Server sides: one real vLLM server at a time (`infra.vllm.vllm_command`, `--dtype` float32 then
bfloat16), started on the fp32 model, then loaded through the sync path (`load_into_server`: pause,
reload, reset the prefix cache, resume) with checkpoints published in fp32 or in bf16
(`save_checkpoint(dtype=...)`): float32 server + fp32 weights (S1), float32 server + bf16-published
weights (S2), bfloat16 server + bf16-published weights (S3), and + fp32-published weights (S3').

Served states, each reloaded, for every (server dtype, published dtype), in this order:
  base              the weights W0 (against W0's probe)
  base again        W0 reloaded once more: its change from `base` is the noise a reload adds
  wrong-layer       W0 with a middle layer's mlp.down_proj.weight replaced by the next layer's
  step              W1 = W0 + 1e-5 * sign(noise) on every weight (against W1's probe)
  stale-tensor      W1, but a middle layer's self_attn.o_proj.weight left at its W0 value (vs W1)
  previous-version  W0 held against W1's probe: how far one step moves the probe
  scaled-embedding  W0 with the embedding scaled by 0.99 (tied to lm_head in SmolLM2) (vs W0)
Trainer only: how far one random-sign step of lr 1e-7, 1e-6 and 1e-5 on every weight moves each
side's probe, and the fraction of weights whose bf16 value the step changes (SmolLM2's weights,
dequantized from Q4_1, put 8% of them exactly on a bf16 rounding midpoint: any step moves half of those).

    .venv/bin/python -m benchmarks.sync_precision [--models smollm2-135m tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from benchmarks.common import ROOT, progress_bar, smollm2_model, tiny_model, write_result

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from rlpipe.inference.client import InferenceClient

NAME = "sync_precision"
ServerDtype = Literal["float32", "bfloat16"]
SERVER_DTYPES: tuple[ServerDtype, ...] = ("float32", "bfloat16")
PUBLISHED: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Published dtype label -> the cast `save_checkpoint` applies."""
TRAINER_SIDES = ("fp32", "autocast-bf16", "bf16-params", "fp32-of-bf16")
RECORDED = {"fp32": "fp32", "bf16": "fp32-of-bf16"}
"""Published dtype -> the side the trainer records as the probe (the fp32 forward of the published bytes)."""
STEP_LR = 1e-5
"""The step between W0 and W1 (the stale-tensor case)."""
MOVE_LRS = (1e-7, 1e-6, 1e-5)
EMBED_SCALE = 0.99
SEED = 0
MAX_MODEL_LEN = 2048  # or the model's own, if shorter: the probe is ~40 tokens; the KV cache stays at 1 GiB
STARTUP_TIMEOUT_S = 420.0  # as the stack's InferenceService: SmolLM2 on 2 busy cores can take minutes
SERVED_MODEL_NAME = "policy"
EMBEDDING = "model.embed_tokens.weight"

StateDict = dict[str, torch.Tensor]
Probes = dict[str, dict[str, Any]]
"""Trainer side -> its probe record (trainer.probe.ProbeRecord)."""


@dataclass(frozen=True)
class Served:
    """One state a server is loaded with, and the version whose trainer probes it is held against."""

    label: str
    version: str
    reference: str
    wrong: bool = False


PLAN = (Served("base", "base", "base"), Served("base again", "base", "base"),
        Served("wrong-layer", "wrong-layer", "base", wrong=True), Served("step", "next", "next"),
        Served("stale-tensor", "stale-tensor", "next", wrong=True),
        Served("previous-version", "base", "next", wrong=True),
        Served("scaled-embedding", "scaled-embedding", "base", wrong=True))
CONFIGS = {("float32", "fp32"): "S1", ("float32", "bf16"): "S2", ("bfloat16", "bf16"): "S3",
           ("bfloat16", "fp32"): "S3'"}


# -- the trainer's side ----------------------------------------------------------------------------
class Trainer:
    """The probe of any state dict, computed the three ways a trainer may compute it."""

    def __init__(self, base: Path) -> None:
        from transformers import AutoModelForCausalLM

        from rlpipe.policy.chat import load_tokenizer
        from rlpipe.trainer.probe import probe_ids

        self.ids = probe_ids(load_tokenizer(base))
        self.fp32 = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        self.bf16 = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)

    def probes(self, state: StateDict) -> Probes:
        from rlpipe.trainer.probe import make_probe

        for model in (self.fp32, self.bf16):
            load_weights(model, state)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = make_probe(self.fp32, *self.ids)
        probes = {"fp32": make_probe(self.fp32, *self.ids), "autocast-bf16": autocast,
                  "bf16-params": make_probe(self.bf16, *self.ids)}
        load_weights(self.fp32, {k: t.bfloat16().float() if t.is_floating_point() else t for k, t in state.items()})
        return probes | {"fp32-of-bf16": make_probe(self.fp32, *self.ids)}


def load_weights(model: torch.nn.Module, state: StateDict) -> None:
    """Copy `state` into `model` (cast to its dtype, rounding to nearest as `.to` does). A tied
    lm_head is not in the checkpoint; it is the embedding's own parameter, so it follows."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"state dict does not fit the model: missing {missing}, unexpected {unexpected}")


def random_step(state: StateDict, lr: float, seed: int = SEED) -> StateDict:
    """An optimiser-like step: lr * sign(noise) added to every floating weight (Adam's early steps
    move each weight by about lr)."""
    generator = torch.Generator().manual_seed(seed)
    return {k: t + lr * torch.sign(torch.randn(t.shape, generator=generator)) if t.is_floating_point() else t
            for k, t in state.items()}


def versions(base: StateDict, layers: int) -> tuple[dict[str, StateDict], dict[str, str]]:
    """The states the servers hold, and which tensor each wrong one gets wrong. Replacements are
    clones: save_checkpoint keeps one name of tensors that share storage (tied weights)."""
    mid = layers // 2
    down, other_down = (f"model.layers.{i}.mlp.down_proj.weight" for i in (mid, (mid + 1) % layers))
    o_proj = f"model.layers.{mid}.self_attn.o_proj.weight"
    nxt = random_step(base, STEP_LR)
    states = {"base": base, "next": nxt, "wrong-layer": {**base, down: base[other_down].clone()},
              "stale-tensor": {**nxt, o_proj: base[o_proj].clone()},
              "scaled-embedding": {**base, EMBEDDING: base[EMBEDDING] * EMBED_SCALE}}
    return states, {"wrong-layer": f"{down} <- {other_down}", "stale-tensor": f"{o_proj} at W0, the rest W1",
                    "scaled-embedding": f"{EMBEDDING} * {EMBED_SCALE}"}


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def probe_movement(trainer: Trainer, base: StateDict, base_probes: Probes) -> dict[str, Any]:
    """Per lr and trainer side: how far one random-sign step moves the probe, whether the greedy
    continuation changes, and the fraction of weights whose bf16 value the step changes."""
    out: dict[str, Any] = {}
    for lr in MOVE_LRS:
        stepped = random_step(base, lr)
        probes = trainer.probes(stepped)
        changed = sum(int((stepped[k].bfloat16() != t.bfloat16()).sum()) for k, t in base.items())
        out[f"{lr:g}"] = {"max_abs_diff": {s: max_abs_diff(probes[s]["logprobs"], base_probes[s]["logprobs"])
                                           for s in TRAINER_SIDES},
                          "greedy_changed": {s: probes[s]["greedy_ids"] != base_probes[s]["greedy_ids"]
                                             for s in TRAINER_SIDES},
                          "bf16_weights_changed_fraction": changed / sum(t.numel() for t in base.values())}
    return out


# -- the server's side -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Server:
    url: str
    token: str
    start_s: float


@contextmanager
def vllm_server(model_dir: Path, dtype: ServerDtype, log_path: Path) -> Iterator[Server]:
    """One vLLM server on a free port in a session of its own (`infra.process.spawn`), always stopped
    with its whole session (its engine core process too)."""
    from rlpipe.infra.process import free_port, spawn, stop
    from rlpipe.infra.vllm import vllm_command, wait_healthy

    port, token = free_port(), secrets.token_urlsafe(32)
    url = f"http://127.0.0.1:{port}"
    context = min(MAX_MODEL_LEN, json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])
    argv, env = vllm_command(model_dir, "127.0.0.1", port, served_model_name=SERVED_MODEL_NAME,
                             max_model_len=context, dtype=dtype, admin_token=token)
    record = spawn(f"vllm-{dtype}", argv, log_path, env=env, cwd=ROOT)
    try:
        yield Server(url, token, wait_healthy(url, STARTUP_TIMEOUT_S, log_path=log_path))
    finally:
        stop(record, timeout_s=30)


async def check(client: InferenceClient, probes: Probes) -> dict[str, Any]:
    """What the sync checks, against every trainer side; the mean |server - trainer| beside the max (a
    statistic less ruled by one token); and the served logprobs themselves."""
    from rlpipe.weights.sync import probe_greedy_matches, probe_logprob_diff

    served = await client.score(probes["fp32"]["token_ids"])
    return {"max_abs_diff": {s: await probe_logprob_diff(client, probes[s]) for s in TRAINER_SIDES},
            "greedy_equal": {s: await probe_greedy_matches(client, probes[s]) for s in TRAINER_SIDES},
            "mean_abs_diff": {s: statistics.fmean(abs(a - b) for a, b in zip(served, probes[s]["logprobs"]))
                              for s in TRAINER_SIDES},
            "served_logprobs": served}


async def serve_all(server: Server, dtype: ServerDtype, start_dir: Path, dirs: dict[tuple[str, str], Path],
                    probes: dict[str, Probes], bar: Progress, task: TaskID) -> list[dict[str, Any]]:
    """The start-up state, then every PLAN state for each published dtype, each loaded through the
    sync path (no verification there: every side is checked here)."""
    from rlpipe.inference.admin import InferenceAdmin
    from rlpipe.inference.client import InferenceClient
    from rlpipe.weights.labels import published_label
    from rlpipe.weights.sync import SyncOutcome, SyncPlan, Weights, load_into_server

    async def no_record(outcome: SyncOutcome) -> None:
        return None

    rows: list[dict[str, Any]] = []
    previous = Weights("default", start_dir)
    async with InferenceAdmin(server.url, token=server.token) as admin, \
            InferenceClient(server.url, SERVED_MODEL_NAME) as client:
        rows.append({"server": dtype, "published": "fp32", "config": CONFIGS[(dtype, "fp32")], "label": "start",
                     "version": "base", "reference": "base", "wrong": False, **await check(client, probes["base"])})
        bar.advance(task)
        for published in PUBLISHED:
            for number, served in enumerate(PLAN, start=1):
                directory = dirs[(served.version, published)]
                plan = SyncPlan(version=number, directory=directory, probe=None, label=published_label(number),
                                previous=previous, mode="wait", tolerance=None)
                outcome = await load_into_server(admin, client, plan, no_record)
                if outcome.status != "ok":
                    raise RuntimeError(f"reloading {directory} into the {dtype} server: {outcome.error}")
                previous = Weights(published_label(number), directory)
                rows.append({"server": dtype, "published": published, "config": CONFIGS[(dtype, published)],
                             "label": served.label, "version": served.version, "reference": served.reference,
                             "wrong": served.wrong, "reload_s": outcome.timings["reload_s"],
                             **await check(client, probes[served.reference])})
                bar.advance(task)
    for before, row in zip(rows, rows[1:]):  # the same weights loaded twice in a row: the reload's noise
        if before["version"] == row["version"] and before["published"] == row["published"]:
            row["change_since_previous"] = max_abs_diff(row["served_logprobs"], before["served_logprobs"])
    return rows


# -- one model -------------------------------------------------------------------------------------
def measure_model(name: str, base_dir: Path, scratch: Path) -> dict[str, Any]:
    from rlpipe.policy.checkpoint import load_state_dict, save_checkpoint

    layers = int(json.loads((base_dir / "config.json").read_text())["num_hidden_layers"])
    base = {k: t.float() if t.is_floating_point() else t for k, t in load_state_dict(base_dir).items()}
    states, wrong_tensors = versions(base, layers)
    started = time.perf_counter()
    with progress_bar() as bar:
        task = bar.add_task(f"{name}: trainer probes", total=len(states) + len(MOVE_LRS))
        trainer = Trainer(base_dir)
        probes = {}
        for version, state in states.items():
            probes[version] = trainer.probes(state)
            bar.advance(task)
        movement = probe_movement(trainer, base, probes["base"])
        bar.advance(task, len(MOVE_LRS))
        del trainer
        task = bar.add_task(f"{name}: publish checkpoints", total=len(states) * len(PUBLISHED))
        dirs = {}
        for version, state in states.items():
            for published, cast in PUBLISHED.items():
                dirs[(version, published)] = save_checkpoint(state, scratch / name / f"{version}-{published}",
                                                             base_dir=base_dir, dtype=cast).path
                bar.advance(task)
    trainer_s = time.perf_counter() - started
    del states, base
    rows: list[dict[str, Any]] = []
    start_s: dict[str, float] = {}
    with progress_bar() as bar:
        for dtype in SERVER_DTYPES:
            task = bar.add_task(f"{name}: {dtype} server (starting)", total=1 + len(PUBLISHED) * len(PLAN))
            with vllm_server(base_dir, dtype, scratch / f"{name}-{dtype}.log") as server:
                start_s[dtype] = server.start_s
                bar.update(task, description=f"{name}: {dtype} server")
                rows += asyncio.run(serve_all(server, dtype, base_dir, dirs, probes, bar, task))
    return {"layers": layers, "wrong_tensors": wrong_tensors, "trainer_probes_s": trainer_s,
            "server_start_s": start_s, "summary": summarize_rows(rows), "movement": movement,
            "trainer_probes": probes, "rows": rows}


def summarize_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per server config: the right weights' worst diff and greedy agreement against each trainer
    side (over every load of them), the reload noise, the bf16/fp32-published agreement, and
    each wrong state's diff and greedy agreement."""
    out: dict[str, Any] = {}
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        right = [r for r in mine if not r["wrong"]]
        noise = [r["change_since_previous"] for r in mine if "change_since_previous" in r]
        recorded = RECORDED[mine[0]["published"]]
        out[config] = {
            "server": mine[0]["server"], "published": mine[0]["published"],
            "right": {s: {"max_abs_diff": max(r["max_abs_diff"][s] for r in right),
                          "greedy_equal": all(r["greedy_equal"][s] for r in right)} for s in TRAINER_SIDES},
            "reference": {"side": recorded, "right": max(r["max_abs_diff"][recorded] for r in right),
                          "wrong": {r["label"]: r["max_abs_diff"][recorded] for r in mine if r["wrong"]}},
            "reload_noise": max(noise) if noise else None,
            "reload_s": [r["reload_s"] for r in mine if "reload_s" in r],
            "wrong": {r["label"]: {"max_abs_diff": r["max_abs_diff"], "greedy_equal": r["greedy_equal"]}
                      for r in mine if r["wrong"]}}
    by_dtype: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if r["label"] == "base again":
            by_dtype[(r["server"], r["published"])] = r["served_logprobs"]
    if ("bfloat16", "fp32") in by_dtype and ("bfloat16", "bf16") in by_dtype:
        out["S3'"]["vs_S3_served"] = max_abs_diff(by_dtype[("bfloat16", "fp32")], by_dtype[("bfloat16", "bf16")])
    return out


def print_summary(name: str, result: dict[str, Any]) -> None:
    print(f"\n{name}: server start {', '.join(f'{d} {s:.0f} s' for d, s in result['server_start_s'].items())}")
    for config, row in result["summary"].items():
        right = "  ".join(f"{s} {v['max_abs_diff']:.1e}{'' if v['greedy_equal'] else ' (greedy differs)'}"
                          for s, v in row["right"].items())
        print(f"  {config} ({row['server']} server, {row['published']} weights): {right}; "
              f"reload noise {row['reload_noise']:.1e}")
        reference = row["reference"]
        print(f"    against the recorded probe ({reference['side']}): right {reference['right']:.1e}; wrong "
              + ", ".join(f"{label} {diff:.1e}" for label, diff in reference["wrong"].items()))
        for label, wrong in row["wrong"].items():
            print(f"      {label:17s} " + "  ".join(
                f"{s} {wrong['max_abs_diff'][s]:.1e}{'' if wrong['greedy_equal'][s] else ' (greedy differs)'}"
                for s in TRAINER_SIDES))
    for lr, move in result["movement"].items():
        print(f"  step lr {lr}: " + "  ".join(f"{s} {move['max_abs_diff'][s]:.1e}" for s in TRAINER_SIDES)
              + f"; bf16 weights changed {move['bf16_weights_changed_fraction']:.1%}")


def main() -> None:
    models = {"smollm2-135m": smollm2_model, "tiny": tiny_model}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(models), default=list(models))
    args = parser.parse_args()
    torch.manual_seed(SEED)
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="rlpipe-bench-precision-"))
    try:
        results = {name: measure_model(name, models[name](), scratch) for name in args.models}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    total_s = time.perf_counter() - started
    for name, result in results.items():
        print_summary(name, result)
    command = ".venv/bin/python -m benchmarks.sync_precision" + \
        ("" if args.models == list(models) else f" --models {' '.join(args.models)}")
    print(write_result(NAME, {"params": {"trainer_sides": TRAINER_SIDES, "configs": {v: k for k, v in CONFIGS.items()},
                                         "plan": PLAN, "step_lr": STEP_LR, "move_lrs": MOVE_LRS,
                                         "embed_scale": EMBED_SCALE, "seed": SEED, "max_model_len": MAX_MODEL_LEN},
                              "models": results, "total_s": total_s}, command))
    print(f"total {total_s:.0f} s")


if __name__ == "__main__":
    main()
