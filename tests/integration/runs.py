"""Helpers shared by the tests that run whole training runs on the real stack."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from schemas.config import RunConfig, load_run_config
from storage.db import Database

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RUN_TIMEOUT_S = 600


def tiny_config(tiny_model: Path, config_file: str = "tiny-arithmetic.toml", **overrides: Any) -> RunConfig:
    """A repo config with the test model's path, a unique name, and top-level overrides (tables
    are merged one level deep)."""
    base = load_run_config(CONFIGS / config_file, {"name": f"t-{uuid.uuid4().hex[:10]}", "steps": 3})
    data = base.model_dump(mode="json", exclude_unset=True)
    data["model"] = {"path": str(tiny_model), "max_model_len": 512}
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return RunConfig.model_validate(data)


def rows(db: Database, sql: str, **params: object) -> list[sa.Row]:
    with db.begin() as s:
        return list(s.execute(sa.text(sql), params))


def assert_audit_trail(db: Database, cfg: RunConfig) -> None:
    """What every completed run must satisfy, read back from Postgres."""
    versions = rows(db, "select version, trained_steps from policy_versions where run_id = :r order by version",
                    r=cfg.name)
    assert [v.version for v in versions] == list(range(len(versions))), "versions contiguous from 0"
    assert all(a.trained_steps < b.trained_steps for a, b in zip(versions, versions[1:])), "monotonic"
    steps = rows(db, "select step, n_groups from train_steps where run_id = :r order by step", r=cfg.name)
    assert [(s.step, s.n_groups) for s in steps] == [(i, cfg.rollout.groups_per_step) for i in range(1, cfg.steps + 1)]
    lag = rows(db, "select max(staleness) as worst, count(*) as n, count(distinct trajectory_id) as distinct_n "
                   "from v_version_lag where run_id = :r", r=cfg.name)[0]
    assert lag.n == lag.distinct_n, "a trajectory consumed twice"
    assert lag.n <= cfg.steps * cfg.rollout.groups_per_step * cfg.rollout.group_size
    assert lag.worst <= cfg.staleness
    unpublished = rows(db, "select count(*) as n from trajectories t where t.run_id = :r and t.policy_version is "
                           "not null and not exists (select 1 from policy_versions p where p.run_id = t.run_id "
                           "and p.version = t.policy_version)", r=cfg.name)[0].n
    assert unpublished == 0, "a trajectory records a version that was never published"
    syncs = rows(db, "select version, status, probe_max_abs_diff, greedy_match from sync_events "
                     "where run_id = :r order by version", r=cfg.name)
    assert {s.version for s in syncs} == {v.version for v in versions}
    for sync in syncs:  # after each sync the server held exactly the trainer's weights
        assert sync.status == "ok" and sync.greedy_match is True
        assert sync.probe_max_abs_diff <= cfg.sync.verify_tolerance
