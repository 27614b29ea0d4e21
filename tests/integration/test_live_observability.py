"""Observability of a real run: every worker's /metrics (and its Temporal SDK metrics) scraped and
parsed after a tiny run on the real stack, and `rlpipe report` on that run."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from temporalio.client import Client

from rlpipe.infra.stack import Stack
from rlpipe.observe.report import write_report
from rlpipe.storage.db import Database
from tests.integration.runs import run_to_end, tiny_config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WORKERS = ("rollout", "sandbox", "grader", "trainer", "sidecar-0")
RECORDED = {
    # metric family -> worker whose samples must be non-zero after a run
    "rlpipe_trajectories": "rollout",
    "rlpipe_generated_tokens": "rollout",
    "rlpipe_grade_latency_seconds": "grader",
    "rlpipe_train_steps": "trainer",
    "rlpipe_trained_tokens": "trainer",
    "rlpipe_staleness_steps": "trainer",
    "rlpipe_syncs": "sidecar-0",
    "rlpipe_sync_duration_seconds": "sidecar-0",
    "rlpipe_box_busy_seconds": "rollout",
}
EVERYWHERE = ("rlpipe_box_busy_fraction", "rlpipe_buffer_groups", "rlpipe_grader_time_share",
              "rlpipe_sync_wall_share", "rlpipe_sync_paused_share", "rlpipe_server_version_lag", "rlpipe_failures")


def scrape(url: str) -> dict[str, float]:
    """family name -> sum of its samples' values (a histogram's _count and _sum included)."""
    text = httpx.get(url, timeout=10).text
    return {family.name: sum(sample.value for sample in family.samples)
            for family in text_string_to_metric_families(text)}


@pytest.fixture(scope="module")
async def finished_run(temporal_client: Client, pipeline_workers, migrated_db: Database,  # type: ignore[no-untyped-def]
                       tiny_model: Path) -> str:
    cfg = tiny_config(tiny_model, steps=2)
    await run_to_end(temporal_client, cfg)
    return cfg.name


@pytest.mark.vllm
async def test_every_worker_serves_its_metrics_and_the_sdks(stack: Stack, finished_run: str) -> None:
    scraped = {}
    for worker in WORKERS:
        port, sdk_port = (stack.settings.home / "workers" / f"{worker}.metrics").read_text().split()
        scraped[worker] = scrape(f"http://{stack.settings.host}:{port}/metrics")
        for family in EVERYWHERE:
            assert family in scraped[worker], f"{worker} does not expose {family}"
        sdk = scrape(f"http://{stack.settings.host}:{sdk_port}/metrics")
        assert any(name.startswith("temporal_") for name in sdk), f"{worker}: no Temporal SDK metrics"
    for family, worker in RECORDED.items():
        assert scraped[worker].get(family, 0) > 0, f"{worker} recorded nothing in {family} during the run"


@pytest.mark.vllm
def test_report_of_a_real_run_has_every_plot(migrated_db: Database, finished_run: str, tmp_path: Path) -> None:
    with migrated_db.begin() as s:
        report = write_report(s, finished_run, tmp_path)
    plots = sorted(tmp_path.glob("*.png"))
    assert {p.name for p in plots} >= {"reward.png", "response_length.png", "staleness.png", "sync.png",
                                      "eval_accuracy.png", "timeline.png", "idle.png"}
    for png in plots:
        data = png.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 5_000, png.name
    assert finished_run in report.read_text()
