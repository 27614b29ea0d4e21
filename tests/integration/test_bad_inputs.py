"""The bad-input table of issue #9 on the real stack: each bad input gets a clear error that names
the problem, and nothing already stored is lost (rows in Postgres, objects in S3, worker processes).

| row | tests (here unless a module is named) |
|---|---|
| malformed / unknown / out-of-range config fields, CLI | unit/test_bad_inputs.py::test_cli_refuses_a_bad_config_before_it_connects; test_cli_bad_config_starts_nothing |
| the same as JSON (Web UI) and in the config model | test_training_runs.py::test_json_input_with_a_bad_field_fails_the_run_naming_it; unit/test_config.py::test_bad_config_is_rejected_naming_the_field |
| the Temporal update validators of the run | unit/test_bad_inputs.py::test_schedule_validator_names_the_field, ::test_pause_and_resume_validators_say_why; workflows/test_training_run_logic.py::test_schedule_update_is_validated; test_update_validators_refuse_bad_values_and_change_nothing |
| unknown environment | unit/test_envs.py::test_unknown_environment_lists_the_known_ones; the CLI cases above |
| unknown grader | unit/test_graders.py::test_unknown_grader_lists_the_known_ones; the CLI cases above |
| model path missing or not a model | unit/test_bad_inputs.py::test_model_dir_check_names_the_path_and_what_is_missing; test_missing_model_fails_the_run_at_once |
| prompt longer than the context | unit/test_bad_inputs.py::test_prompt_over_the_configured_context_is_refused_before_any_request; test_prompt_over_the_servers_context_is_refused_not_retried |
| malformed or unterminated tool calls | unit/test_envs.py::test_parse_action, ::test_parse_never_raises_on_junk, ::test_calls_beyond_the_per_turn_limit_become_one_error, ::test_calculator_errors_become_observations |
| tool output binary or huge | sandbox/test_escape_suite.py::test_100_mb_of_output_is_cut_and_killed, ::test_non_utf8_output_is_replaced_and_flagged; unit/test_envs.py::test_huge_output_keeps_head_and_tail_and_counts_the_cut, ::test_binary_and_non_utf8_output_becomes_clean_text, ::test_observation_truncates_and_reports_errors |
| grader returns NaN / inf / out of range | unit/test_graders.py::test_invalid_grades_are_rejected_by_name_and_value, ::test_invalid_grades_are_not_cached, ::test_out_of_range_judge_scores_are_rejected; test_invalid_grade_fails_the_group_and_stores_nothing |
| S3 unreachable for a while | test_s3_outage_is_retried_then_the_run_finishes_with_nothing_lost |
| Postgres unreachable for a while | test_postgres_outage_is_retried_then_the_run_finishes_with_nothing_lost |
| inference server down | test_vllm.py::test_unreachable_server_raises_an_error_naming_it; test_inference_server_down_is_retried_and_the_run_status_says_why |
| duplicate run name | test_duplicate_run_name_is_refused_and_changes_nothing |
| starting a run twice with the same id | test_starting_a_run_twice_is_one_run |
| cancel during a sync | test_cancel_during_a_sync_leaves_the_server_serving_a_published_version |

One run (`outage_run`) serves five rows: it is started twice while S3 is down, refuses bad updates
while paused, goes through a Postgres outage while rolling out, and is started again once finished.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType, PendingActivityState
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from rlpipe.cli import run_commands
from rlpipe.cli.chaos import Monkey
from rlpipe.cli.run_commands import RunCommandError, start_run
from rlpipe.envs.base import Rubric, Task
from rlpipe.graders.base import GradeResult, InvalidGrade
from rlpipe.graders.cache import grade_cache_key
from rlpipe.graders.rules import AnswerMatchGrader
from rlpipe.grading.group import grade_group
from rlpipe.inference.admin import InferenceAdmin
from rlpipe.inference.client import InferenceClient
from rlpipe.infra.endpoints import Endpoints
from rlpipe.infra.inference import SERVED_MODEL_NAME
from rlpipe.infra.stack import Stack
from rlpipe.rollout.generation import ContextTooLong, TurnPlan, sample_turn
from rlpipe.schemas.config import RunConfig
from rlpipe.schemas.payloads import WORKFLOW_QUEUE, ScheduleUpdate
from rlpipe.storage.db import Database
from rlpipe.storage.object_store import ObjectStore
from rlpipe.storage.runs import DuplicateRunName, register_run
from rlpipe.weights.checkpoints import manifest_key
from rlpipe.workflows.policies import OUTAGE
from tests.integration.runs import RUN_TIMEOUT_S, assert_audit_trail, cli, rows, tiny_config
from tests.integration.test_grader_box import one_turn_group
from tests.waiting import run_result, until

pytestmark = [pytest.mark.stack, pytest.mark.vllm]


def quiet(msg: str) -> None:
    pass


async def refusal(call: Awaitable[object]) -> str:
    """The RunCommandError message a bad call must end in."""
    with pytest.raises(RunCommandError) as caught:
        await call
    return str(caught.value)


def stored_counts(db: Database, run: str) -> dict[str, int]:
    return {table: rows(db, f"select count(*) as n from {table} where run_id = :r", r=run)[0].n
            for table in ("policy_versions", "train_steps", "rollout_groups", "trajectories", "sync_events")}


@dataclass
class Marker:
    """Data stored before any outage, to be found unchanged after it."""

    run: str
    key: str
    body: bytes

    @classmethod
    def store(cls, db: Database, store: ObjectStore) -> Marker:
        marker = cls(f"marker-{uuid.uuid4().hex[:8]}", f"test/bad-inputs/{uuid.uuid4().hex}", os.urandom(4096))
        with db.begin() as s:
            register_run(s, RunConfig(name=marker.run))
        store.client.put_object(Bucket=store.bucket, Key=marker.key, Body=marker.body)
        return marker

    def assert_intact(self, db: Database, store: ObjectStore) -> None:
        assert rows(db, "select id from runs where id = :r", r=self.run), "a row stored before the outage is gone"
        assert store.get_bytes(self.key) == self.body, "an object stored before the outage changed"


# -- one run through S3 and Postgres outages, started twice and given bad updates ------------------
@dataclass
class OutageRun:
    cfg: RunConfig
    handles: list[WorkflowHandle]
    refused: dict[str, str]
    schedule_cli: subprocess.CompletedProcess[str]
    status_after_refusals: Any
    counts_while_paused: dict[str, int]
    s3_failure: str
    marker: Marker
    outage_failures: list[str]
    """the failures of rollout activities that met an outage (groups never touch S3)."""


@pytest.fixture(scope="module")
async def outage_run(stack: Stack, temporal_client: Client, pipeline_workers, migrated_db: Database,  # type: ignore[no-untyped-def]
                     object_store: ObjectStore, tiny_model: Path) -> OutageRun:
    cfg = tiny_config(tiny_model, steps=2)
    name = cfg.name
    marker = Marker.store(migrated_db, object_store)
    seaweed = stack.service("seaweedfs")
    stack.stop_service(seaweed, progress=quiet)
    try:  # S3 is down from before the start: publishing the base policy must fail and be retried
        handles = list(await asyncio.gather(start_run(temporal_client, cfg), start_run(temporal_client, cfg)))
        await run_commands.pause(temporal_client, name, "bad-input checks")
        refused = {
            "different config": await refusal(start_run(temporal_client, cfg.model_copy(update={"steps": 3}))),
            "pause again": await refusal(run_commands.pause(temporal_client, name, "again")),
            "sync_interval 0": await refusal(run_commands.set_schedule(temporal_client, name,
                                                                       ScheduleUpdate(sync_interval=0))),
            "max_staleness -1": await refusal(run_commands.set_schedule(temporal_client, name,
                                                                        ScheduleUpdate(max_staleness=-1))),
            "sync_interval 5": await refusal(run_commands.set_schedule(temporal_client, name,
                                                                       ScheduleUpdate(sync_interval=5))),
        }
        schedule_cli = cli(stack, "run", "schedule", name, "--sync-interval", "3")
        status_after_refusals = await run_commands.run_status(temporal_client, name)
        s3_failure = await until(lambda: rows(migrated_db, "select message from failures where run_id = :r and "
                                                           "activity = 'init_policy' order by id", r=name),
                                 "a failed publish")
        # counted before S3 returns: the publish keeps being retried while paused, and may succeed at once
        counts_while_paused = stored_counts(migrated_db, name)
    finally:
        stack.start(seaweed, progress=quiet)
    await run_commands.resume(temporal_client, name)

    # Postgres goes away while groups are generating: activities fail and are retried
    await until(lambda: rows(migrated_db, "select 1 from turns tu join trajectories t on t.id = tu.trajectory_id "
                                          "where t.run_id = :r", r=name), "the first generated turn")
    postgres = stack.service("postgres")
    stack.stop_service(postgres, progress=quiet)
    stack.start(postgres, progress=quiet)
    await run_result(handles[0], RUN_TIMEOUT_S)
    groups = [g.workflow_id for g in rows(migrated_db, "select workflow_id from rollout_groups where run_id = :r",
                                          r=name)]
    met = [m for wf in groups for m in await outage_failures(temporal_client, wf)]
    return OutageRun(cfg, handles, refused, schedule_cli, status_after_refusals, counts_while_paused,
                     s3_failure[0].message, marker, met)


async def outage_failures(client: Client, workflow_id: str) -> list[str]:
    """What the group's activities met during the outage: a rollout call hands an outage to its
    workflow, which runs it again (a failed activity of type ServiceOutage); a bookkeeping call is
    retried by Temporal (a started event with attempt > 1 and the previous attempt's failure)."""
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    handed_back = [e.activity_task_failed_event_attributes.failure for e in history.events
                   if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED]
    retried = [e.activity_task_started_event_attributes.last_failure for e in history.events
               if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
               and e.activity_task_started_event_attributes.attempt > 1]
    return [f.message for f in handed_back if f.application_failure_info.type == OUTAGE] + \
        [f.message for f in retried]


def assert_nothing_lost(db: Database, store: ObjectStore, run: OutageRun) -> None:
    assert_audit_trail(db, run.cfg)
    run.marker.assert_intact(db, store)
    for version in rows(db, "select version from policy_versions where run_id = :r", r=run.cfg.name):
        assert store.exists(manifest_key(run.cfg.name, version.version)), f"v{version.version} has no checkpoint"
    unaccounted = rows(db, "select group_index, status from rollout_groups where run_id = :r and not (status = "
                           "'completed' or (status in ('failed', 'dropped') and status_reason is not null))",
                       r=run.cfg.name)
    assert unaccounted == [], "a group neither completed nor ended with a reason"


def test_starting_a_run_twice_is_one_run(outage_run: OutageRun, migrated_db: Database) -> None:
    first, second = outage_run.handles
    assert first.id == second.id == outage_run.cfg.workflow_id
    assert first.result_run_id == second.result_run_id, "the second start began another execution"
    assert rows(migrated_db, "select count(*) as n from runs where id = :r", r=outage_run.cfg.name)[0].n == 1
    versions = rows(migrated_db, "select version from policy_versions where run_id = :r order by version",
                    r=outage_run.cfg.name)
    assert [v.version for v in versions] == list(range(outage_run.cfg.steps + 1))  # v0 published once


def test_update_validators_refuse_bad_values_and_change_nothing(outage_run: OutageRun) -> None:
    refused = outage_run.refused
    assert "is already paused (bad-input checks)" in refused["pause again"]
    assert "sync_interval must be >= 1, got 0" in refused["sync_interval 0"]
    assert "max_staleness must be >= 0, got -1" in refused["max_staleness -1"]
    assert "sync_interval (5) > max_staleness + 1 (2)" in refused["sync_interval 5"]
    assert outage_run.schedule_cli.returncode == 2, outage_run.schedule_cli.stderr
    assert "sync_interval (3) > max_staleness + 1 (2)" in " ".join(outage_run.schedule_cli.stdout.split())
    status = outage_run.status_after_refusals
    assert (status.paused, status.sync_interval, status.max_staleness) == (True, 1, 1)


async def test_duplicate_run_name_is_refused_and_changes_nothing(
        outage_run: OutageRun, temporal_client: Client, migrated_db: Database) -> None:
    cfg = outage_run.cfg
    assert f"run '{cfg.name}' is already running with a different config" in outage_run.refused["different config"]
    before = stored_counts(migrated_db, cfg.name)
    again = await refusal(start_run(temporal_client, cfg))  # finished: the name is taken for good
    assert f"a run named '{cfg.name}' already ran" in again
    with pytest.raises(DuplicateRunName, match=f"a run named '{cfg.name}' already exists .* different config"):
        with migrated_db.begin() as s:  # the database refuses it too (a Temporal server that lost its history)
            register_run(s, cfg.model_copy(update={"steps": 5}))
    assert stored_counts(migrated_db, cfg.name) == before
    assert (await temporal_client.get_workflow_handle(cfg.workflow_id).describe()).status == \
        WorkflowExecutionStatus.COMPLETED


def test_s3_outage_is_retried_then_the_run_finishes_with_nothing_lost(
        outage_run: OutageRun, migrated_db: Database, object_store: ObjectStore) -> None:
    endpoint = object_store.client.meta.endpoint_url
    assert endpoint in outage_run.s3_failure, f"the failure does not name the S3 endpoint: {outage_run.s3_failure}"
    assert outage_run.counts_while_paused["policy_versions"] == 0  # nothing was published while S3 was down
    assert_nothing_lost(migrated_db, object_store, outage_run)


def test_postgres_outage_is_retried_then_the_run_finishes_with_nothing_lost(
        outage_run: OutageRun, migrated_db: Database, object_store: ObjectStore, pipeline_workers) -> None:  # type: ignore[no-untyped-def]
    # the server keeps only the last failure of a retried activity, and replaces one over its size
    # limit (a psycopg traceback) by a note: the retries themselves are the evidence
    assert outage_run.outage_failures, "no rollout activity met the Postgres outage"
    assert_nothing_lost(migrated_db, object_store, outage_run)
    failed = rows(migrated_db, "select group_index, status_reason from rollout_groups where run_id = :r "
                               "and status = 'failed'", r=outage_run.cfg.name)
    assert failed == [], "a group failed because the database was down"
    assert all(record.is_running() for record in pipeline_workers.table.load().values()), "a worker died"


# -- single rows -----------------------------------------------------------------------------------
async def test_cli_bad_config_starts_nothing(stack: Stack, tmp_path: Path, temporal_client: Client,
                                             migrated_db: Database) -> None:
    name = f"cli-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "run.toml"
    config.write_text(f'name = "{name}"\nsteps = 2\n[rollout]\ngroup_size = 0\n')
    done = cli(stack, "run", "start", str(config))
    assert done.returncode == 2, done.stderr
    assert "rollout.group_size: Input should be greater than or equal to 1" in " ".join(done.stdout.split())
    assert rows(migrated_db, "select id from runs where id = :r", r=name) == []
    assert [wf async for wf in temporal_client.list_workflows(f"WorkflowId = 'run-{name}'")] == []


@pytest.mark.usefixtures("clean_workflows")
async def test_missing_model_fails_the_run_at_once(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = tiny_config(tiny_model)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(tmp_path / "no-model")})})
    with pytest.raises(WorkflowFailureError) as caught:
        await asyncio.wait_for((await start_run(temporal_client, cfg)).result(), RUN_TIMEOUT_S)
    cause = caught.value.cause
    while cause.__cause__ is not None:
        cause = cause.__cause__
    assert f"model.path '{tmp_path / 'no-model'}'" in str(cause) and "no such directory" in str(cause)
    failures = rows(migrated_db, "select error_type, attempt from failures where run_id = :r", r=cfg.name)
    assert [(f.error_type, f.attempt) for f in failures] == [("ConfigError", 1)], "retried in vain"
    [run] = rows(migrated_db, "select status, status_reason from runs where id = :r", r=cfg.name)
    assert run.status == "failed" and "no such directory" in run.status_reason, run
    assert stored_counts(migrated_db, cfg.name)["policy_versions"] == 0
    assert all(record.is_running() for record in pipeline_workers.table.load().values())


@pytest.mark.usefixtures("clean_workflows")
async def test_an_environment_that_cannot_draw_its_tasks_fails_the_run_at_once(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = tiny_config(tiny_model)  # one-digit sums: 100 distinct questions, fewer than the 200 asked for
    env = cfg.env.model_copy(update={"eval_size": 200, "difficulty": {"min_digits": 1, "max_digits": 1,
                                                                     "operators": ["+"]}})
    cfg = cfg.model_copy(update={"env": type(cfg.env).model_validate(env.model_dump())})
    with pytest.raises(WorkflowFailureError):
        await asyncio.wait_for((await start_run(temporal_client, cfg)).result(), RUN_TIMEOUT_S)
    [run] = rows(migrated_db, "select status, status_reason from runs where id = :r", r=cfg.name)
    assert run.status == "failed" and "too few distinct questions for eval_size=200" in run.status_reason, run
    failures = rows(migrated_db, "select kind, error_type, attempt from failures where run_id = :r", r=cfg.name)
    assert [(f.kind, f.error_type, f.attempt) for f in failures] == [("config", "ConfigError", 1)], "retried in vain"
    assert stored_counts(migrated_db, cfg.name) == dict.fromkeys(stored_counts(migrated_db, cfg.name), 0)


@pytest.mark.usefixtures("clean_workflows")
async def test_a_config_rejected_inside_the_workflow_still_gets_its_row(
        temporal_client: Client, pipeline_workers, migrated_db: Database) -> None:  # type: ignore[no-untyped-def]
    workflow_id = f"typed-in-the-ui-{uuid.uuid4().hex[:8]}"
    name = f"ui-{uuid.uuid4().hex[:8]}"
    handle = await temporal_client.start_workflow(  # the Web UI's Start Workflow form: one JSON argument
        "TrainingRunWorkflow", {"name": name, "steps": 0}, id=workflow_id, task_queue=WORKFLOW_QUEUE)
    with pytest.raises(WorkflowFailureError):
        await asyncio.wait_for(handle.result(), RUN_TIMEOUT_S)
    [run] = rows(migrated_db, "select workflow_id, status, status_reason, config from runs where id = :r", r=name)
    assert run.workflow_id == workflow_id and run.status == "failed" and "steps" in run.status_reason, run
    assert run.config == {"name": name, "steps": 0}
    status = await run_commands.run_status(temporal_client, workflow_id)
    assert status.phase == "failed" and status.close_reason == run.status_reason


async def test_prompt_over_the_servers_context_is_refused_not_retried(
        inference_servers: list[str], tiny_model: Path) -> None:
    from rlpipe.envs.registry import build_environment
    from rlpipe.policy.chat import load_tokenizer

    cfg = tiny_config(tiny_model)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"max_model_len": 4096})})
    too_long = TurnPlan(input_ids=[5] * 600, context_ids=[5] * 600)  # the server's context is 512
    async with InferenceClient(inference_servers[0], SERVED_MODEL_NAME, route="generate") as client:
        with pytest.raises(ContextTooLong, match="the context has 600 tokens, more than the server's context.*"
                                                 "maximum model length of 512"):
            await sample_turn(client, too_long, cfg, build_environment(cfg.env), load_tokenizer(tiny_model), seed=0)
        # the server is still serving (whatever weights earlier tests left it: past their end-of-sequence)
        served = await client.complete([5] * 8, max_tokens=2, ignore_eos=True)
    assert len(served.token_ids) == 2


class FixedGrader(AnswerMatchGrader):
    """The rule grader with its score replaced: how a buggy grader shows up."""

    def __init__(self, score: float) -> None:
        self.fixed = score

    async def score(self, task: Task, response_text: str) -> GradeResult:
        return GradeResult(self.fixed, {})


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 1.5], ids=["nan", "inf", "negative", "above-one"])
async def test_invalid_grade_fails_the_group_and_stores_nothing(migrated_db: Database, bad: float) -> None:
    run = f"grade-{uuid.uuid4().hex[:8]}"
    with migrated_db.begin() as s:
        register_run(s, RunConfig(name=run))
    task = Task(id=f"{run}:q", split="train", index=0, question=f"What is 2+2? ({run})", reference="4")
    rubric = Rubric({"answer_match": 1.0})
    good = one_turn_group(migrated_db, run, 0, "<answer>4</answer>")
    assert (await grade_group(migrated_db, task, good, rubric, {"answer_match": FixedGrader(1.0)}, 2)).rewards == [1.0]
    broken = one_turn_group(migrated_db, run, 1, "<answer>5</answer>")
    with pytest.raises(InvalidGrade, match=f"grader 'answer_match' produced an invalid grade {bad!r}"):
        await grade_group(migrated_db, task, broken, rubric, {"answer_match": FixedGrader(bad)}, 2)
    graded = rows(migrated_db, "select t.id, t.reward, g.score from trajectories t left join grades g on "
                               "g.trajectory_id = t.id where t.run_id = :r order by t.id", r=run)
    assert [(g.reward, g.score) for g in graded] == [(1.0, 1.0), (None, None)]  # the good grade is kept
    keys = [grade_cache_key("answer_match", FixedGrader.version, task, text)
            for text in ("<answer>4</answer>", "<answer>5</answer>")]
    cached = rows(migrated_db, "select key from grader_cache where key = any(:k)", k=keys)
    assert [c.key for c in cached] == keys[:1], "an invalid grade was cached"


@pytest.mark.usefixtures("clean_workflows")
async def test_inference_server_down_is_retried_and_the_run_status_says_why(
        stack: Stack, temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path,  # type: ignore[no-untyped-def]
        inference_servers: list[str]) -> None:
    # one step: no sync runs while the groups generate, so a running `generate` activity is on the
    # server (a completion sampled during a sync's verification waits off the server for its verdict)
    # a short outage budget: the groups on the server give up while it is down (the default waits 15 min)
    cfg = tiny_config(tiny_model, steps=1, rollout={"generate_attempts": 2,
                                                                         "outage_budget_s": 3})
    handle = await start_run(temporal_client, cfg)
    record = stack.table.get("inference-0")
    assert record is not None
    await until(lambda: rows(migrated_db, "select 1 from rollout_groups where run_id = :r", r=cfg.name),
                "the first group")
    # a tiny-model call can end between any look and a stop: freeze the server, look, and crash it
    # only while model calls wait on it
    await until(lambda: frozen_with_model_calls_on_it(temporal_client, handle.id, record.pid),
                "model calls in flight", interval_s=0.02)
    monkey = Monkey(stack, pipeline_workers)
    monkey.take_down("inference-0")  # SIGKILL, which also ends a stopped process
    try:
        status = await until(lambda: failed_status(temporal_client, cfg.name), "a group failed for the server")
    finally:
        monkey.bring_back("inference-0")
    assert inference_servers[0] in status.last_group_failure and "cannot reach inference server" in \
        status.last_group_failure, status.last_group_failure
    await run_result(handle, RUN_TIMEOUT_S)  # the sidecar reloads the server; the run goes on
    assert_audit_trail(migrated_db, cfg)
    # model calls that could not connect were run again by their group (an outage, not the call's
    # own error), and the group recorded what it waited out
    failures = rows(migrated_db, "select kind, error_type, message from failures where run_id = :r "
                                 "and (activity = 'generate' or kind = 'outage')", r=cfg.name)
    assert any(f.error_type == "ServerUnavailableError" for f in failures), failures
    assert any(f.kind == "outage" and f.message.endswith("were run again") for f in failures), failures


async def frozen_with_model_calls_on_it(client: Client, run_workflow_id: str, server_pid: int) -> bool:
    """SIGSTOP the server's processes and look: True (the server left stopped) if the run's rollout
    groups have at least two `generate` activities running (one may be reading or writing Postgres
    just before or after its call), else False (the server resumed)."""
    group = os.getpgid(server_pid)
    os.killpg(group, signal.SIGSTOP)
    waiting = False
    try:
        waiting = await generate_activities_running(client, run_workflow_id) >= 2
    finally:
        if not waiting:
            os.killpg(group, signal.SIGCONT)
    return waiting


async def generate_activities_running(client: Client, run_workflow_id: str) -> int:
    running, index = 0, 0
    while True:  # the run's groups, in launch order, up to the first one not started yet
        try:
            described = await client.get_workflow_handle(f"{run_workflow_id}-group-{index}").describe()
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:
                raise
            return running
        running += sum(a.activity_type.name == "generate" and a.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
                       for a in described.raw_description.pending_activities)
        index += 1


async def failed_status(client: Client, run: str) -> Any:
    status = await run_commands.run_status(client, run)
    return status if status.groups_failed else None


@pytest.mark.usefixtures("clean_workflows")
async def test_cancel_during_a_sync_leaves_the_server_serving_a_published_version(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path,  # type: ignore[no-untyped-def]
        inference_servers: list[str], endpoints: Endpoints) -> None:
    cfg = tiny_config(tiny_model, steps=4)
    handle = await start_run(temporal_client, cfg)
    await until(lambda: later_sync_running(handle, migrated_db, cfg.name), "a sync of v1 or later in flight")
    await handle.cancel()
    with pytest.raises(WorkflowFailureError):
        await asyncio.wait_for(handle.result(), RUN_TIMEOUT_S)
    assert (await handle.describe()).status == WorkflowExecutionStatus.CANCELED
    await until(lambda: rows(migrated_db, "select 1 from runs where id = :r and status = 'cancelled'", r=cfg.name),
                "the run's status 'cancelled'")
    published = {v.version for v in rows(migrated_db, "select version from policy_versions where run_id = :r",
                                         r=cfg.name)}
    async with InferenceAdmin(inference_servers[0], token=endpoints.inference_token) as admin, \
            InferenceClient(inference_servers[0], SERVED_MODEL_NAME) as client:
        label = await until(lambda: published_label(admin), "the server back on a published version")
        served = await asyncio.wait_for(client.complete([5] * 8, max_tokens=2), 120)  # not left paused
    assert int(label) in published and served.token_ids, (label, published)  # it may stop at EOS
    for version in published:  # the cancelled run's checkpoints and rows stay
        assert rows(migrated_db, "select 1 from policy_versions where run_id = :r and version = :v",
                    r=cfg.name, v=version)


async def later_sync_running(handle: WorkflowHandle, db: Database, run: str) -> bool:
    if not rows(db, "select 1 from policy_versions where run_id = :r and version >= 1", r=run):
        return False
    described = await handle.describe()
    return any(a.activity_type.name == "sync_weights" and a.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
               for a in described.raw_description.pending_activities)


async def published_label(admin: InferenceAdmin) -> str | None:
    label = await admin.weight_version()
    return label if label.isdigit() else None
