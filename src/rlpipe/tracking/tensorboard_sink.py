"""TensorBoard: one event file per batch, named by the batch number.

A batch's file is written whole under a temporary name and renamed into place, so a replayed batch
replaces its own file (never adds a second copy of its points), and TensorBoard, which reads the
event files of a directory in name order, sees the batches in order. Files say `brain.Event:2`, so
TensorBoard keeps points logged out of step order (an evaluation of an older version) instead of
purging newer ones.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.plugins.text.metadata import create_summary_metadata
from tensorboard.summary.writer.record_writer import RecordWriter

from rlpipe.tracking.records import Batch, Histogram

HISTOGRAM_BINS = 10


def event_file(log_dir: Path, number: int) -> Path:
    """'tfevents' in the name is what TensorBoard looks for; the zero-padded number sorts the batches."""
    return log_dir / f"events.out.tfevents.{number:010d}.rlpipe"


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir

    def write(self, batch: Batch, replay: bool) -> None:
        # replay or not, the same file is written whole: a replay replaces what the first try left
        self.log_dir.mkdir(parents=True, exist_ok=True)
        target = event_file(self.log_dir, batch.number)
        partial = target.with_name(f".{target.name}.partial")  # no 'tfevents' prefix match: TensorBoard skips it
        first_time = min((p.wall_time for p in batch.scalars), default=0.0)
        with open(partial, "wb") as f:
            records = RecordWriter(f)
            records.write(Event(wall_time=first_time, file_version="brain.Event:2").SerializeToString())
            for p in batch.scalars:
                value = Summary.Value(tag=p.tag, simple_value=p.value)
                records.write(Event(wall_time=p.wall_time, step=p.step, summary=Summary(value=[value]))
                              .SerializeToString())
            for h in batch.histograms:
                value = Summary.Value(tag=h.tag, histo=_histogram(h))
                records.write(Event(wall_time=h.wall_time, step=h.step, summary=Summary(value=[value]))
                              .SerializeToString())
            if batch.params:
                text = "\n".join(f"    {k} = {v}" for k, v in sorted(batch.params.items()))  # markdown code block
                tensor = TensorProto(dtype=7, string_val=[text.encode()], tensor_shape={"dim": []})  # 7: DT_STRING
                value = Summary.Value(tag="config", tensor=tensor,
                                      metadata=create_summary_metadata(display_name="run config", description=""))
                records.write(Event(wall_time=first_time, step=0, summary=Summary(value=[value])).SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, target)

    def close(self) -> None:
        pass


def _histogram(h: Histogram) -> HistogramProto:
    values = np.asarray(h.values, dtype=np.float64)
    low, high = float(values.min()), float(values.max())
    counts, edges = np.histogram(values, bins=HISTOGRAM_BINS, range=(low, high if high > low else low + 1.0))
    return HistogramProto(min=low, max=high, num=float(values.size), sum=float(values.sum()),
                          sum_squares=float((values ** 2).sum()), bucket_limit=[float(e) for e in edges[1:]],
                          bucket=[float(c) for c in counts])

