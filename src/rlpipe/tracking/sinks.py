"""A tracker as a sink of batches, and how each one is opened (their packages load only here, lazily:
`import rlpipe` and a run without trackers never import tensorboard, mlflow or wandb)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from rlpipe.schemas.tracking import TrackerName, TrackersConfig
from rlpipe.tracking.records import Batch


class Sink(Protocol):
    def write(self, batch: Batch, replay: bool) -> None:
        """Write `batch`; with `replay` an earlier write of this same batch may have landed, in part or
        whole, and must not be duplicated. Raises when the tracker did not take it."""

    def close(self) -> None: ...


def open_sink(name: TrackerName, run_id: str, trackers: TrackersConfig) -> Sink:
    if name == "tensorboard":
        from rlpipe.tracking.tensorboard_sink import TensorBoardSink

        return TensorBoardSink(Path(trackers.tensorboard.log_dir) / run_id)
    if name == "mlflow":
        from rlpipe.tracking.mlflow_sink import MlflowSink

        return MlflowSink(run_id, trackers.mlflow)
    from rlpipe.tracking.wandb_sink import WandbSink

    return WandbSink(run_id, trackers.wandb)
