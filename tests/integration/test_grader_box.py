"""The grader box on the real stack: the Postgres grade cache, a failing grader retried and
recorded without stopping the run, and a model-based grader (LLM judge) served by vLLM."""

from __future__ import annotations

import asyncio
import re
import socket
import uuid
from pathlib import Path

import pytest
from temporalio.client import Client

from rlpipe.cli.run_commands import run_status, start_run
from rlpipe.envs.base import Rubric, Task
from rlpipe.graders.base import GraderDeps, GradeResult
from rlpipe.graders.judge import UnparsableJudgeOutput
from rlpipe.graders.registry import build_grader
from rlpipe.graders.rules import AnswerMatchGrader
from rlpipe.grading.group import grade_group
from rlpipe.schemas.config import RunConfig
from rlpipe.schemas.task import GraderConfig, JudgeConfig
from rlpipe.storage import buffer
from rlpipe.storage.db import Database
from rlpipe.storage.runs import register_run
from tests.integration.runs import RUN_TIMEOUT_S, assert_audit_trail, rows, run_to_end, tiny_config, tiny_judge
from tests.waiting import RunStalled, until

pytestmark = [pytest.mark.stack]


class CountingAnswerMatch(AnswerMatchGrader):
    """The real rule grader, counting how often it actually grades."""

    calls = 0

    async def score(self, task: Task, response_text: str) -> GradeResult:
        CountingAnswerMatch.calls += 1
        return await super().score(task, response_text)


def one_turn_group(db: Database, run: str, group_index: int, text: str) -> list[int]:
    with db.begin() as s:
        ids = buffer.start_group(s, run_id=run, group_index=group_index, prompt_index=0, task_id="t", workflow_id="wf",
                                 n_samples=1, prompt_ids=[1, 2])
        buffer.save_turn(s, {"trajectory_id": ids[0], "turn_index": 0, "input_ids": [1, 2], "output_ids": [3],
                             "output_logprobs": [-0.1], "output_text": text, "generate_latency_s": 0.0})
    return ids


async def test_identical_response_is_graded_once_then_served_from_the_cache(migrated_db: Database) -> None:
    run = f"cache-{uuid.uuid4().hex[:8]}"
    with migrated_db.begin() as s:
        register_run(s, RunConfig(name=run))
    task = Task(id=f"{run}:q", split="train", index=0, question=f"What is 2+2? ({run})", reference="4")
    grader, rubric = CountingAnswerMatch(), Rubric({"answer_match": 1.0})
    CountingAnswerMatch.calls = 0
    first = await grade_group(migrated_db, task, one_turn_group(migrated_db, run, 0, "<answer>4</answer>"),
                              rubric, {"answer_match": grader}, concurrency=2)
    second = await grade_group(migrated_db, task, one_turn_group(migrated_db, run, 1, "<answer>4</answer>"),
                               rubric, {"answer_match": grader}, concurrency=2)
    assert (first.rewards, first.cache_hits) == ([1.0], 0)
    assert (second.rewards, second.cache_hits) == ([1.0], 1)
    assert CountingAnswerMatch.calls == 1
    hits = rows(migrated_db, "select g.cache_hit from grades g join trajectories t on t.id = g.trajectory_id "
                             "where t.run_id = :r order by t.id", r=run)
    assert [h.cache_hit for h in hits] == [False, True]


@pytest.mark.vllm
@pytest.mark.usefixtures("clean_workflows")
async def test_failing_grader_is_retried_recorded_and_the_run_pauses_saying_why(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path) -> None:
    with socket.socket() as sock:  # a port with nobody listening: every judge call is refused
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    cfg = tiny_config(tiny_model, steps=1, grader={"name": "judge", "judge": {"base_url": dead, "model": "m"}},
                      rollout={"grade_attempts": 2, "pause_after_failed_groups": 3})
    await start_run(temporal_client, cfg)
    deadline = asyncio.get_running_loop().time() + RUN_TIMEOUT_S
    paused_row = "select status_reason from runs where id = :r and status = 'paused'"
    while not ((status := await run_status(temporal_client, cfg.name)).paused and
               (run := rows(migrated_db, paused_row, r=cfg.name))):
        assert asyncio.get_running_loop().time() < deadline, status
        await asyncio.sleep(0.5)
    # every group failed, so the run stopped starting groups rather than burn compute on the fault
    assert status.step == 0 and status.groups_failed >= 3 and status.phase == "paused"
    # groups in flight when the third failed may fail in the same workflow task: the reason counts them all
    in_a_row = re.match(r"paused after (\d+) groups in a row failed", status.pause_reason or "")
    assert in_a_row is not None and int(in_a_row[1]) >= 3, status.pause_reason
    assert "grading failed" in status.pause_reason, status.pause_reason
    assert run[0].status_reason == status.pause_reason  # SQL says why too
    grading = rows(migrated_db, "select workflow_id, activity_id, attempt, error_type from failures where "
                                "run_id = :r and kind = 'grade' order by workflow_id, activity_id, attempt",
                   r=cfg.name)
    per_activity: dict[tuple[str, str], list[int]] = {}  # activity ids are per (group) workflow
    for failure in grading:
        per_activity.setdefault((failure.workflow_id, failure.activity_id), []).append(failure.attempt)
    assert {f.error_type for f in grading} == {"ConnectError"}
    failed = rows(migrated_db, "select workflow_id, status_reason from rollout_groups where run_id = :r and "
                               "status = 'failed'", r=cfg.name)
    assert len(failed) >= 2 and all("grading failed" in g.status_reason for g in failed)
    for group in failed:  # each failed group's grading was tried twice, each try recorded
        tried = [attempts for (workflow, _), attempts in per_activity.items() if workflow == group.workflow_id]
        assert tried == [[1, 2]]
    assert all(attempts in ([1], [1, 2]) for attempts in per_activity.values())  # groups still grading: a prefix
    await temporal_client.get_workflow_handle(cfg.workflow_id).cancel()


RESPONSES = ["<answer>4</answer>", "4", "The answer is four.", "<answer>5</answer>", "", "SCORE", "I do not know",
             "<answer>4", "2 + 2 = 4, so <answer>4</answer>", "<tool>calc(2+2)</tool>"]


@pytest.mark.vllm
async def test_structured_judging_parses_every_reply_where_free_text_parses_none(
        inference_servers: list[str]) -> None:
    """The tiny model was never taught to judge: asked in free text, it never writes a score;
    constrained by vLLM's structured outputs, every reply is one."""
    task = Task(id="judge:q", split="train", index=0, question="What is 2+2?", reference="4")
    graders = {fmt: build_grader("judge", GraderConfig(name="judge", judge=JudgeConfig(
        **tiny_judge(inference_servers[0], reply_format=fmt))), GraderDeps()) for fmt in ("free_text", "structured")}
    try:
        free = await asyncio.gather(*(graders["free_text"].grade(task, r) for r in RESPONSES), return_exceptions=True)
        structured = await asyncio.gather(*(graders["structured"].grade(task, r) for r in RESPONSES))
    finally:
        for grader in graders.values():
            await grader.aclose()
    assert all(isinstance(result, UnparsableJudgeOutput) for result in free), free
    for result in structured:
        assert re.fullmatch(r"SCORE: (\d+)", result.details["judge_output"]), result.details
        assert result.score == result.details["judge_score"] / 10 and 0.0 <= result.score <= 1.0


@pytest.mark.vllm
@pytest.mark.usefixtures("clean_workflows")
async def test_model_grader_judges_through_the_inference_server(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path,
        inference_servers: list[str]) -> None:
    # the real chat API, structured replies, the judge's parsing and validation, end to end
    cfg = tiny_config(tiny_model, steps=1, grader={"name": "judge", "judge": tiny_judge(inference_servers[0])})
    await run_to_end(temporal_client, cfg)
    assert_audit_trail(migrated_db, cfg)
    grades = rows(migrated_db, "select g.grader, g.score, g.latency_s, g.details from grades g join trajectories t "
                               "on t.id = g.trajectory_id where t.run_id = :r", r=cfg.name)
    expected = cfg.rollout.groups_per_step * cfg.rollout.group_size
    assert len(grades) >= expected and {g.grader for g in grades} == {"judge"}
    for grade in grades:  # every trajectory's grade row holds a parsed verdict
        assert re.fullmatch(r"SCORE: (\d+)", grade.details["judge_output"]), grade.details
        assert grade.score == grade.details["judge_score"] / 10 and grade.latency_s > 0
    assert rows(migrated_db, "select 1 from failures where run_id = :r and kind = 'grade'", r=cfg.name) == []


@pytest.mark.vllm
@pytest.mark.usefixtures("clean_workflows")
async def test_a_free_text_judge_that_never_scores_pauses_the_run_and_the_wait_says_why(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path,
        inference_servers: list[str]) -> None:
    judge = tiny_judge(inference_servers[0], reply_format="free_text")
    cfg = tiny_config(tiny_model, steps=1, grader={"name": "judge", "judge": judge},
                      rollout={"pause_after_failed_groups": 2})
    with pytest.raises(RunStalled, match="paused after 2 groups in a row failed") as stalled:
        await run_to_end(temporal_client, cfg)  # fails as the run pauses, not at RUN_TIMEOUT_S
    assert "produced an invalid grade" in str(stalled.value) and "no score matching" in str(stalled.value)
    # the workflow pauses first (no more groups start), then writes the status row
    (run,) = await until(lambda: rows(migrated_db, "select status, status_reason from runs where id = :r "
                                                   "and status = 'paused'", r=cfg.name),
                         "the runs row says paused", timeout_s=60)
    assert run.status_reason in str(stalled.value)
    unparsable = rows(migrated_db, "select error_type from failures where run_id = :r and kind = 'grade'", r=cfg.name)
    assert unparsable and {f.error_type for f in unparsable} == {"UnparsableJudgeOutput"}
    await temporal_client.get_workflow_handle(cfg.workflow_id).cancel()
