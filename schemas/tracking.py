"""Experiment-tracker settings of a run: which trackers receive its metrics and where they are.

The trackers are sinks of what Postgres committed (src/rlpipe/tracking/): enabling one never changes
how the run trains, and a tracker that is down only delays what it shows (docs/tracking.md).
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, field_validator

TrackerName = Literal["tensorboard", "mlflow", "wandb"]
MLFLOW_SCHEMES = ("file", "http", "https")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class TensorBoardConfig(_Strict):
    log_dir: str = ".rlpipe/tensorboard"
    """Directory of the event files; each run writes to `<log_dir>/<run name>`, so
    `tensorboard --logdir <log_dir>` compares runs. Relative paths resolve against the worker's
    working directory (the repository for `rlpipe workers up`)."""


class MlflowConfig(_Strict):
    tracking_uri: str = "file:.rlpipe/mlruns"
    """Where MLflow stores runs: a local file store (`file:<dir>`) or a tracking server (`http(s)://host:port`)."""
    experiment: str = Field("rlpipe", min_length=1)
    """MLflow experiment the run is logged under (created if missing); the MLflow run is named after the rlpipe run."""

    @field_validator("tracking_uri")
    @classmethod
    def _known_scheme(cls, uri: str) -> str:
        scheme = urlparse(uri).scheme
        if scheme not in MLFLOW_SCHEMES:
            raise ValueError(f"tracking_uri {uri!r} has scheme {scheme or '(none)'!r}; use one of "
                             f"{', '.join(s + ':' for s in MLFLOW_SCHEMES)} (e.g. 'file:.rlpipe/mlruns')")
        if scheme in ("http", "https") and not urlparse(uri).netloc:
            raise ValueError(f"tracking_uri {uri!r} names no host: write it as {scheme}://HOST:PORT")
        return uri


class WandbConfig(_Strict):
    project: str = Field("rlpipe", min_length=1)
    """W&B project of the run; the W&B run is named after the rlpipe run (its id is derived from the name)."""
    entity: str | None = None
    """W&B team or user; None: the API key's default entity (online) or none (offline)."""
    mode: Literal["offline", "online"] = "offline"
    """`offline`: local run files only, no account (upload later with `wandb sync`); `online`: streamed to
    W&B as well, with the API key from the workers' environment (`WANDB_API_KEY`), never from the config."""
    dir: str = ".rlpipe/wandb"
    """Directory W&B writes its run files under (`<dir>/wandb/<mode>-run-<time>-<id>/`); relative paths
    resolve against the worker's working directory."""


class TrackersConfig(_Strict):
    """Per-tracker settings; only the trackers named in `tracking` are used."""

    tensorboard: TensorBoardConfig = TensorBoardConfig()
    mlflow: MlflowConfig = MlflowConfig()
    wandb: WandbConfig = WandbConfig()


def check_tracking(names: list[TrackerName]) -> list[TrackerName]:
    """The `tracking` list, each tracker at most once."""
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"tracker(s) {', '.join(repeated)} named more than once")
    return names
