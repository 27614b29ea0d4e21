"""Two inference servers, each with its sync sidecar, under one training run on the real stack.

The module adds a second stack inference service next to the session's, and runs its own
WorkerSet started after it (workers learn the servers from the saved stack settings when they
start); whatever workers ran on the stack before are stopped first and brought back after.

One run covers the acceptance points, since a run costs a minute on two cores: both servers
reach each published version, reading the trainer's checkpoints in place (a shared
filesystem: no S3 download); server 1 is SIGKILLed mid-run and restarted, and comes back on
the latest published version before it samples again; versions only move forward on each
server; no rollout records a version that was never published; and the run's schedule
(sync interval / max staleness) is changed through the CLI while it runs.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from temporalio.client import Client

from rlpipe.cli.run_commands import pause, resume, run_status, start_run
from rlpipe.infra.inference import InferenceService
from rlpipe.infra.process import kill
from rlpipe.infra.settings import save_settings
from rlpipe.infra.stack import Stack
from rlpipe.storage.db import Database
from rlpipe.workers.launcher import WorkerSet
from rlpipe.workers.sidecar import SHARED_CHECKPOINTS_ENV
from tests.integration.runs import RUN_TIMEOUT_S, rows, tiny_config
from tests.waiting import run_result

pytestmark = [pytest.mark.stack, pytest.mark.vllm, pytest.mark.usefixtures("clean_workflows")]

SERVERS = ("0", "1")
LABEL_SLACK = timedelta(seconds=1)
"""A sync's verdict row is written just before the server's label becomes the version."""


@dataclass
class TwoServers:
    stack: Stack
    second: InferenceService
    workers: WorkerSet


@pytest.fixture(scope="module")
def two_servers(stack: Stack, inference_servers: list[str]) -> Iterator[TwoServers]:
    settings = stack.settings
    earlier = WorkerSet(settings)
    had_workers = any(record is not None for record in earlier.status().values())
    earlier.down(progress=lambda msg: None)
    settings.inference_servers = len(SERVERS)
    save_settings(settings)
    second = InferenceService(settings, index=1)
    stack.start(second, progress=lambda msg: None)
    # the trainer's checkpoints are on this machine's disk: the sidecars read them in place
    workers = WorkerSet(settings, env={SHARED_CHECKPOINTS_ENV: str(settings.home.resolve() / "trainer")})
    try:
        workers.up(progress=lambda msg: None)
        yield TwoServers(stack, second, workers)
    finally:
        workers.down(progress=lambda msg: None)
        stack.stop_service(second, progress=lambda msg: None)
        settings.inference_servers = 1
        save_settings(settings)
        if had_workers:
            WorkerSet(settings).up(progress=lambda msg: None)


def synced(db: Database, run: str, server: str) -> set[int]:
    return {r.version for r in rows(db, "select version from sync_events where run_id = :r and server = :s "
                                        "and status = 'ok'", r=run, s=server)}


async def until(condition, what: str, timeout_s: float = RUN_TIMEOUT_S) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.2)


def rlpipe(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The `rlpipe` CLI against the test stack."""
    return subprocess.run([sys.executable, "-m", "rlpipe.cli.main", *args], capture_output=True, text=True,
                          env={**os.environ, "RLPIPE_HOME": str(home), "COLUMNS": "400"}, timeout=120)


async def test_two_servers_follow_every_version_and_a_killed_one_comes_back_on_the_latest(
        two_servers: TwoServers, temporal_client: Client, migrated_db: Database, tiny_model: Path) -> None:
    cfg = tiny_config(tiny_model, steps=8, rollout={"generate_attempts": 30}, sync={"pause_mode": "wait"})
    handle = await start_run(temporal_client, cfg)
    await until(lambda: all(1 in synced(migrated_db, cfg.name, s) for s in SERVERS), "both servers verify v1")

    # SIGKILL server 1's process group; the run goes on with server 0 and publishes a version
    held = max(synced(migrated_db, cfg.name, "1"))
    killed_at = _db_now(migrated_db)
    assert kill(two_servers.stack.table.get(two_servers.second.name))
    await until(lambda: held + 1 in synced(migrated_db, cfg.name, "0"), "server 0 verifies a version server 1 missed")
    await pause(temporal_client, cfg.name, "restarting server 1")  # so the run cannot finish meanwhile

    # the trade-off can be changed on a running run; an invalid change is refused, naming the rule
    home = two_servers.stack.settings.home.resolve()
    refused = rlpipe(home, "run", "schedule", cfg.name, "--sync-interval", "5")
    assert refused.returncode != 0
    assert "sync_interval (5) > max_staleness + 1 (2)" in refused.stdout + refused.stderr
    accepted = rlpipe(home, "run", "schedule", cfg.name, "--max-staleness", "2")
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert "max staleness 2" in accepted.stdout

    await asyncio.to_thread(two_servers.stack.start, two_servers.second, lambda msg: None)
    restarted_at = _db_now(migrated_db)
    await until(lambda: _events_since(migrated_db, cfg.name, "1", restarted_at), "server 1 is synced again")
    await resume(temporal_client, cfg.name)
    result = await run_result(handle, RUN_TIMEOUT_S)
    assert result.steps == cfg.steps
    assert (await run_status(temporal_client, cfg.name)).max_staleness == 2

    published = {r.version: r.created_at for r in rows(
        migrated_db, "select version, created_at from policy_versions where run_id = :r", r=cfg.name)}
    events = rows(migrated_db, "select server, version, status, bytes, started_at, finished_at from sync_events "
                               "where run_id = :r order by started_at", r=cfg.name)
    assert all(e.bytes == 0 for e in events if e.status == "ok"), "shared filesystem: no S3 download"
    [restore, *_] = _events_since(migrated_db, cfg.name, "1", restarted_at)
    assert restore.status == "ok"
    assert restore.version == max(v for v, at in published.items() if at <= restore.started_at) > held, \
        "the restarted server was brought to the latest published version"

    # both servers verified each version, except those server 1 missed while it was down
    assert synced(migrated_db, cfg.name, "0") == set(published)
    missed = {v for v, at in published.items() if killed_at < at and v < restore.version}
    assert synced(migrated_db, cfg.name, "1") == set(published) - missed

    # versions only move forward on each server
    for server in SERVERS:
        versions = [e.version for e in events if e.server == server]
        assert versions == sorted(versions), f"server {server} went backwards: {versions}"

    # the restarted server sampled nothing before the restore verified its version
    turns = rows(migrated_db, """
        select tu.server, tu.version_before, tu.version_after, tu.version_spans, tu.created_at,
               tu.created_at - tu.generate_latency_s * interval '1 second' as began
        from turns tu join trajectories t on t.id = tu.trajectory_id where t.run_id = :r""", r=cfg.name)
    after_restart = [t for t in turns if t.server == "1" and t.began > killed_at]
    assert after_restart, "server 1 took rollouts again after its restart"
    assert all(t.created_at > restore.finished_at - LABEL_SLACK for t in after_restart)
    assert all(t.version_before >= restore.version for t in after_restart)

    # no rollout records a version that was never published
    recorded = {v for t in turns for v in (t.version_before, t.version_after)}
    recorded |= {span[0] for t in turns for span in t.version_spans or ()}
    recorded |= {r.v for r in rows(migrated_db, "select policy_version as v from trajectories where run_id = :r "
                                                "and policy_version is not null", r=cfg.name)}
    assert recorded <= set(published)


def _events_since(db: Database, run: str, server: str, since: datetime) -> list:  # type: ignore[type-arg]
    return rows(db, "select version, status, started_at, finished_at from sync_events where run_id = :r and "
                    "server = :s and started_at > :t order by started_at", r=run, s=server, t=since)


def _db_now(db: Database) -> datetime:
    return rows(db, "select now() as now")[0].now
