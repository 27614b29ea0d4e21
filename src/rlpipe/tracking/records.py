"""What a tracker receives, built from committed rows: pure functions, no database, no tracker.

Every point carries the train step it belongs to: a step's own metrics at that step; an evaluation
or a weight sync of version v at the step that published v (v0: step 0), so held-out accuracy and
sync cost line up with the training curves in every tracker.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

REWARD_QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
STEP_COLUMNS = ("loss", "reward_mean", "reward_std", "response_length_mean", "entropy", "kl_sampler", "grad_norm",
                "staleness_mean", "staleness_max", "n_groups", "n_trajectories", "n_tokens")
SYNC_TIMINGS = ("download_s", "pause_s", "reload_s", "verify_s", "total_s")


@dataclass(frozen=True)
class Scalar:
    tag: str
    step: int
    value: float
    wall_time: float
    """Seconds since the epoch of the record it comes from (not of the write: a replayed write is the same)."""


@dataclass(frozen=True)
class Histogram:
    tag: str
    step: int
    values: tuple[float, ...]
    wall_time: float


@dataclass(frozen=True)
class Batch:
    """One write to one tracker: train steps first_step..last_step (none when first > last) and
    the other records named by `keys`."""

    number: int
    first_step: int
    last_step: int
    keys: tuple[str, ...]
    scalars: list[Scalar] = field(default_factory=list)
    histograms: list[Histogram] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)
    """The run config, flattened ('rollout.group_size' -> '8'), when the batch logs it."""

    def tags(self) -> set[str]:
        return {p.tag for p in self.scalars}


@dataclass(frozen=True)
class StepRecord:
    """A committed train step with what its batch held."""

    step: int
    columns: Mapping[str, float | int | None]
    """train_steps' metric columns (STEP_COLUMNS)."""
    metrics: Mapping[str, Any]
    """train_steps.metrics: clip fractions, advantage and ratio statistics, phase timings (*_s)..."""
    rewards: Sequence[float]
    """Rewards of the trajectories the step trained on."""
    staleness: Mapping[int, int]
    """Trajectories of the step by staleness (optimiser steps)."""
    grader_share: float | None
    """Grader busy seconds / all boxes' busy seconds, over activities finished by the step's end."""
    started_at: datetime
    finished_at: datetime


@dataclass(frozen=True)
class SyncRecord:
    version: int
    step: int
    """The train step that published the version."""
    server: str
    status: str
    timings: Mapping[str, float | None]
    probe_max_abs_diff: float | None
    finished_at: datetime


@dataclass(frozen=True)
class EvalRecord:
    version: int
    step: int
    split: str
    accuracy: float
    mean_reward: float | None
    n_prompts: int
    created_at: datetime


def sync_key(version: int, server: str) -> str:
    return f"sync:{version}:{server}"


def eval_key(version: int, split: str) -> str:
    return f"eval:{version}:{split}"


CONFIG_KEY = "config"


def step_points(r: StepRecord) -> tuple[list[Scalar], list[Histogram]]:
    """Scalars and histograms of one train step: train/* (the row and its numeric metrics, the
    reward quantiles, tokens/s), phase/* (the step's timings), staleness/* and box/grader_share."""
    t = r.finished_at.timestamp()
    scalars = [Scalar(f"train/{k}", r.step, float(v), t) for k, v in r.columns.items() if v is not None]
    for key, value in sorted(r.metrics.items()):
        # the row's columns repeat some metrics (loss, reward_mean...): one point per tag, the column's
        if isinstance(value, int | float) and not isinstance(value, bool) and key not in r.columns:
            group = "phase" if key.endswith("_s") else "train"
            scalars.append(Scalar(f"{group}/{key}", r.step, float(value), t))
    duration = (r.finished_at - r.started_at).total_seconds()
    if duration > 0 and r.columns.get("n_tokens") is not None:
        scalars.append(Scalar("train/tokens_per_s", r.step, float(r.columns["n_tokens"] or 0) / duration, t))
        scalars.append(Scalar("phase/step_s", r.step, duration, t))
    for q, value in zip(REWARD_QUANTILES, quantiles(r.rewards, REWARD_QUANTILES)):
        scalars.append(Scalar(f"reward/p{round(q * 100)}", r.step, value, t))
    total = sum(r.staleness.values())
    for lag, n in sorted(r.staleness.items()):
        scalars.append(Scalar(f"staleness/share_{lag}", r.step, n / total, t))
    if r.grader_share is not None:
        scalars.append(Scalar("box/grader_share", r.step, r.grader_share, t))
    histograms = [Histogram("reward/distribution", r.step, tuple(r.rewards), t)] if r.rewards else []
    if r.staleness:
        lags = tuple(float(lag) for lag, n in sorted(r.staleness.items()) for _ in range(n))
        histograms.append(Histogram("staleness/distribution", r.step, lags, t))
    return scalars, histograms


def sync_points(r: SyncRecord) -> list[Scalar]:
    """sync/<server>/*: the load's timings, whether it was verified (1) or not (0), the probe difference."""
    t, prefix = r.finished_at.timestamp(), f"sync/{r.server}"
    scalars = [Scalar(f"{prefix}/{k}", r.step, float(v), t) for k, v in r.timings.items() if v is not None]
    scalars.append(Scalar(f"{prefix}/verified", r.step, 1.0 if r.status == "ok" else 0.0, t))
    scalars.append(Scalar(f"{prefix}/version", r.step, float(r.version), t))
    if r.probe_max_abs_diff is not None:
        scalars.append(Scalar(f"{prefix}/probe_max_abs_diff", r.step, r.probe_max_abs_diff, t))
    return scalars


def eval_points(r: EvalRecord) -> list[Scalar]:
    """heldout/<split>/*: held-out accuracy (and mean reward) of the version the step published."""
    t, prefix = r.created_at.timestamp(), f"heldout/{r.split}"
    scalars = [Scalar(f"{prefix}/accuracy", r.step, r.accuracy, t),
               Scalar(f"{prefix}/version", r.step, float(r.version), t)]
    if r.mean_reward is not None:
        scalars.append(Scalar(f"{prefix}/mean_reward", r.step, r.mean_reward, t))
    return scalars


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The run config as hyper-parameters: nested tables become dotted names, lists JSON."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            params.update(flat_params(value, f"{name}."))
        else:
            params[name] = value if isinstance(value, str) else json.dumps(value)
    return params


def quantiles(values: Iterable[float], qs: Sequence[float]) -> list[float]:
    """Linear-interpolation quantiles (Postgres' percentile_cont, numpy's default); [] for no values."""
    ordered = sorted(values)
    if not ordered:
        return []
    out = []
    for q in qs:
        position = q * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        out.append(ordered[low] + (ordered[high] - ordered[low]) * (position - low))
    return out
