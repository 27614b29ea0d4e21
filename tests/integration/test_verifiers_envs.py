"""`verifiers` environments on the real stack: the test package's single-turn environment and its tool
environment (tests/plugins/rlpipe_vf_tasks), installed while the workers run, each trained for a short run
through rlpipe's own rollouts. Every grade and reward in Postgres equals what the environment's own rubric
(`verifiers`' `Task.score`, called here on a trace built from the stored turns) gives for the same texts."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from rlpipe.envs.registry import build_environment
from rlpipe.envs.verifiers_env import VerifiersEnv
from rlpipe.storage.db import Database
from rlpipe.workers.launcher import WorkerSet
from tests.integration.runs import assert_audit_trail, rows, run_to_end
from tests.integration.test_own_tasks import own_task_config, pip_install, restart_workers

pytestmark = [pytest.mark.stack, pytest.mark.vllm, pytest.mark.usefixtures("clean_workflows")]

PACKAGE = Path(__file__).resolve().parents[1] / "plugins" / "rlpipe_vf_tasks"
MODULES = ("vf_sums", "vf_sums_calc")


@pytest.fixture(scope="module")
def vf_site(tmp_path_factory: pytest.TempPathFactory, pipeline_workers: WorkerSet) -> Iterator[Path]:
    """The test package installed into a directory on every worker's PYTHONPATH (the workers restarted once
    for both runs, and once more afterwards without it) and on this process's sys.path."""
    root = tmp_path_factory.mktemp("vf")
    site = root / "site"
    pip_install(PACKAGE, site, root / "build")
    restart_workers(pipeline_workers, {"PYTHONPATH": str(site)})
    sys.path.insert(0, str(site))
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        restart_workers(pipeline_workers, {})
        shutil.rmtree(root)
        for name in [m for m in sys.modules if m.partition(".")[0] in MODULES]:
            del sys.modules[name]


def verifiers_trace(vf_task: Any, turns: list[Any]) -> Any:
    """The trace verifiers' chat loop would have recorded for the stored turns, built here from the verifiers
    types (the model's messages sampled, the prompt's not)."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask

    data = vf_task.data
    messages: list[Any] = [vf.SystemMessage(content=data.system_prompt), vf.UserMessage(content=data.prompt)]
    for turn in turns:
        calls = [call for call in turn.tool_calls or () if call["result"] is not None]
        messages.append(vf.AssistantMessage(content=turn.output_text, tool_calls=[
            vf.ToolCall(id=f"{turn.turn_index}.{i}", name=c["name"], arguments=c["arguments"])
            for i, c in enumerate(calls)] or None))
        for i, call in enumerate(calls):
            result = call["result"]
            content = result["output"] if result["ok"] else f"error: {result['reason']}\n{result['output']}".rstrip()
            messages.append(vf.ToolMessage(tool_call_id=f"{turn.turn_index}.{i}", name=call["name"], content=content))
    nodes = [MessageNode(parent=i - 1 if i else None, message=m, sampled=i >= 2 and m.role == "assistant")
             for i, m in enumerate(messages)]
    return vf.Trace(task=TraceTask(type=type(vf_task).__name__, data=data), agent=AgentInfo(config=vf.AgentConfig()),
                    nodes=nodes)


async def assert_grades_are_the_rubrics(db: Database, env: VerifiersEnv, run: str, min_graded: int) -> int:
    """Every graded trajectory's grade and reward are its task's verifiers rubric over its stored turns
    (weighted sum over the weights); returns how many of its turns called a tool."""
    graded = rows(db, "select t.id, t.reward, g.prompt_index, g.task_id, gr.score, gr.details from trajectories t "
                      "join rollout_groups g on g.id = t.group_id join grades gr on gr.trajectory_id = t.id "
                      "where t.run_id = :r and t.reward is not null and gr.grader = 'verifiers_rubric'", r=run)
    assert len(graded) >= min_graded
    tool_turns = 0
    for trajectory in graded:
        task = env.task("train", trajectory.prompt_index)
        assert trajectory.task_id == task.id
        vf_task = env.loaded.tasks[task.metadata["verifiers"]["position"]]
        turns = rows(db, "select turn_index, output_text, tool_calls from turns where trajectory_id = :t "
                         "order by turn_index", t=trajectory.id)
        tool_turns += sum(bool(turn.tool_calls) for turn in turns)
        trace = verifiers_trace(vf_task, turns)
        await vf_task.score(trace)
        weights = sum(reward.weight for reward in trace.rewards.values())
        assert trajectory.score == pytest.approx(trace.reward / weights, abs=1e-12), trajectory
        assert trajectory.reward == pytest.approx(trajectory.score, abs=1e-12)
        assert trajectory.details["rewards"] == {name: {"score": r.score, "weight": r.weight}
                                                 for name, r in trace.rewards.items()}
    return tool_turns


async def test_a_single_turn_verifiers_environment_trains_on_its_own_rubric(
        temporal_client: Client, pipeline_workers: WorkerSet, migrated_db: Database, tiny_model: Path,
        vf_site: Path) -> None:
    cfg = own_task_config(tiny_model, {"name": "verifiers", "verifiers": {"id": "vf-sums", "eval_tasks": 8}})
    await run_to_end(temporal_client, cfg)
    assert_audit_trail(migrated_db, cfg)
    env = build_environment(cfg.env)
    assert isinstance(env, VerifiersEnv)
    await assert_grades_are_the_rubrics(migrated_db, env, cfg.name,
                                        cfg.steps * cfg.rollout.groups_per_step * cfg.rollout.group_size)
    evals = rows(migrated_db, "select n_prompts from eval_results where run_id = :r", r=cfg.name)
    assert evals and all(e.n_prompts == 4 for e in evals)


async def test_a_tool_verifiers_environment_runs_its_tools_in_rlpipes_turns(
        temporal_client: Client, pipeline_workers: WorkerSet, migrated_db: Database, tiny_model: Path,
        vf_site: Path) -> None:
    cfg = own_task_config(tiny_model, {"name": "verifiers", "max_turns": 3, "verifiers": {"id": "vf-sums-calc"}})
    await run_to_end(temporal_client, cfg)
    assert_audit_trail(migrated_db, cfg)
    env = build_environment(cfg.env)
    assert isinstance(env, VerifiersEnv)
    tool_turns = await assert_grades_are_the_rubrics(migrated_db, env, cfg.name,
                                                     cfg.steps * cfg.rollout.groups_per_step * cfg.rollout.group_size)
    # every tool call the model made ran through the sandbox activity and is in the turn that made it
    turns = rows(migrated_db, "select u.tool_calls from turns u join trajectories t on t.id = u.trajectory_id "
                              "where t.run_id = :r", r=cfg.name)
    with_calls = [turn.tool_calls for turn in turns if turn.tool_calls]
    assert len(with_calls) >= tool_turns and all(call["result"] is not None for calls in with_calls for call in calls)
    print(f"{tool_turns} graded tool turns")  # what the tiny model happened to do: shown, never asserted
