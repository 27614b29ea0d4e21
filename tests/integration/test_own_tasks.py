"""Users' own tasks on the real stack: a run on a JSONL dataset, and a run on an environment (with its
own grader) from a separately installed package, found through its entry points by workers that were
started before it was installed. In both, the grades and rewards in Postgres are what the graders give
for the same texts, recomputed here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from rlpipe.envs.registry import ENVIRONMENTS, build_environment
from rlpipe.graders.base import Grader
from rlpipe.graders.registry import GRADERS
from rlpipe.graders.rules import FinalNumberGrader
from rlpipe.schemas.config import RunConfig
from rlpipe.storage.db import Database
from rlpipe.workers.launcher import WorkerSet
from tests.integration.runs import assert_audit_trail, rows, run_to_end, tiny_config

pytestmark = [pytest.mark.stack, pytest.mark.vllm, pytest.mark.usefixtures("clean_workflows")]

PLUGIN = Path(__file__).resolve().parents[1] / "plugins" / "rlpipe_letters"
SHORT_RUN: dict[str, Any] = {"steps": 2, "eval": {"prompts": 4},
                             "rollout": {"group_size": 4, "groups_per_step": 2}}


def own_task_config(tiny_model: Path, env: dict[str, Any]) -> RunConfig:
    """The tiny test run (2 steps, 2 groups of 4) with `env` as its whole [env] table."""
    data = tiny_config(tiny_model, **SHORT_RUN).model_dump(mode="json", exclude_unset=True)
    return RunConfig.model_validate({**data, "env": env})


async def assert_grades_are_the_graders(db: Database, cfg: RunConfig, graders: dict[str, Grader]) -> None:
    """Every graded trajectory's grades equal `graders` on its final text for its task, and its reward is
    their rubric mean (here one grader of weight 1: its score)."""
    env = build_environment(cfg.env)
    graded = rows(db, "select t.id, t.reward, g.prompt_index, g.task_id, (select output_text from turns u where "
                      "u.trajectory_id = t.id order by turn_index desc limit 1) as text from trajectories t join "
                      "rollout_groups g on g.id = t.group_id where t.run_id = :r and t.reward is not null", r=cfg.name)
    assert len(graded) >= cfg.steps * cfg.rollout.groups_per_step * cfg.rollout.group_size
    for trajectory in graded:
        task = env.task("train", trajectory.prompt_index)
        assert trajectory.task_id == task.id
        stored = {g.grader: g for g in rows(db, "select grader, grader_version, score from grades where "
                                                "trajectory_id = :t", t=trajectory.id)}
        assert set(stored) == set(graders)
        for name, grader in graders.items():
            expected = await grader.grade(task, trajectory.text)
            assert (stored[name].score, stored[name].grader_version) == (expected.score, grader.version), trajectory
        assert trajectory.reward == pytest.approx(stored[next(iter(graders))].score)
        # the tiny model may answer every task wrongly (all zeros); the graders do tell a right answer
        assert [(await grader.grade(task, task.reference)).score for grader in graders.values()] == [1.0] * len(graders)


async def test_a_run_on_a_jsonl_dataset_grades_its_rows(
        temporal_client: Client, pipeline_workers: WorkerSet, migrated_db: Database, tiny_model: Path,
        tmp_path: Path) -> None:
    # one-digit sums and differences, which the tiny model half-knows, as a user's file with ids
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"id": f"{a}{op}{b}", "question": f"What is {a} {op} {b}?",
                                        "answer": a + b if op == "+" else a - b}) + "\n"
                            for a in range(10) for b in range(10) for op in "+-"))
    cfg = own_task_config(tiny_model, {"name": "dataset", "dataset": {
        "path": str(data), "prompt_column": "question", "id_column": "id", "eval_rows": 20,
        "system_prompt": "Answer with just the number."}})
    await run_to_end(temporal_client, cfg)
    assert_audit_trail(migrated_db, cfg)
    await assert_grades_are_the_graders(migrated_db, cfg, {"final_number": FinalNumberGrader()})
    env = build_environment(cfg.env)
    evals = rows(migrated_db, "select version, n_prompts from eval_results where run_id = :r", r=cfg.name)
    assert evals and all(e.n_prompts == 4 for e in evals)  # the first 4 of the 20 carved eval rows
    eval_ids = {env.task("eval", i).metadata["id"] for i in range(env.size("eval"))}
    trained = rows(migrated_db, "select distinct prompt_index from rollout_groups where run_id = :r", r=cfg.name)
    assert not eval_ids & {env.task("train", g.prompt_index).metadata["id"] for g in trained}


def restart_workers(workers: WorkerSet, env: dict[str, str]) -> None:
    workers.down(progress=lambda msg: None)
    workers.env = env
    workers.up(progress=lambda msg: None)


@pytest.fixture
def plugin_site(tmp_path: Path, pipeline_workers: WorkerSet, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty directory on every worker's PYTHONPATH (workers restarted with it), where a test installs
    packages while they run; afterwards the workers run as before, and the directory is gone."""
    site = tmp_path / "site"
    site.mkdir()
    restart_workers(pipeline_workers, {"PYTHONPATH": str(site)})
    monkeypatch.syspath_prepend(str(site))  # this process validates the config and recomputes the grades
    for registry in (ENVIRONMENTS, GRADERS):
        monkeypatch.setattr(registry, "_plugins", dict(registry._plugins))
    try:
        yield site
    finally:
        restart_workers(pipeline_workers, {})
        shutil.rmtree(site)
        for name in [m for m in sys.modules if m == "rlpipe_letters" or m.startswith("rlpipe_letters.")]:
            del sys.modules[name]
        for registry in (ENVIRONMENTS, GRADERS):
            registry._declared = None  # read again without the package


def pip_install(source: Path, target: Path, build_dir: Path) -> None:
    """`pip install` the package at `source` into `target`, built from a copy so that the build leaves
    nothing in the repository (setuptools writes build/ and *.egg-info beside the sources)."""
    copy = shutil.copytree(source, build_dir, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(copy)], check=True, capture_output=True, timeout=300)


async def test_a_run_on_an_installed_packages_environment_finds_it_in_running_workers(
        temporal_client: Client, pipeline_workers: WorkerSet, migrated_db: Database, tiny_model: Path,
        plugin_site: Path, tmp_path: Path) -> None:
    started = {name: record.pid for name, record in pipeline_workers.table.load().items()}
    pip_install(PLUGIN, plugin_site, tmp_path / "build")  # after every worker started: none is restarted
    assert [p.name for p in plugin_site.glob("*.dist-info")] == ["rlpipe_letters-0.1.0.dist-info"]
    cfg = own_task_config(tiny_model, {"name": "letter_count", "eval_size": 8})
    await run_to_end(temporal_client, cfg)
    assert {name: record.pid for name, record in pipeline_workers.table.load().items()} == started
    assert_audit_trail(migrated_db, cfg)
    # the environment's rubric names the package's own grader, itself found through its entry point
    near_number = GRADERS.get("near_number")
    assert near_number.__module__ == ENVIRONMENTS.get("letter_count").__module__ == "rlpipe_letters"
    await assert_grades_are_the_graders(migrated_db, cfg, {"near_number": near_number()})
    questions = rows(migrated_db, "select distinct task_id from rollout_groups where run_id = :r", r=cfg.name)
    assert all(q.task_id.startswith("letter_count:0:train:") for q in questions)
