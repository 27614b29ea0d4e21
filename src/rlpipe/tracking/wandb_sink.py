"""Weights & Biases: the rlpipe run is one W&B run (its id derived from the run's name), the run
config its config.

W&B appends every row it is sent, and sends in the background. So a write waits until the batch's
points are in the run's transaction log on disk (`run-<id>.wandb`, flushed every second here): a
batch the cursor calls written is one W&B holds even if the worker dies next. A replayed batch
first reads back the run's transaction logs (one per time the run was opened) and sends only the
(key, step) points that are not there. Offline (the default) those logs are what `wandb sync`
uploads later; online, W&B streams them as well.

Every chart's x-axis is `rlpipe/step` (W&B's `define_metric`), not W&B's own row counter `_step`:
an evaluation of an older version lands at an earlier step than rows logged before it.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from rlpipe.schemas.tracking import WandbConfig
from rlpipe.tracking import wandb_files
from rlpipe.tracking.records import Batch

STEP_KEY = "rlpipe/step"
FLUSH_INTERVAL_S = 1.0
DURABLE_TIMEOUT_S = 60.0
"""How long a write waits for W&B to have its points on disk before it counts as failed (and is replayed)."""
HISTOGRAM_BINS = 10
MAX_ID_LENGTH = 64
_open_runs: dict[str, list[Any]] = {}
"""W&B run id -> [its run, sinks using it]: W&B refuses to open a run twice in one process, and a
process may hold two sinks of one run (a pass that failed and the one that replays its batch)."""


def wandb_run_id(run_name: str) -> str:
    """A W&B run id for an rlpipe run: the name itself where W&B allows it (letters, digits, `_.-`,
    at most 64), else a readable prefix and a hash of the name, so two names never share an id."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "-", run_name)
    if safe == run_name and len(safe) <= MAX_ID_LENGTH:
        return safe
    return f"{safe[:MAX_ID_LENGTH - 9]}-{hashlib.sha1(run_name.encode()).hexdigest()[:8]}"


class WandbSink:
    def __init__(self, run_id: str, cfg: WandbConfig) -> None:
        self.rlpipe_run, self.cfg = run_id, cfg
        self.root = Path(cfg.dir)
        self.wandb_id = wandb_run_id(run_id)
        self.run: Any = None  # wandb.Run, opened at the first write: opening never fails

    def _open(self) -> Any:
        if self.run is None:
            if self.wandb_id not in _open_runs:
                _open_runs[self.wandb_id] = [self._init(), 0]
            _open_runs[self.wandb_id][1] += 1
            self.run = _open_runs[self.wandb_id][0]
        return self.run

    def _init(self) -> Any:
        import wandb

        self.root.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(mode=self.cfg.mode, console="off", silent=True, x_disable_stats=True,
                                  x_disable_meta=True, disable_git=True, save_code=False, disable_job_creation=True,
                                  x_transaction_log_flush_interval=FLUSH_INTERVAL_S)
        run = wandb.init(project=self.cfg.project, entity=self.cfg.entity, id=self.wandb_id, name=self.rlpipe_run,
                         dir=str(self.root), resume="allow", reinit="create_new", settings=settings)
        run.define_metric(STEP_KEY)
        run.define_metric("*", step_metric=STEP_KEY)
        return run

    def landed(self) -> set[tuple[str, int]]:
        """(key, step) of every point in the run's transaction logs, from every time it was opened."""
        return {(key, int(row[STEP_KEY]))  # type: ignore[call-overload]
                for log in wandb_files.run_logs(self.root, self.wandb_id)
                for row in wandb_files.history(log) if STEP_KEY in row
                for key in row if key != STEP_KEY and not key.startswith("_")}

    def write(self, batch: Batch, replay: bool) -> None:
        import wandb

        skip = self.landed() if replay else set()
        run = self._open()
        rows: dict[int, dict[str, object]] = defaultdict(dict)
        for p in batch.scalars:
            if (p.tag, p.step) not in skip:
                rows[p.step][p.tag] = p.value
        for h in batch.histograms:
            if (h.tag, h.step) not in skip:
                rows[h.step][h.tag] = wandb.Histogram(list(h.values), num_bins=HISTOGRAM_BINS)
        if batch.params:  # the same values every time: an update is harmless on a replay
            run.config.update(batch.params, allow_val_change=True)
        for step in sorted(rows):
            run.log({**rows[step], STEP_KEY: step})
        self._wait_on_disk({(key, step) for step, row in rows.items() for key in row})

    def _wait_on_disk(self, points: set[tuple[str, int]]) -> None:
        deadline = time.monotonic() + DURABLE_TIMEOUT_S
        while not points <= self.landed():
            if time.monotonic() > deadline:
                missing = sorted(points - self.landed())
                raise TimeoutError(f"W&B did not write {len(missing)} point(s) of run {self.wandb_id} to "
                                   f"{self.root / 'wandb'} within {DURABLE_TIMEOUT_S:.0f} s (first: {missing[0]})")
            time.sleep(FLUSH_INTERVAL_S / 4)

    def close(self) -> None:
        if self.run is not None:
            self.run = None
            _open_runs[self.wandb_id][1] -= 1
            if _open_runs[self.wandb_id][1] == 0:
                _open_runs.pop(self.wandb_id)[0].finish()
