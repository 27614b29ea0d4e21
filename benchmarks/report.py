"""Render BENCHMARKS.md from benchmarks/results/*.json (the last `make bench`), plus the hand-written
reading of the numbers in benchmarks/findings.md. Missing results are named, never invented.

    .venv/bin/python -m benchmarks.report
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, ROOT

OUT = ROOT / "BENCHMARKS.md"
FINDINGS = ROOT / "benchmarks" / "findings.md"


def fmt(s: dict[str, Any] | None, digits: int = 2, unit: str = "") -> str:
    """A stored Summary as 'median (min–max)'."""
    if not s:
        return "–"
    if s["n"] == 1:
        return f"{s['median']:.{digits}f}{unit} (n=1)"
    return f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


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
    out += ["\n**Pipeline efficiency** (headline setting sigma=1.0): trainer capacity alone "
            f"{fmt(b['trainer_capacity_samples_per_s'], 2)} samples/s (trained samples / train-step seconds of the "
            f"sync runs); rollout capacity alone {b['rollout_capacity_samples_per_s']:.2f} samples/s (an async run "
            f"with max_staleness = steps, rollouts never held back). Bound = {b['bound_samples_per_s']:.2f} samples/s.\n",
            table(["mode", "achieved samples/s", "efficiency vs bound"],
                  [["async", fmt(b["async_achieved_samples_per_s"], 3), fmt(b["async_efficiency"], 2)],
                   ["sync", "–", fmt(b["sync_efficiency"], 2)]])]
    busy = r["settings"].get("sigma=1.0", next(iter(r["settings"].values())))["busy"]
    boxes = sorted({b for m in busy.values() for b in m})
    out += ["\n**Busy fraction per box** (sigma=1.0; overlapping activity spans merged, over the run's wall "
            "time; idle = 1 − busy):\n",
            table(["mode", *boxes], [[m, *(fmt(busy[m].get(b), 2) for b in boxes)] for m in ("sync", "async")])]
    syncs = [s for runs in d["raw"].values() for run in runs for s in run["syncs"]]
    out += [f"\nReward per trained sample, every run: ![reward curves](benchmarks/results/{d['reward_png']})\n"]
    if syncs:
        out += [sync_phase_table(syncs, "tiny, from the sync_events of these runs")]
    return "\n".join(out)


def sync_phase_table(syncs: list[dict[str, Any]], what: str) -> str:
    from benchmarks.common import summarize

    keys = ("download_s", "pause_s", "reload_s", "verify_s", "total_s")
    cells = [fmt(summarize([s[k] for s in syncs if s[k] is not None]).__dict__, 3, " s")
             if any(s[k] is not None for s in syncs) else "–" for k in keys]
    return (f"\nWeight-sync phases per sync ({what}; {len(syncs)} syncs, {syncs[0]['bytes'] / 1e6:.1f} MB):\n\n"
            + table(["download", "pause", "reload", "verify", "total (sidecar)"], [cells]))


def orchestration_section(d: dict[str, Any]) -> str:
    rows = []
    for seconds, c in d["cases"].items():
        label = f"{float(seconds) * 1000:.0f} ms" if float(seconds) > 0 else "0 (max rate)"
        for kind in ("temporal", "temporal_unsandboxed"):
            t = c[kind]
            rows.append([label, f"{c['trajectories']} @ {c['concurrency']}", kind, fmt(c["bare_rate"], 1),
                         fmt(t["rate"], 2), fmt(t["throughput_ratio"], 3), fmt(t["overhead_pct"], 1, " %"),
                         fmt(t["added_latency_ms"], 0, " ms")])
    return "\n".join([header(d), f"Each trajectory = 2 activities (model call, tool call) in one workflow; "
                      f"{d['params']['repeats']} repeats, drivers alternating.\n",
                      table(["trajectory", "n @ concurrency", "driver", "bare asyncio traj/s", "Temporal traj/s",
                             "throughput ratio", "overhead", "added latency / traj"], rows)])


def weight_sync_section(d: dict[str, Any]) -> str:
    rows = [[name, f"{m['bytes'] / 1e6:.1f}", fmt(m["upload_s"], 3, " s"), fmt(m["download_s"], 3, " s"),
             fmt(m["upload_plus_download_s"], 3, " s"), fmt(m["raw_copy_s"], 3, " s"), fmt(m["ratio_to_raw_copy"], 1, "×"),
             fmt(m["transfer_mb_per_s"], 0), fmt(m["raw_copy_mb_per_s"], 0)]
            for name, m in d["models"].items()]
    return "\n".join([header(d), table(["model", "MB", "upload (S3, sha256)", "download (verified)", "up + down",
                                       "raw local copy", "ratio", "transfer MB/s", "raw copy MB/s"], rows)])


def trainer_section(d: dict[str, Any]) -> str:
    rows = [["trainer worker step (claim … commit, incl. publish)", fmt(d["trainer_tokens_per_s"], 0),
             fmt(d["trainer_over_bare"], 2)],
            ["trainer compute only (`train_s`: plan + fwd/bwd/AdamW + metrics)",
             fmt(d["trainer_compute_only_tokens_per_s"], 0), fmt(d["compute_only_over_bare"], 2)],
            ["bare PyTorch loop, same batch", fmt(d["bare_tokens_per_s"], 0), "1"]]
    return "\n".join([header(d), f"{len(d['steps'])} steps of sync-mode runs; tokens = padded-batch real tokens; "
                      f"publish share of the trainer step: {fmt(d['publish_share'], 2)}.\n",
                      table(["what", "tokens/s", "share of bare speed"], rows)])


def graders_section(d: dict[str, Any]) -> str:
    rows = [[key.split("|")[0], key.split("|")[1], str(c["n"]), fmt(c["cold_per_s"], 1), fmt(c["warm_per_s"], 1),
             fmt(c["warm_over_cold"], 1, "×")] for key, c in d["cases"].items()]
    return "\n".join([header(d), table(["grader", "concurrency", "gradings", "cold cache /s", "warm cache /s",
                                       "warm / cold"], rows)])


SECTIONS: list[tuple[str, str, Callable[[dict[str, Any]], str]]] = [
    ("1. Async vs the synchronous baseline", "async_vs_sync", async_section),
    ("2. Orchestration overhead: Temporal vs bare asyncio", "orchestration", orchestration_section),
    ("3. Weight sync: checkpoint transfer vs the raw byte copy", "weight_sync", weight_sync_section),
    ("4. Trainer efficiency", "trainer_efficiency", trainer_section),
    ("5. Grader throughput", "graders", graders_section),
]


def machine_line(results: list[dict[str, Any]]) -> str:
    m = results[0]["machine"]
    loads = ", ".join(f"{r['benchmark']} {r['machine']['load_avg_at_start'][0]:.1f}" for r in results)
    return (f"{m['cores']} cores ({m['cpu']}), {m['ram_gib']} GiB RAM, no GPU; Python {m['python']}, torch "
            f"{m['torch']} ({m['torch_threads']} threads). The machine is shared with other engineers' test "
            f"suites: 1-minute load average when each benchmark started: {loads}.")


def render() -> str:
    found = {name: load(name) for _, name, _ in SECTIONS}
    present = [d for d in found.values() if d]
    parts = ["# rlpipe benchmarks", "",
             "Generated by `make bench` (`benchmarks/report.py` renders `benchmarks/results/*.json`). Every "
             "number is the median of repeated runs with its min–max in brackets; compared things ran side by "
             "side in one process run. Nothing here is a timed assertion in the tests.", ""]
    if present:
        parts += ["**Machine.** " + machine_line(present), ""]
    if FINDINGS.exists():
        parts += [FINDINGS.read_text().strip(), ""]
    for title, name, section in SECTIONS:
        parts += [f"## {title}", ""]
        d = found[name]
        parts += [section(d) if d else f"Not measured in the last run: `benchmarks/results/{name}.json` is missing.", ""]
    parts += ["## 6. Peer comparison: TRL GRPOTrainer", "", (ROOT / "benchmarks" / "trl.md").read_text().strip()
              if (ROOT / "benchmarks" / "trl.md").exists() else "Not measured.", ""]
    return "\n".join(parts)


def main() -> None:
    OUT.write_text(render())
    print(OUT)


if __name__ == "__main__":
    main()
