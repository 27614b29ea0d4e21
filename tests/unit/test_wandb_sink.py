"""The W&B sink with the real `wandb` package in offline mode (local run files, no account, no
server): what a batch writes, what a replay adds (nothing twice), and reading W&B's transaction log,
torn tail included (issue #23). The run on the real stack is in tests/integration/test_trainer_recovery.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from rlpipe.schemas.tracking import WandbConfig
from rlpipe.tracking import wandb_files
from rlpipe.tracking.records import Batch, Histogram, Scalar
from rlpipe.tracking.wandb_sink import STEP_KEY, WandbSink, wandb_run_id

pytest.importorskip("wandb", reason="the `tracking` extra is not installed")


def batch(number: int = 0) -> Batch:
    b = Batch(number, 1, 2, ("config", "eval:0:heldout"), params={"rollout.group_size": "8", "lr": "4e-05"})
    b.scalars.extend([Scalar("train/loss", 1, 0.5, 1.0), Scalar("train/loss", 2, 0.25, 2.0),
                      Scalar("train/reward_mean", 1, 0.1, 1.0), Scalar("train/reward_mean", 2, 0.3, 2.0),
                      Scalar("heldout/heldout/accuracy", 0, 0.16, 3.0)])  # an evaluation of v0: an earlier step
    b.histograms.append(Histogram("reward/distribution", 2, (0.0, 1.0, 1.0, 0.5), 2.0))
    return b


def points(root: Path, run_id: str) -> Counter[tuple[str, int, object]]:
    """(key, step, value) of every point in every transaction log of the run, counted."""
    return Counter((key, int(row[STEP_KEY]), value if not isinstance(value, dict) else value["_type"])  # type: ignore[call-overload]
                   for log in wandb_files.run_logs(root, wandb_run_id(run_id))
                   for row in wandb_files.history(log)
                   for key, value in row.items() if key != STEP_KEY and not key.startswith("_"))


def test_a_batch_and_its_replay_leave_each_point_once(tmp_path: Path) -> None:
    cfg = WandbConfig(dir=str(tmp_path))
    first = WandbSink("w-run", cfg)
    first.write(batch(), replay=False)  # returns once the points are on disk: a crash now loses nothing
    want = Counter({("train/loss", 1, 0.5): 1, ("train/loss", 2, 0.25): 1, ("train/reward_mean", 1, 0.1): 1,
                    ("train/reward_mean", 2, 0.3): 1, ("heldout/heldout/accuracy", 0, 0.16): 1,
                    ("reward/distribution", 2, "histogram"): 1})
    assert points(tmp_path, "w-run") == want
    # the worker goes before the cursor moves; the next one opens the run again and replays the batch
    first.close()
    second = WandbSink("w-run", cfg)
    second.write(batch(), replay=True)
    second.close()
    assert len(wandb_files.run_logs(tmp_path, "w-run")) == 2, "W&B starts a directory per time the run is opened"
    assert points(tmp_path, "w-run") == want


def test_a_torn_tail_ends_the_log_where_the_last_whole_record_ends(tmp_path: Path) -> None:
    sink = WandbSink("torn", WandbConfig(dir=str(tmp_path)))
    sink.write(batch(), replay=False)
    sink.close()
    [log] = wandb_files.run_logs(tmp_path, "torn")
    # one snapshot: wandb-core may still append its closing records after `finish()` returns
    snapshot, torn = tmp_path / "snapshot.wandb", tmp_path / "torn.wandb"
    snapshot.write_bytes(log.read_bytes())
    torn.write_bytes(snapshot.read_bytes()[:-3])  # the writer killed mid-record
    whole = list(wandb_files.records(snapshot))
    assert len(whole) > 1 and list(wandb_files.records(torn)) == whole[:-1]


def test_a_file_that_is_not_a_wandb_log_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "run-x.wandb"
    bad.write_bytes(b"PK\x03\x04 not a log")
    with pytest.raises(ValueError, match="run-x.wandb is not a W&B transaction log"):
        list(wandb_files.records(bad))


@pytest.mark.parametrize(("name", "expected"), [
    ("t-c895102191", "t-c895102191"),
    ("demo/arith:v2", "demo-arith-v2-"),
    ("x" * 70, "x" * 55 + "-"),
])
def test_run_ids_are_what_wandb_accepts_and_never_shared(name: str, expected: str) -> None:
    run_id = wandb_run_id(name)
    assert run_id.startswith(expected) and len(run_id) <= 64 and all(c.isalnum() or c in "_.-" for c in run_id)
    assert wandb_run_id(name.replace("/", ":")) != run_id or "/" not in name
