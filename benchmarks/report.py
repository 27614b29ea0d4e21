"""Render BENCHMARKS.md from benchmarks/results/*.json (the last `make bench`), plus the hand-written
reading of the numbers in benchmarks/findings.md, and write benchmarks/results/targets.json (the targets
table it opens with). Missing results are named, never invented.

    .venv/bin/python -m benchmarks.report
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.async_vs_sync import HEADLINE
from benchmarks.common import RESULTS, ROOT, Summary, summarize
from benchmarks.orchestration import TEMPORAL_DRIVERS
from benchmarks.targets import Target, targets_table, write_targets

OUT = ROOT / "BENCHMARKS.md"
FINDINGS = ROOT / "benchmarks" / "findings.md"


def fmt(s: dict[str, Any] | None, digits: int = 2, unit: str = "") -> str:
    """A stored Summary as 'median (min–max)'."""
    return Summary(**s).fmt(digits, unit) if s else "–"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def header(d: dict[str, Any]) -> str:
    return f"Command: `{d['command']}` (finished {d['finished_at']}).\n"


def async_section(d: dict[str, Any]) -> str:
    p, r = d["params"], d["results"]
    rows = [[label, fmt(v["sync_wall_s"], 1, " s"), fmt(v["async_wall_s"], 1, " s"), fmt(v["speedup"], 2, "×"),
             fmt(v["sync_reward"], 3), fmt(v["async_reward"], 3),
             ", ".join(f"{k}: {n}" for k, n in v["async_staleness"].items())]
            for label, v in r["settings"].items()]
    out = [header(d), f"{p['steps']} steps × {p['groups_per_step']} groups × {p['group_size']} samples "
           f"= {p['steps'] * p['groups_per_step'] * p['group_size']} trained samples per run, tiny model, "
           f"tiny-calculator (multi-turn tool use), tool latency median {p['median_tool_s']} s, async max_staleness "
           f"{p['max_staleness_async']}; {p['repeats']} paired repeats (sync then async, back to back). "
           "Speedup = sync wall / async wall of each pair.\n",
           table(["tool latency", "sync wall", "async wall", "speedup", "sync reward/step", "async reward/step",
                  "async staleness (steps: samples)"], rows)]
    b = r["bottleneck"]
    out += [f"\n**Staleness budget, sync interval and pipeline efficiency** (headline setting {HEADLINE}). Trainer "
            f"capacity alone {fmt(b['trainer_capacity_samples_per_s'], 1)} samples/s (trained samples / train-step "
            f"seconds of the sync runs); rollout capacity alone {fmt(b['rollout_capacity_samples_per_s'], 2)} "
            "samples/s (completed samples / rollout window of the async runs with max_staleness = steps, whose "
            f"rollouts are never held back). Bound = the slower = {b['bound_samples_per_s']:.2f} samples/s. "
            "Speedup here is against the median sync wall.\n",
            table(["variant", "max_staleness", "sync interval", "wall", "speedup vs sync", "samples/s",
                   "efficiency vs bound", "sync share of wall", "staleness (steps: samples)"],
                  [[v, str(h["max_staleness"]), str(h["sync_interval"]), fmt(h["wall_s"], 1, " s"),
                    fmt(h["speedup_vs_sync_median"], 2, "×"), fmt(h["achieved_samples_per_s"], 2),
                    fmt(h["efficiency"], 2), fmt(h["sync_share"], 2),
                    ", ".join(f"{k}: {n}" for k, n in h["staleness"].items())]
                   for v, h in r["headline_variants"].items()])]
    busy = r["settings"][HEADLINE]["busy"]
    boxes = sorted({b for m in busy.values() for b in m})
    out += [f"\n**Busy fraction per box** ({HEADLINE}; overlapping activity spans merged, over the run's wall "
            "time; idle = 1 − busy):\n",
            table(["mode", *boxes], [[m, *(fmt(busy[m].get(b), 2) for b in boxes)] for m in ("sync", "async")])]
    syncs = [s for runs in d["raw"].values() for run in runs for s in run["syncs"]]
    out += [f"\nReward per trained sample, every run: ![reward curves](benchmarks/results/{d['reward_png']})\n"]
    if syncs:
        out += [sync_phase_table(syncs, "tiny, from the sync_events of these runs")]
    return "\n".join(out)


def sync_phase_table(syncs: list[dict[str, Any]], what: str) -> str:
    keys = ("download_s", "pause_s", "reload_s", "verify_s", "total_s")
    cells = [summarize([s[k] for s in syncs if s[k] is not None]).fmt(3, " s")
             if any(s[k] is not None for s in syncs) else "–" for k in keys]
    return (f"\nWeight-sync phases per sync ({what}; {len(syncs)} syncs, {syncs[0]['bytes'] / 1e6:.1f} MB):\n\n"
            + table(["download", "pause", "reload", "verify", "total (sidecar)"], [cells]))


def orchestration_section(d: dict[str, Any]) -> str:
    rows = []
    for seconds, c in d["cases"].items():
        label = f"{float(seconds) * 1000:.0f} ms" if float(seconds) > 0 else "0 (max rate)"
        for kind in TEMPORAL_DRIVERS:
            t = c[kind]
            rows.append([label, f"{c['trajectories']} @ {c['concurrency']}", kind, fmt(c["bare_rate"], 1),
                         fmt(t["rate"], 2), fmt(t["throughput_ratio"], 3), fmt(t["overhead_pct"], 1, " %"),
                         fmt(t["added_latency_ms"], 0, " ms")])
    return "\n".join([header(d), f"Each trajectory = 2 activities (model call, tool call) in one workflow; "
                      f"{d['params']['repeats']} repeats, drivers alternating. `temporal`: the stack's dev server "
                      "(SQLite in WAL mode, no fsync per commit), the workflow sandbox on, as rlpipe runs; "
                      "`temporal_unsandboxed`: the same server, the sandbox off; `temporal_sqlite_defaults`: a "
                      "second dev server with SQLite's default journal and an fsync per commit.\n",
                      table(["trajectory", "n @ concurrency", "driver", "bare asyncio traj/s", "Temporal traj/s",
                             "throughput ratio", "overhead", "added latency / traj"], rows)])


def weight_sync_section(d: dict[str, Any]) -> str:
    rows = [[name, f"{m['bytes'] / 1e6:.1f}", fmt(m["upload_s"], 3, " s"), fmt(m["download_s"], 3, " s"),
             fmt(m["upload_plus_download_s"], 3, " s"), fmt(m["raw_copy_s"], 3, " s"), fmt(m.get("raw_copy_cold_s"), 3, " s"),
             fmt(m["ratio_to_raw_copy"], 1, "×"), fmt(m.get("ratio_to_cold_copy"), 1, "×"), fmt(m["transfer_mb_per_s"], 0)]
            for name, m in d["models"].items()]
    out = [header(d), "**Checkpoint transfer** (weights/checkpoints.py on a private SeaweedFS: content-addressed "
           "upload with sha256, download hashed as it streams) against a copy of the same files on this disk: "
           "hot = source in the page cache, cold = source evicted from this VM's page cache first (the VM's host "
           "may still cache it); no copy is fsynced. Repeats alternate between the models.\n",
           table(["model", "MB", "upload", "download", "up + down", "copy, hot", "copy, cold", "ratio to hot",
                  "ratio to cold", "transfer MB/s"], rows)]
    runs = load("async_vs_sync")
    if d.get("server"):
        out += [server_sync_table(d["server"], runs)]
    if runs:
        out += [sync_interval_table(runs)]
    return "\n".join(out)


def server_sync_table(server: dict[str, Any], runs: dict[str, Any] | None) -> str:
    """SmolLM2 syncs into a real server, phase by phase, with the tiny model's from the pipeline runs."""
    rows = []
    for path, p in server["paths"].items():
        rows.append([f"SmolLM2, {path}", f"{p['n_ok']}/{p['n']}",
                     *(fmt(p.get(k), 3, " s") for k in ("upload_s", "download_s", "pause_s", "reload_s", "verify_s",
                                                          "total_s", "end_to_end_s")),
                     fmt(p.get("end_to_end_over_fastest_copy"), 1, "×")])
    syncs = [s for measured in runs["raw"].values() for run in measured for s in run["syncs"]] if runs else []
    if syncs:
        rows.append(["tiny, pipeline runs of section 1", f"{len(syncs)}", "–",
                     *(summarize([s[k] for s in syncs if s[k] is not None]).fmt(3, " s")
                       for k in ("download_s", "pause_s", "reload_s", "verify_s", "total_s")), "–", "–"])
    floors = server["floors_s"]
    return (f"\n**Syncs into a real vLLM server** ({server['model']}, {server['bytes'] / 1e6:.1f} MB; the server took "
            f"{server['start_s']:.0f} s to start). Each sync publishes a new version the trainer's way (S3 upload, "
            "version row with the probe) and the sidecar (weights.sidecar.Sidecar.sync) loads it: download (or, on a "
            "shared filesystem, sha256 of the trainer's file in place), pause window = pause → reload → label → "
            "prefix-cache reset → resume, verify = probe logprobs + greedy continuation while serving. Versions "
            "alternate between two perturbed copies of the weights; the server is idle (a 'wait' pause under load adds "
            "the longest generation in flight). Publish → verified = upload + sidecar total, against the floor: the "
            f"fastest copy of the same bytes measured above ({floors.get('fastest_copy', floors['raw_copy']):.3f} s; "
            f"medians: hot {floors['raw_copy']:.3f} s, cold {floors['cold_copy']:.3f} s).\n\n"
            + table(["sync", "ok", "upload", "download", "pause window", "reload", "verify", "sidecar total",
                     "publish → verified", "vs the floor"], rows))


def sync_interval_table(runs: dict[str, Any]) -> str:
    """Sync share of wall time by sync interval, from the async-vs-sync runs at the headline setting:
    `sync share` = some server syncing (any phase), `paused share` = the server paused (generation lost)."""
    rows = []
    for variant, h in runs["results"]["headline_variants"].items():
        measured = runs["raw"][f"{HEADLINE}|{variant}"]
        paused = [sum(s["pause_s"] or 0.0 for s in r["syncs"]) / r["wall_s"] for r in measured]
        rows.append([variant, str(h["max_staleness"]), str(h["sync_interval"]),
                     summarize([len(r["syncs"]) for r in measured]).fmt(0), fmt(h["wall_s"], 1, " s"),
                     fmt(h["sync_share"], 3), summarize(paused).fmt(3)])
    return (f"\n**Sync share of wall time by sync interval** (tiny model, the async-vs-sync runs at {HEADLINE}, "
            "section 1): sync share = wall time with a sync in progress on the server (download, pause, reload, "
            "verify; observe/queries.sync_share); paused share = the server's paused seconds (sync_events.pause_s) "
            "over the run's wall time, the generation time syncs cost; downloads and verification run while the "
            "server serves.\n\n"
            + table(["variant", "max_staleness", "sync interval", "syncs per run", "wall", "sync share",
                     "paused share"], rows))


def trainer_section(d: dict[str, Any]) -> str:
    """The in-process profile of the trainer's publishing step against the bare loop, with uploads
    beside the next step and (when measured) inside the step; then the Temporal worker's recorded
    steps when async_vs_sync left them."""
    parts, speed = [header(d)], ["what", "tokens/s", "speed relative to the bare loop"]
    if "phases" in d:   # the profile (this module alone); async_vs_sync may have written only "worker"
        names = {"claim_s": "claim the batch (Postgres)", "read_s": "read the claimed trajectories (Postgres)",
                 "plan_s": "advantages, denominators, collate (plan_step)",
                 "engine_s": "engine step: forward, loss + metrics, backward, clip, AdamW",
                 "upload_wait_s": "wait for the previous version's background upload",
                 "save_s": "publish: safetensors checkpoint to disk, with the weights' sha256",
                 "hash_s": "publish: sha256 of the other files (the weights' from the save, since 2026-12-06)",
                 "train_state_s": "publish: optimizer state (torch.save; to S3 with the upload)",
                 "upload_s": "publish: files + manifest to S3 (in the step; beside the next one: only the run's last)",
                 "probe_s": "publish: probe (teacher-forced logprobs + 16 greedy tokens, KV-cached since 2026-12-06)",
                 "commit_and_rest_s": "committed check, batch metrics, commit, the rest", "wall_s": "whole step"}
        beside = d.get("background_uploads")
        ratios = [["trainer step, publishing every step (CPU default: upload inside the step): claim … commit",
                   fmt(d["trainer_tokens_per_s"], 0), fmt(d["trainer_over_bare"], 2)],
                  *([["the same steps, each upload in a thread beside the next step (GPU default), run right after",
                      fmt(beside["trainer_tokens_per_s"], 0), fmt(beside["trainer_over_bare"], 2)]] if beside else []),
                  ["its engine step alone (LocalEngine.step)", fmt(d["engine_tokens_per_s"], 0),
                   fmt(d["engine_over_bare"], 2)],
                  ["bare PyTorch loop, same batches", fmt(d["bare_tokens_per_s"], 0), "1"]]
        shape = d["shape"]
        runs = [d["phases"], *([beside["phases"]] if beside else [])]
        phases = [[names[k], *(f"{ph[k] * 1000:.1f}" if k in ph else "–" for ph in runs)] for k in names]
        parts += [f"`Trainer.train_step` in the benchmark's process on a private Postgres + SeaweedFS, the "
                  f"{Path(d['model']).name} model, {shape['groups_per_step']} groups × {shape['group_size']} samples "
                  "(~1k tokens) per step; "
                  f"{len(d['steps'])} counted steps, every one publishing, back to back; then {d['repeats']} "
                  f"bare-loop steps on each one's batch. Publish share of a step: {fmt(d['publish_share'], 2)}.\n",
                  table(speed, ratios),
                  "\nWhere a step's time goes (median ms; the phases are what the trainer records in "
                  "`train_steps.metrics`, the rest is the wall time less them):\n",
                  table(["phase", "upload inside the step (ms)",
                         *(["upload beside the next step (ms)"] if beside else [])], phases)]
    w = d.get("worker")
    if w:
        parts += [f"\nThe Temporal trainer worker's recorded steps (`{w['command']}`, {len(w['steps'])} sync-run "
                  "steps, all publishing; the worker process shares the 2 cores with vLLM and four other "
                  "workers):\n",
                  table(speed, [["worker step, claim … commit (recorded)", fmt(w["trainer_tokens_per_s"], 0),
                                 fmt(w["trainer_over_bare"], 2)],
                                ["engine path replayed on the same batches", fmt(w["engine_tokens_per_s"], 0),
                                 fmt(w["engine_over_bare"], 2)]])]
    return "\n".join(parts)


def graders_section(d: dict[str, Any]) -> str:
    rows = [[key.split("|")[0], key.split("|")[1], str(c["n"]), fmt(c["cold_per_s"], 1), fmt(c["warm_per_s"], 1),
             fmt(c["warm_over_cold"], 1, "×")] for key, c in d["cases"].items()]
    return "\n".join([header(d), table(["grader", "concurrency", "gradings", "cold cache /s", "warm cache /s",
                                       "warm / cold"], rows)])


def trl_section(d: dict[str, Any]) -> str:
    """Seconds per training step of TRL and rlpipe, each as it is meant to run, and what each includes."""
    p, r = d["params"], d["results"]
    t, v = r["trl"], p["trl_versions"]
    rows = [[f"TRL GRPOTrainer {v['trl']} (transformers {v['transformers']})", "one process; transformers "
             "generates (use_vllm=False), one turn per sample", fmt(t["step_s"], 2, " s"), fmt(t["generate_score_s"], 2, " s"),
             fmt(t["loss_backward_optimizer_s"], 2, " s"), f"{t['completion_tokens_mean']:.1f}", f"{t['reward_mean']:.3f}"]]
    for mode, how in (("async", "async, max_staleness 1"), ("sync", "mode sync, lock-step")):
        m = r[f"rlpipe_{mode}"]
        rows.append([f"rlpipe {mode}", f"{p['config']} as shipped ({how}; no injected tool latency): Temporal, "
                     "vLLM, trainer and rollout workers", fmt(m["step_s"], 2, " s"), "–",
                     fmt(m["train_s"], 2, " s") if "train_s" in m else "–", f"{m['completion_tokens_mean']:.1f}",
                     f"{m['reward_mean']:.3f}"])
    runs = load("async_vs_sync")
    for mode in ("async", "sync") if runs else ():
        measured = runs["raw"][f"{HEADLINE}|{mode}"]
        rows.append([f"rlpipe {mode}, section 1 headline", f"{HEADLINE} injected tool latency (median "
                     f"{runs['params']['median_tool_s']} s per call); wall / steps, start-up included",
                     summarize([x["wall_s"] / len(x["rewards"]) for x in measured]).fmt(2, " s"), "–", "–", "–", "–"])
    return "\n".join([
        header(d), f"The tiny model on CPU, the same {p['config']} train prompts in the same order, the same step: "
        f"{p['groups_per_step']} prompts × {p['group_size']} samples = {t['samples_per_step']} trained samples per "
        f"optimizer step, at most {p['max_tokens']} new tokens per generation, lr {p['lr']}, AdamW betas (0.9, 0.99), "
        "grad clip 1, PPO clip 0.2, no KL term. TRL runs in its own environment (`.venv-trl`, "
        f"`make bench-trl-venv`; torch {v['torch']}, {v['torch_threads']} threads); its reward is rlpipe's "
        "`answer_match` rule reimplemented. TRL cannot run rlpipe's `<calc>` tool turn, so its samples are one "
        f"turn (a calculator call scores 0); rlpipe's have up to {p['max_turns']} turns, hence more tokens. "
        f"Seconds per step: TRL, the Trainer's step begin → end (generation, reward, loss, backward, AdamW) of "
        f"{p['trl_steps']} steps after {p['trl_warmup']} warm-up steps, generation + reward timed inside it; rlpipe, "
        f"per run the mean time between consecutive train-step commits, {p['repeats']} runs × {p['rlpipe_steps']} "
        "steps per mode (the first step, which waits for start-up, left out; async trains in bursts of two); "
        "its trainer step is the recorded claim … commit "
        "incl. publish, shown for sync mode, where nothing runs beside it. TRL ran first, alone; then rlpipe on "
        "a private stack.\n",
        table(["what", "configuration", "s per step", "generation + reward", "loss, backward, optimizer (TRL) / "
               "trainer step (rlpipe)", "completion tokens / sample", "reward / sample"], rows)])


def sharded_section(d: dict[str, Any]) -> str:
    """Memory per rank and step time at world size 1 and 2; the same arithmetic for 7B and 70B."""
    p, m, r = d["params"], d["measured"], d["ratios"]
    gib = 2**30
    rows = [[str(x["world_size"]), _launch(x), f"{x['model_state_bytes'] / gib:.2f} GiB",
             f"{x['peak_rss_bytes'] / gib:.2f} GiB", fmt(x["step_s"], 2, " s"), f"{x['gather_full_weights_s']:.2f} s",
             _train_state(x)] for x in m.values()]
    rows.append(["2 ÷ 1", "forked", f"{r['model_state_per_rank_2_over_1']:.2f}",
                 f"{r['peak_rss_per_rank_2_over_1']:.2f}", f"{r['step_time_2_over_1']:.2f}", "–",
                 f"{r['train_state_file_2_over_1']:.2f} (file per rank)"])
    large = [[name, f"{x['params'] / 1e9:.2f} B", f"{x['replicated_gib']:.0f} GiB",
              *(f"{x['sharded_gib'][str(n)]:.1f} GiB" for n in (8, 16, 64)), f"{x['largest_gathered_gib']:.2f} GiB"]
             for name, x in d["large_models"].items()]
    return "\n".join([
        header(d), f"{p['model']}, {p['sequences']} sequences × {p['tokens_per_sequence']} tokens per step, fp32, AdamW; "
        f"each world size in a process of its own, {p['steps']} timed steps after a warm-up. Model state: the "
        "parameters a rank holds × 4 (its gradients and AdamW's two moments are sharded like them). Peak RSS "
        "includes Python, torch and transformers and the step's activations. World 2 runs two ranks on this "
        "machine's two cores, so its step time says what lockstep collectives cost here, not what a second "
        "GPU buys.\n",
        table(["world size", "ranks", "model state per rank", "peak RSS per rank", "step", "gather the full weights",
               "write the recovery state"], rows),
        f"\nRanks launched by torchrun (one agent, c10d rendezvous on loopback, commands through the trainer's "
        f"store) step in {r['step_time_torchrun_over_forked']:.2f}× the time of forked ones.",
        "", "fp32 parameters + gradients + AdamW state per rank (16 bytes per parameter), computed from the models' "
        "configs; the last column is the largest unit gathered whole while it runs (weights and gradient):", "",
        table(["model", "parameters", "replicated (every rank)", "8 ranks", "16 ranks", "64 ranks",
               "largest gathered unit"], large)])


def _launch(x: dict[str, Any]) -> str:
    return "one process" if x["world_size"] == 1 else ("torchrun" if x.get("launch") == "torchrun" else "forked")


def _train_state(x: dict[str, Any]) -> str:
    """Seconds to write the recovery state, and its largest per-rank file."""
    return f"{x['train_state_s']:.2f} s, {x['train_state_file_bytes'] / 2**30:.2f} GiB per rank"


def sync_precision_section(d: dict[str, Any]) -> str:
    """Per model and (server dtype, published dtype): the probe difference of a faithful load and of each
    wrong one against the probe the trainer records, judged by the bound the server's dtype gets."""
    from rlpipe.weights.tolerance import probe_tolerance

    wrong = list(d["params"]["plan"])
    labels = [w["label"] for w in wrong if w["wrong"]]
    rows, spread = [], []
    for model, m in d["models"].items():
        for config, c in m["summary"].items():
            ref, bound = c["reference"], probe_tolerance(c["server"])
            cells = [f"**{v:.1e}**" if v > bound else f"{v:.1e}" for v in (ref["wrong"][x] for x in labels)]
            rows.append([model, config, c["server"], c["published"], f"{ref['right']:.1e}", *cells, f"{bound:g}"])
        s1 = m["summary"]["S1"]["right"]
        spread.append([model, *(f"{s1[side]['max_abs_diff']:.1e}" for side in ("autocast-bf16", "bf16-params"))])
    return "\n".join([
        header(d), "A vLLM server per dtype, loaded through the sync path (pause, reload, prefix-cache reset, "
        "resume) with each state published in fp32 or bf16, and asked what a sync asks: the max |server - "
        "trainer| teacher-forced logprob over the probe's tokens, against the probe the trainer records (the "
        "fp32 forward of the published bytes). Wrong states (SmolLM2's tensors; the tiny model's are its own "
        "middle layers'): " + "; ".join(
            f"{k} = {v}" for k, v in next(iter(d["models"].values()))["wrong_tensors"].items())
        + "; previous-version = the weights one 1e-5 random-sign step behind. **Bold**: above the bound the "
        "server's dtype gets (weights/tolerance.py), so the sync rolls it back.\n",
        table(["model", "", "server", "published", "faithful load", *labels, "bound"], rows), "",
        "Why the probe is not the trainer's own bf16 forward: against the fp32 server's faithful fp32 load, "
        "a bf16 trainer's probe is this far off (autocast in one process; bf16 parameters as FSDP2 gathers "
        "them):", "", table(["model", "autocast", "bf16 parameters"], spread)])


SECTIONS: list[tuple[str, str, Callable[[dict[str, Any]], str]]] = [
    ("1. Async vs the synchronous baseline", "async_vs_sync", async_section),
    ("2. Orchestration overhead: Temporal vs bare asyncio", "orchestration", orchestration_section),
    ("3. Weight sync end to end vs the raw byte copy", "weight_sync", weight_sync_section),
    ("3b. Sync verification by dtype", "sync_precision", sync_precision_section),
    ("4. Trainer efficiency", "trainer_efficiency", trainer_section),
    ("4b. Trainer efficiency, SmolLM2-135M", "trainer_efficiency_smollm2", trainer_section),
    ("4c. Sharded trainer: memory per rank and step time", "sharded_trainer", sharded_section),
    ("5. Grader throughput", "graders", graders_section),
    ("6. Peer comparison: TRL GRPOTrainer", "trl_grpo", trl_section),
]


def machine_line(results: list[dict[str, Any]]) -> str:
    m = results[0]["machine"]
    loads = ", ".join(f"{r['benchmark']} {r['machine']['load_avg_at_start'][0]:.1f}" for r in results)
    return (f"{m['cores']} cores ({m['cpu']}), {m['ram_gib']} GiB RAM, no GPU; Python {m['python']}, torch "
            f"{m['torch']} ({m['torch_threads']} threads). The machine is shared with other engineers' test "
            f"suites: 1-minute load average when each benchmark started: {loads}.")


def render(targets: list[Target]) -> str:
    found = {name: load(name) for _, name, _ in SECTIONS}
    present = [d for d in found.values() if d]
    parts = ["# rlpipe benchmarks", "",
             "Generated by `make bench` (`benchmarks/report.py` renders `benchmarks/results/*.json`). Every "
             "number is the median of repeated runs with its min–max in brackets; compared things ran side by "
             "side in one process run. Nothing here is a timed assertion in the tests.", ""]
    if present:
        parts += ["**Machine.** " + machine_line(present), ""]
    parts += ["## Targets", "", "Also in `benchmarks/results/targets.json`; each value's source and command are "
              "there.", "", targets_table(targets), ""]
    if FINDINGS.exists():
        parts += [FINDINGS.read_text().strip(), ""]
    for title, name, section in SECTIONS:
        parts += [f"## {title}", ""]
        d = found[name]
        parts += [section(d) if d else f"Not measured in the last run: `benchmarks/results/{name}.json` is missing.", ""]
    return "\n".join(parts)


def main() -> None:
    OUT.write_text(render(write_targets()))
    print(OUT)


if __name__ == "__main__":
    main()
