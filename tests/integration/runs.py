"""Helpers shared by the tests that run whole training runs on the real stack."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from temporalio.client import Client

from rlpipe.cli.run_commands import start_run
from rlpipe.infra.inference import SERVED_MODEL_NAME
from rlpipe.infra.stack import Stack
from rlpipe.observe import invariants
from rlpipe.schemas.config import RunConfig, load_run_config
from rlpipe.schemas.payloads import RunResult
from rlpipe.storage.db import Database
from rlpipe.weights.tolerance import probe_tolerance
from tests.waiting import run_result

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RUN_TIMEOUT_S = 600
AUDIT_TRAIL = (invariants.RUN_COMPLETED, invariants.CONSUMED_ONCE, invariants.WITHIN_STALENESS,
               invariants.VERSIONS_CONTIGUOUS, invariants.VERSIONS_PUBLISHED)
"""The invariants that hold when a run returns (groups it abandoned may still be running)."""


TEST_EVAL_PROMPTS = 4
"""Held-out prompts per evaluation in test runs: the evaluation runs inside a server's sync loop, and
50 prompts on a slow machine kept a server from loading new versions for most of a short run."""


def tiny_config(tiny_model: Path, config_file: str = "tiny-arithmetic.toml", **overrides: Any) -> RunConfig:
    """A repo config with the test model's path, a unique name, TEST_EVAL_PROMPTS, and top-level
    overrides (tables are merged one level deep)."""
    base = load_run_config(CONFIGS / config_file, {"name": f"t-{uuid.uuid4().hex[:10]}", "steps": 3})
    data = base.model_dump(mode="json", exclude_unset=True)
    data["model"] = {"path": str(tiny_model), "max_model_len": 512}
    data["eval"] = {**data.get("eval", {}), "prompts": TEST_EVAL_PROMPTS}
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return RunConfig.model_validate(data)


def tiny_judge(base_url: str, **changes: Any) -> dict[str, Any]:
    """A judge config served by the session's tiny model, which was never taught to judge: with
    the default structured replies every verdict still parses; in free text it never scores."""
    return {"base_url": base_url, "model": SERVED_MODEL_NAME, "max_tokens": 16} | changes


async def run_to_end(client: Client, cfg: RunConfig) -> RunResult:
    """Start `cfg` and wait for its result: RunStalled, quoting the reason, as soon as it pauses or fails."""
    return await run_result(await start_run(client, cfg), RUN_TIMEOUT_S)


def rows(db: Database, sql: str, **params: object) -> list[sa.Row]:
    with db.begin() as s:
        return list(s.execute(sa.text(sql), params))


def assert_audit_trail(db: Database, cfg: RunConfig) -> None:
    """What every completed run must satisfy, read back from Postgres: the shared invariants
    (observe/invariants.py) that hold as soon as the run returns, then its syncs."""
    with db.begin() as s:
        found = invariants.check_run(s, cfg.name, only=AUDIT_TRAIL)
    assert [inv.name for inv in found if inv.ok] == list(AUDIT_TRAIL), [inv for inv in found if not inv.ok]
    versions = rows(db, "select version from policy_versions where run_id = :r", r=cfg.name)
    syncs = rows(db, "select version, status, probe_max_abs_diff, probe_tolerance, greedy_match from sync_events "
                     "where run_id = :r order by version", r=cfg.name)
    assert {s.version for s in syncs} == {v.version for v in versions}
    tolerance = cfg.sync.verify_tolerance or probe_tolerance("float32")  # the session's servers compute in fp32
    for sync in syncs:  # after each sync the server held exactly the trainer's weights
        assert sync.status == "ok" and sync.greedy_match is True
        assert sync.probe_tolerance == tolerance and sync.probe_max_abs_diff <= tolerance


def cli(stack: Stack, *argv: str) -> subprocess.CompletedProcess[str]:
    """`rlpipe ...` in a subprocess pointed at the session stack, as an operator would run it."""
    env = {**os.environ, "RLPIPE_HOME": str(stack.settings.home), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "rlpipe.cli.main", *argv], env=env, capture_output=True, text=True,
                          timeout=120)
