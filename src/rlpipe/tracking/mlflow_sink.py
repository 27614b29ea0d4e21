"""MLflow: the rlpipe run is one MLflow run (tag `rlpipe.run`), its config the run's params.

MLflow appends every metric value it is sent, so a replayed batch first reads back which
(metric, step) points the earlier try left and sends only the others. Params are write-once in
MLflow and the config never changes, so sending them again is harmless.
"""

from __future__ import annotations

import os

from rlpipe.schemas.tracking import MlflowConfig
from rlpipe.tracking.records import Batch

RUN_TAG = "rlpipe.run"
MAX_METRICS_PER_CALL, MAX_PARAMS_PER_CALL = 1000, 100  # MLflow's log_batch limits
PARAM_VALUE_LIMIT = 6000  # MLflow's limit on a param's value
# An unreachable tracking server must fail fast: MLflow's defaults retry a refused connection for
# minutes (7 tries, exponential backoff), which would only hold up the other trackers' passes. The
# sink is retried by its own loop with backoff (follow.py).
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
# MLflow 3 keeps its file store ('file:<dir>': local files, no server, what the docs and tests use) in
# maintenance mode and refuses it unless this is set.
os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")

from mlflow.entities import Metric, Param  # noqa: E402 - after the settings above, which it reads
from mlflow.tracking import MlflowClient  # noqa: E402


class MlflowSink:
    def __init__(self, run_id: str, cfg: MlflowConfig) -> None:
        self.rlpipe_run, self.cfg = run_id, cfg
        self.client = MlflowClient(tracking_uri=cfg.tracking_uri)
        self.mlflow_run: str | None = None  # found or created at the first write: opening never fails

    def _run(self) -> str:
        if self.mlflow_run is None:
            experiment = self.client.get_experiment_by_name(self.cfg.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(self.cfg.experiment))
            found = self.client.search_runs([experiment_id], f"tags.`{RUN_TAG}` = '{self.rlpipe_run}'", max_results=1)
            self.mlflow_run = (found[0].info.run_id if found else
                               self.client.create_run(experiment_id, run_name=self.rlpipe_run,
                                                      tags={RUN_TAG: self.rlpipe_run}).info.run_id)
        return self.mlflow_run

    def write(self, batch: Batch, replay: bool) -> None:
        run = self._run()
        points = batch.scalars
        if replay:
            landed = {(p.key, p.step) for tag in batch.tags() for p in self.client.get_metric_history(run, tag)}
            points = [p for p in points if (p.tag, p.step) not in landed]
        metrics = [Metric(p.tag, p.value, int(p.wall_time * 1000), p.step) for p in points]
        params = [Param(k, v[:PARAM_VALUE_LIMIT]) for k, v in sorted(batch.params.items())]
        for i in range(0, len(params), MAX_PARAMS_PER_CALL):
            self.client.log_batch(run, params=params[i:i + MAX_PARAMS_PER_CALL])
        for i in range(0, len(metrics), MAX_METRICS_PER_CALL):
            self.client.log_batch(run, metrics=metrics[i:i + MAX_METRICS_PER_CALL])

    def close(self) -> None:
        pass
