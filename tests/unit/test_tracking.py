"""Experiment tracking without a stack: its config, the points built from committed rows, the status
lines, and that `import rlpipe` loads no tracker package (issue #23)."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest

import rlpipe.envs.registry
import rlpipe.graders.registry  # noqa: F401 - a config's env and grader names are checked against them
from rlpipe.schemas.config import ConfigError, parse_run_config
from rlpipe.tracking.cursor import CursorState, describe_trackers
from rlpipe.tracking.records import (
    EvalRecord,
    StepRecord,
    SyncRecord,
    eval_points,
    flat_params,
    quantiles,
    step_points,
    sync_points,
)

T0 = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(("data", "says"), [
    ({"tracking": ["tensorboard", "tensorboard"]}, "tracking: tracker(s) tensorboard named more than once"),
    ({"tracking": ["neptune"]}, "tracking.0: Input should be 'tensorboard', 'mlflow' or 'wandb'"),
    ({"trackers": {"wandb": {"mode": "disabled"}}}, "trackers.wandb.mode: Input should be 'offline' or 'online'"),
    ({"trackers": {"mlflow": {"tracking_uri": "mlruns"}}}, "trackers.mlflow.tracking_uri: tracking_uri 'mlruns' has "
                                                           "scheme '(none)'; use one of file:, http:, https:"),
    ({"trackers": {"mlflow": {"tracking_uri": "http:///x"}}}, "names no host: write it as http://HOST:PORT"),
    ({"trackers": {"tensorboard": {"logdir": "x"}}}, "trackers.tensorboard.logdir: unknown field"),
])
def test_bad_tracking_settings_are_named(data: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_run_config(data)
    assert says in str(caught.value)


def test_tracking_settings_validate() -> None:
    cfg = parse_run_config({"tracking": ["mlflow", "tensorboard"],
                            "trackers": {"mlflow": {"tracking_uri": "http://mlflow.internal:5000"}}})
    assert cfg.tracking == ["mlflow", "tensorboard"] and cfg.trackers.tensorboard.log_dir == ".rlpipe/tensorboard"


def test_quantiles_interpolate_like_percentile_cont() -> None:
    assert quantiles([0.0, 1.0, 0.5, 1.0], (0.1, 0.5, 0.9)) == pytest.approx([0.15, 0.75, 1.0])
    assert quantiles([], (0.5,)) == []


def test_config_flattens_to_dotted_params() -> None:
    assert flat_params({"steps": 4, "rollout": {"group_size": 8, "tool_latency": {"kind": "none"}},
                        "tracking": ["tensorboard"], "name": "r"}) == {
        "steps": "4", "rollout.group_size": "8", "rollout.tool_latency.kind": "none", "tracking": '["tensorboard"]',
        "name": "r"}


def test_a_step_becomes_one_point_per_tag() -> None:
    record = StepRecord(step=3, columns={"loss": 0.5, "reward_mean": 0.25, "entropy": None, "n_tokens": 100},
                        metrics={"loss": 0.5, "clip_fraction": 0.1, "engine_s": 2.0, "restored": True},
                        rewards=[0.0, 0.0, 1.0, 0.0], staleness={0: 3, 1: 1}, grader_share=0.2,
                        started_at=T0, finished_at=T0 + timedelta(seconds=4))
    scalars, histograms = step_points(record)
    values = {p.tag: p.value for p in scalars}
    assert len(values) == len(scalars), "a tag twice in one step"
    assert values == pytest.approx({
        "train/loss": 0.5, "train/reward_mean": 0.25, "train/n_tokens": 100, "train/clip_fraction": 0.1,
        "phase/engine_s": 2.0, "phase/step_s": 4.0, "train/tokens_per_s": 25.0, "reward/p10": 0.0,
        "reward/p25": 0.0, "reward/p50": 0.0, "reward/p75": 0.25, "reward/p90": 0.7, "staleness/share_0": 0.75,
        "staleness/share_1": 0.25, "box/grader_share": 0.2})
    assert {p.step for p in scalars} == {3} and {p.wall_time for p in scalars} == {(T0 + timedelta(seconds=4))
                                                                                  .timestamp()}
    assert [(h.tag, h.values) for h in histograms] == [("reward/distribution", (0.0, 0.0, 1.0, 0.0)),
                                                        ("staleness/distribution", (0.0, 0.0, 0.0, 1.0))]


def test_syncs_and_evaluations_land_at_the_step_that_published_the_version() -> None:
    sync = SyncRecord(version=2, step=4, server="0", status="rolled_back",
                      timings={"download_s": 1.0, "total_s": 3.0, "verify_s": None}, probe_max_abs_diff=0.5,
                      finished_at=T0)
    assert {p.tag: (p.step, p.value) for p in sync_points(sync)} == {
        "sync/0/download_s": (4, 1.0), "sync/0/total_s": (4, 3.0), "sync/0/verified": (4, 0.0),
        "sync/0/version": (4, 2.0), "sync/0/probe_max_abs_diff": (4, 0.5)}
    result = EvalRecord(version=2, step=4, split="eval", accuracy=0.5, mean_reward=None, n_prompts=10, created_at=T0)
    assert {p.tag: (p.step, p.value) for p in eval_points(result)} == {
        "heldout/eval/accuracy": (4, 0.5), "heldout/eval/version": (4, 2.0)}


def test_status_warns_of_a_tracker_that_is_not_receiving() -> None:
    lines = describe_trackers([CursorState("mlflow", 2, "ConnectionError: refused", "2026-12-05 12:00:00"),
                               CursorState("tensorboard", 5, None, None), CursorState("x", 3, None, None)], 5)
    assert lines == [
        ("mlflow: NOT RECEIVING since 2026-12-05 12:00:00 UTC, at step 2 of 5 (the run goes on; it catches up "
         "when the tracker answers): ConnectionError: refused", True),
        ("tensorboard: at step 5 of 5", False), ("x: at step 3 of 5 (2 to send)", False)]


def test_importing_rlpipe_and_the_tracking_loop_loads_no_tracker_package() -> None:
    code = ("import sys, rlpipe, rlpipe.schemas.config, rlpipe.tracking.follow; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'tensorboard', 'mlflow', 'wandb'}))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
