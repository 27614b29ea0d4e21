"""The report's plots: one function per figure, data in (from `observe.queries`), PNG out.

Figures are built with matplotlib's object API on the Agg canvas (no pyplot, no global state, no
display), so plotting works in a worker thread or on a headless server. Each function assumes
its data is non-empty; `observe.report` decides what to skip.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rlpipe.observe.queries import (
    BoxUsage,
    DepthPoint,
    EvalRow,
    RewardDistribution,
    RunWindow,
    Segment,
    StepRow,
    SyncRow,
)

BOX_COLOURS = {"rollout": "tab:blue", "sandbox": "tab:orange", "grader": "tab:red", "persist": "tab:gray",
               "trainer": "tab:green", "sync": "tab:purple"}
"""Also the boxes' order on every plot: the path of a group through the pipeline, top to bottom."""
PHASE_COLOURS = {"download_s": "tab:blue", "pause_s": "tab:orange", "reload_s": "tab:green", "verify_s": "tab:red"}


def _figure(width: float = 8.0, height: float = 4.0) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def pipeline_order(boxes: Sequence[str]) -> list[str]:
    """Boxes in pipeline order (unknown boxes last, by name)."""
    known = list(BOX_COLOURS)
    return sorted(boxes, key=lambda b: (known.index(b) if b in known else len(known), b))


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, format="png")
    return path


def plot_reward(steps: Sequence[StepRow], dist: Sequence[RewardDistribution], path: Path) -> Path:
    """Mean reward per step with the spread of the trajectories' rewards (p10-p90, p25-p75)."""
    fig = _figure()
    ax = fig.add_subplot()
    if dist:
        x = [d.step for d in dist]
        ax.fill_between(x, [d.p10 for d in dist], [d.p90 for d in dist], alpha=0.15, color="tab:blue",
                        label="p10-p90")
        ax.fill_between(x, [d.p25 for d in dist], [d.p75 for d in dist], alpha=0.3, color="tab:blue",
                        label="p25-p75")
        ax.plot(x, [d.p50 for d in dist], color="tab:blue", linestyle="--", linewidth=1, label="median")
    means = [(s.step, s.reward_mean) for s in steps if s.reward_mean is not None]
    ax.plot([step for step, _ in means], [mean for _, mean in means], color="tab:blue", marker="o",
            markersize=3, label="mean")
    ax.set(title="Reward of the trained batch per step", xlabel="optimiser step", ylabel="reward")
    ax.legend(loc="best", fontsize="small")
    return _save(fig, path)


def plot_step_series(steps: Sequence[StepRow], attribute: str, title: str, ylabel: str, path: Path) -> Path:
    """One per-step metric of `train_steps` (response length, entropy, KL...) against the step."""
    points = [(s.step, getattr(s, attribute)) for s in steps if getattr(s, attribute) is not None]
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3)
    ax.set(title=title, xlabel="optimiser step", ylabel=ylabel)
    return _save(fig, path)


def plot_staleness(histogram: dict[int, int], max_staleness: int, path: Path) -> Path:
    """Consumed trajectories by staleness, with the run's bound."""
    fig = _figure(6, 4)
    ax = fig.add_subplot()
    lags = sorted(histogram)
    ax.bar(lags, [histogram[lag] for lag in lags], color="tab:blue", width=0.8)
    ax.axvline(max_staleness + 0.5, color="tab:red", linestyle="--", label=f"max_staleness = {max_staleness}")
    ax.set(title="Staleness of consumed trajectories", xlabel="staleness (optimiser steps)",
           ylabel="trajectories", xticks=list(range(0, max(lags + [max_staleness]) + 1)))
    ax.legend(loc="best", fontsize="small")
    return _save(fig, path)


def plot_buffer_depth(points: Sequence[DepthPoint], window: RunWindow, step_starts: Sequence[float],
                      groups_per_step: int, path: Path) -> Path:
    """Groups waiting in the buffer over time, with the step starts and one step's worth of groups."""
    fig = _figure()
    ax = fig.add_subplot()
    ax.step([window.offset(p.at) for p in points], [p.groups for p in points], where="post", color="tab:blue",
            label="completed, not yet consumed")
    ax.axhline(groups_per_step, color="tab:green", linestyle="--", linewidth=1, label="one step's groups")
    for i, t in enumerate(step_starts):
        ax.axvline(t, color="tab:gray", alpha=0.3, linewidth=0.8, label="train step starts" if i == 0 else None)
    ax.set(title="Buffer depth", xlabel="time since run start (s)", ylabel="groups")
    ax.legend(loc="upper left", fontsize="small")
    return _save(fig, path)


def plot_idle(usage: dict[str, BoxUsage], path: Path) -> Path:
    """Busy and idle share of the run's wall time per box."""
    boxes = pipeline_order(list(usage))
    busy = [usage[b].busy_fraction for b in boxes]
    fig = _figure(7, 4)
    ax = fig.add_subplot()
    ax.barh(boxes, busy, color=[BOX_COLOURS.get(b, "tab:blue") for b in boxes])
    ax.barh(boxes, [1 - b for b in busy], left=busy, color="lightgray")
    for i, b in enumerate(busy):
        ax.text(1.01, i, f"busy {b:.0%}\nidle {1 - b:.0%}", va="center", fontsize="small")
    ax.invert_yaxis()
    ax.set(title="Busy (colour) / idle (grey) share of wall time per box", xlabel="fraction of the run's wall time",
           xlim=(0, 1.18))
    return _save(fig, path)


def plot_sync(syncs: Sequence[SyncRow], share: float, path: Path) -> Path:
    """Seconds of each sync by phase (one bar per server and version)."""
    fig = _figure()
    ax = fig.add_subplot()
    labels = [f"v{s.version}/{s.server}" for s in syncs]
    bottom = [0.0] * len(syncs)
    for phase, colour in PHASE_COLOURS.items():
        values = [getattr(s, phase) or 0.0 for s in syncs]
        ax.bar(labels, values, bottom=bottom, color=colour, label=phase.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    failed = [i for i, s in enumerate(syncs) if s.status != "ok"]
    if failed:
        ax.scatter(failed, [bottom[i] for i in failed], marker="x", color="black", zorder=3, label="not ok")
    ax.set(title=f"Weight syncs: {share:.1%} of wall time", xlabel="version / server", ylabel="seconds")
    ax.tick_params(axis="x", labelrotation=90, labelsize="x-small")
    ax.legend(loc="best", fontsize="small")
    return _save(fig, path)


def plot_eval(evals: Sequence[EvalRow], path: Path) -> Path:
    """Held-out accuracy per published version, one line per split."""
    fig = _figure()
    ax = fig.add_subplot()
    for split in sorted({e.split for e in evals}):
        rows = [e for e in evals if e.split == split]
        ax.plot([e.version for e in rows], [e.accuracy for e in rows], marker="o", label=split)
    ax.set(title="Eval accuracy per policy version", xlabel="policy version", ylabel="accuracy", ylim=(0, 1))
    ax.legend(loc="best", fontsize="small")
    return _save(fig, path)


def plot_timeline(segments: Sequence[Segment], window: RunWindow, path: Path) -> Path:
    """Gantt-like view: when each box was busy (overlapping activities merged)."""
    boxes = pipeline_order(list({s.box for s in segments}))
    fig = _figure(10, 0.6 * len(boxes) + 1.5)
    ax = fig.add_subplot()
    for row, box in enumerate(boxes):
        bars = [(window.offset(s.start), max(s.seconds, 1e-3)) for s in segments if s.box == box]
        ax.broken_barh(bars, (row - 0.4, 0.8), color=BOX_COLOURS.get(box, "tab:blue"))
    ax.set(title="Timeline: when each box was busy", xlabel="time since run start (s)", yticks=range(len(boxes)),
           yticklabels=boxes, xlim=(0, max(window.wall_s, 1e-3)))
    ax.invert_yaxis()
    return _save(fig, path)
