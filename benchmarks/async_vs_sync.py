"""Async vs the synchronous baseline through the real pipeline (issue #8, item 1).

One private stack (Temporal, Postgres, SeaweedFS, one vLLM server with the tiny model) and the real
workers. For each tool-latency setting (lognormal sigma 0.5/1.0/1.5 and a bursty trace), the same run
config (tiny-calculator: multi-turn tool use) runs in `sync` and `async` mode, interleaved, repeated.
Same seed, model, environment and number of trained samples; only `mode` differs.

Read back from Postgres (observe/queries.py): wall time, reward per step, staleness (v_version_lag),
busy/idle per box (activity_spans). The bottleneck bound is measured at the headline setting:
trainer capacity = trained samples / train-step seconds of the sync run (the trainer alone);
rollout capacity = completed samples / rollout window of async runs whose staleness budget never
holds rollouts back (max_staleness = steps), i.e. rollouts at full concurrency. The headline setting
also runs async with max_staleness 2 and 4, and sync intervals 2 and 4 (sync share of wall time).

    .venv/bin/python -m benchmarks.async_vs_sync [--steps 4 --repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, private_stack, progress_bar, summarize, tiny_model, write_result

NAME = "async_vs_sync"
MEDIAN_TOOL_S = 1.0   # median injected tool latency: remote-sandbox scale; makes a rollout phase about a train step
BURSTY = (0.1,) * 12 + (4.0,) * 4   # a calm stretch, then a burst of slow calls, replayed cyclically
HEADLINE = "sigma=1.0"
ASYNC_STALENESS = 1   # the product's default budget (configs/tiny-calculator.toml)
WIDE = 4              # a staleness budget as large as the runs' steps: rollouts are never held back

# variant -> (mode, max_staleness, sync interval). Every latency setting runs sync and async; the
# headline setting also runs the wider budgets and sync intervals (cost of syncing vs staleness).
VARIANTS: dict[str, tuple[str, int | None, int]] = {
    "sync": ("sync", None, 1), "async": ("async", ASYNC_STALENESS, 1),
    "async s=2": ("async", 2, 1), f"async s={WIDE}": ("async", WIDE, 1),
    f"async s={WIDE} i=2": ("async", WIDE, 2), f"async s={WIDE} i=4": ("async", WIDE, 4)}
PAIRED = ("sync", "async")
ROLLOUT_ALONE = f"async s={WIDE}"


def latency_settings() -> dict[str, dict[str, Any]]:
    """Tool-latency models by label (sandbox/latency.py shapes)."""
    settings: dict[str, dict[str, Any]] = {
        f"sigma={s}": {"kind": "lognormal", "median_seconds": MEDIAN_TOOL_S, "sigma": s, "seed": 0}
        for s in (0.5, 1.0, 1.5)}
    settings["bursty"] = {"kind": "trace", "seconds": list(BURSTY)}
    return settings


def run_config(model: Path, variant: str, latency: dict[str, Any], steps: int):  # type: ignore[no-untyped-def]
    """tiny-calculator with the benchmark's knobs; no held-out eval (it would add the same time to both)."""
    from tests.integration.runs import tiny_config

    mode, staleness, interval = VARIANTS[variant]   # sync admits only max_staleness 0 (None)
    return tiny_config(model, "tiny-calculator.toml", name=f"b-{mode}-{uuid.uuid4().hex[:8]}", steps=steps,
                       mode=mode, max_staleness=staleness, eval={"prompts": 0}, sync={"interval": interval},
                       rollout={"tool_latency": latency})


SYNC_FIELDS = ("version", "bytes", "download_s", "pause_s", "reload_s", "verify_s", "total_s")


@dataclass(frozen=True)
class RunMeasure:
    """What one finished run left in Postgres, reduced to numbers."""

    run_id: str
    mode: str
    wall_s: float
    samples: int
    generated: int
    train_s: float
    rollout_window_s: float
    rewards: list[float]
    samples_per_step: list[int]
    staleness: dict[int, int]
    busy: dict[str, float]
    sync_share: float
    syncs: list[dict[str, Any]]


def measure_run(db, run_id: str, wall_s: float, mode: str) -> RunMeasure:  # type: ignore[no-untyped-def]
    import sqlalchemy as sa

    from rlpipe.observe.queries import box_usage, staleness_histogram, step_metrics, sync_share, sync_timings

    with db.begin() as s:
        steps = step_metrics(s, run_id)
        usage = box_usage(s, run_id)
        lag = staleness_histogram(s, run_id)
        share = sync_share(s, run_id)
        syncs = [{k: getattr(r, k) for k in SYNC_FIELDS} for r in sync_timings(s, run_id) if r.status == "ok"]
        t0, t1, generated = s.execute(sa.text(
            "select min(g.started_at), max(g.completed_at), sum(g.n_completed) from rollout_groups g "
            "where g.run_id = :r and g.status = 'completed'"), {"r": run_id}).one()
    return RunMeasure(run_id, mode, wall_s, sum(st.n_trajectories for st in steps), int(generated or 0),
                      sum(st.duration_s for st in steps),
                      (t1 - t0).total_seconds(), [float(st.reward_mean or 0.0) for st in steps],
                      [st.n_trajectories for st in steps], lag, {b: u.busy_fraction for b, u in usage.items()},
                      share.share if share else 0.0, syncs)


async def run_once(client, db, cfg) -> RunMeasure:  # type: ignore[no-untyped-def]
    from rlpipe.cli.run_commands import start_run

    t0 = time.perf_counter()
    await asyncio.wait_for((await start_run(client, cfg)).result(), 1200)
    return measure_run(db, cfg.name, time.perf_counter() - t0, cfg.mode)


async def run_all(model: Path, stack, steps: int, repeats: int, labels: list[str]) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    from rlpipe.infra.endpoints import resolve_endpoints
    from rlpipe.storage.db import Database
    from rlpipe.workers.common import connect

    endpoints = resolve_endpoints(stack.settings)
    client, db = await connect(endpoints), Database(endpoints.database_url)
    settings = latency_settings()
    extra = [v for v in VARIANTS if v not in PAIRED]
    plan = [(label, v) for _ in range(repeats) for label in labels for v in PAIRED + (tuple(extra) if label == HEADLINE else ())]
    runs: dict[str, list[RunMeasure]] = {}
    with progress_bar() as bar:
        task = bar.add_task("async vs sync runs", total=len(plan))
        for label, variant in plan:
            bar.update(task, description=f"{label} {variant}")
            cfg = run_config(model, variant, settings[label], steps)
            runs.setdefault(f"{label}|{variant}", []).append(await run_once(client, db, cfg))
            bar.advance(task)
    db.dispose()
    return {"runs": runs, "settings": settings}


def analyse(runs: dict[str, list[RunMeasure]], labels: list[str]) -> dict[str, Any]:
    """Speedup per setting (ratio of medians and per-repeat ratios), efficiency vs the bound."""
    table = {}
    for label in labels:
        sync, asy = runs[f"{label}|sync"], runs[f"{label}|async"]
        ratios = [s.wall_s / a.wall_s for s, a in zip(sync, asy)]   # paired: run back to back
        table[label] = {
            "sync_wall_s": summarize([r.wall_s for r in sync]), "async_wall_s": summarize([r.wall_s for r in asy]),
            "speedup": summarize(ratios),
            "sync_reward": summarize([sum(r.rewards) / len(r.rewards) for r in sync]),
            "async_reward": summarize([sum(r.rewards) / len(r.rewards) for r in asy]),
            "async_staleness": merged_histogram([r.staleness for r in asy]),
            "sync_staleness": merged_histogram([r.staleness for r in sync]),
            "busy": {mode: {box: summarize([r.busy.get(box, 0.0) for r in rs]) for box in rs[0].busy}
                     for mode, rs in (("sync", sync), ("async", asy))},
        }
    head_sync = runs[f"{HEADLINE}|sync"]
    sync_wall = summarize([r.wall_s for r in head_sync]).median
    trainer_cap = summarize([r.samples / r.train_s for r in head_sync])       # samples/s, trainer alone
    rollout_cap = summarize([r.generated / r.rollout_window_s for r in runs[f"{HEADLINE}|{ROLLOUT_ALONE}"]])
    bound = min(trainer_cap.median, rollout_cap.median)
    variants = {v: {"wall_s": summarize([r.wall_s for r in rs]),
                    "speedup_vs_sync_median": summarize([sync_wall / r.wall_s for r in rs]),
                    "achieved_samples_per_s": summarize([r.samples / r.wall_s for r in rs]),
                    "efficiency": summarize([r.samples / r.wall_s / bound for r in rs]),
                    "sync_share": summarize([r.sync_share for r in rs]),
                    "staleness": merged_histogram([r.staleness for r in rs]),
                    "max_staleness": VARIANTS[v][1] or 0, "sync_interval": VARIANTS[v][2]}
                for v in VARIANTS if (rs := runs.get(f"{HEADLINE}|{v}"))}
    return {"settings": table, "headline_variants": variants, "bottleneck": {
        "trainer_capacity_samples_per_s": trainer_cap, "rollout_capacity_samples_per_s": rollout_cap,
        "bound_samples_per_s": bound}}


def merged_histogram(hists: list[dict[int, int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for h in hists:
        for lag, n in h.items():
            out[lag] = out.get(lag, 0) + n
    return dict(sorted(out.items()))


def plot_rewards(runs: dict[str, list[RunMeasure]], labels: list[str], path: Path) -> Path:
    """Reward per trained sample, sync vs async, one panel per latency setting (every repeat drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(labels), figsize=(4 * len(labels), 3.2), sharey=True, squeeze=False)
    for ax, label in zip(axes[0], labels):
        for mode, colour in zip(PAIRED, ("tab:blue", "tab:orange")):
            for i, r in enumerate(runs[f"{label}|{mode}"]):
                xs = [sum(r.samples_per_step[: k + 1]) for k in range(len(r.rewards))]
                ax.plot(xs, r.rewards, color=colour, alpha=0.8, marker="o", ms=3, label=mode if i == 0 else None)
        ax.set_title(label)
        ax.set_xlabel("trained samples")
    axes[0][0].set_ylabel("step mean reward")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def trainer_efficiency_in(stack, run_ids: list[str], model: Path) -> None:  # type: ignore[no-untyped-def]
    """Item 4 on the same stack: the sync runs' trainer steps against a bare loop on their batches."""
    from benchmarks.trainer_efficiency import record
    from rlpipe.infra.endpoints import resolve_endpoints
    from rlpipe.storage.db import Database

    db = Database(resolve_endpoints(stack.settings).database_url)
    try:
        print(record(db, run_ids, model, command=f".venv/bin/python -m benchmarks.{NAME}"))
    except Exception:  # noqa: BLE001 - the headline results are written already; say what failed
        traceback.print_exc()
        print("trainer efficiency failed: benchmarks/results/trainer_efficiency.json not written")
    finally:
        db.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--settings", nargs="*", default=list(latency_settings()))
    args = parser.parse_args()
    if HEADLINE not in args.settings:
        args.settings.insert(0, HEADLINE)
    model = tiny_model()
    t0 = time.perf_counter()
    with private_stack(inference_model=model, workers=True) as stack:
        setup_s = time.perf_counter() - t0
        out = asyncio.run(run_all(model, stack, args.steps, args.repeats, args.settings))
        runs = out["runs"]
        png = plot_rewards(runs, args.settings, RESULTS / f"{NAME}_reward.png")
        print(write_result(NAME, {"params": {"steps": args.steps, "repeats": args.repeats, "group_size": 4,
                                             "groups_per_step": 2, "max_staleness_async": ASYNC_STALENESS,
                                             "median_tool_s": MEDIAN_TOOL_S, "latency": out["settings"],
                                             "variants": VARIANTS},
                                  "stack_setup_s": setup_s, "results": analyse(runs, args.settings),
                                  "raw": runs, "reward_png": png.name}))
        trainer_efficiency_in(stack, [r.run_id for r in runs[f"{HEADLINE}|sync"]], model)


if __name__ == "__main__":
    main()
