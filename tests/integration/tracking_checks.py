"""Reading back what the experiment trackers received, with each tracker's own reader, and looking
at TensorBoard in a headless Chromium (issue #23)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
from matplotlib.image import imread

from rlpipe.infra.process import free_port

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000",
                  "--virtual-time-budget=30000")
DOM_ATTEMPTS = 5  # a loaded 2-core CI machine has run out of virtual time three times in a row


def tensorboard_steps(log_dir: Path) -> dict[str, list[int]]:
    """Scalar tag -> the steps it was logged at, in file order (a step twice means logged twice)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def mlflow_steps(tracking_uri: str, experiment: str, run_name: str) -> dict[str, list[int]]:
    """Metric -> the steps of its history in the MLflow run of `run_name`."""
    from mlflow.tracking import MlflowClient

    import rlpipe.tracking.mlflow_sink  # noqa: F401 - MLflow's settings for the file store, as the sink has them

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id],
                               f"tags.`rlpipe.run` = '{run_name}'")
    assert len(found) == 1, f"one MLflow run per rlpipe run, found {len(found)}"
    run = found[0]
    return {key: sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) for key in run.data.metrics}


def wandb_steps(root: Path, run_name: str) -> dict[str, list[int]]:
    """Key -> the `rlpipe/step`s it was logged at, over every transaction log of the W&B run of
    `run_name` under `root`, in the order W&B wrote them (a step twice means logged twice)."""
    from rlpipe.tracking import wandb_files
    from rlpipe.tracking.wandb_sink import STEP_KEY, wandb_run_id

    logged: dict[str, list[int]] = {}
    for log in wandb_files.run_logs(root, wandb_run_id(run_name)):
        for row in wandb_files.history(log):
            for key in row.keys() - {STEP_KEY} if STEP_KEY in row else ():
                if not key.startswith("_"):
                    logged.setdefault(key, []).append(int(row[STEP_KEY]))  # type: ignore[call-overload]
    return logged


@contextmanager
def tensorboard_server(log_dir: Path, tags: list[str]) -> Iterator[str]:
    """TensorBoard serving `log_dir` on a free loopback port, once it has loaded `tags` (it reads the
    event files in the background after it starts); stopped on exit."""
    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(log_dir), "--host",
                             "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _has_loaded(url, tags):
            assert proc.poll() is None and time.monotonic() < deadline, "TensorBoard did not serve the tags"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _has_loaded(url: str, tags: list[str]) -> bool:
    try:
        response = httpx.get(f"{url}/data/plugin/scalars/tags", timeout=5)
    except httpx.TransportError:
        return False
    loaded = {tag for run_tags in (response.json() if response.status_code == 200 else {}).values()
              for tag in run_tags}
    return set(tags) <= loaded


def _has_card(dom: str, tag: str) -> bool:
    """A card's title element carries its whole tag (its text is split into spans)."""
    return re.search(f'class="tag"[^>]*title="{re.escape(tag)}"', dom) is not None


def chromium(page: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("chromium")
    assert binary is not None, "Debian's chromium is not installed (make test installs it)"
    return subprocess.run([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, page],
                          capture_output=True, text=True, timeout=180, check=True)


def assert_tensorboard_shows(log_dir: Path, tags: list[str], tmp: Path) -> None:
    """TensorBoard's Time Series page, filtered to `tags`, names each of them as a chart card and
    renders as a picture with content (not a blank page)."""
    with tensorboard_server(log_dir, tags) as url:
        page = f"{url}/?tagFilter={'%7C'.join(tags)}#timeseries"
        # the page builds its cards from several requests; on a loaded machine the virtual-time budget can
        # run out first, so the page is loaded again (a fresh profile each time) before the verdict
        for attempt in range(DOM_ATTEMPTS):
            dom = chromium(page, tmp / f"chromium-dom-{attempt}", "--dump-dom").stdout
            missing = [tag for tag in tags if not _has_card(dom, tag)]
            if not missing:
                break
        (tmp / "tensorboard-dom.html").write_text(dom)
        assert not missing, f"no chart card for {missing} in TensorBoard's page ({tmp / 'tensorboard-dom.html'})"
        chromium(page, tmp / "chromium-shot", f"--screenshot={tmp / 'tensorboard.png'}")
    pixels = imread(tmp / "tensorboard.png")[..., :3]            # (H, W, 3) floats in [0, 1]
    colours = np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 50, "the screenshot is (nearly) blank"
