"""Whole training runs on the real stack: Temporal, Postgres, SeaweedFS, a vLLM server with the
tiny model, and the worker processes. Assertions read the audit trail in Postgres."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client, WorkflowExecutionStatus

from rlpipe.cli.run_commands import start_run
from rlpipe.inference.client import InferenceClient
from rlpipe.infra.inference import SERVED_MODEL_NAME
from rlpipe.infra.process import free_port
from rlpipe.infra.temporal import temporal_binary
from rlpipe.observe.queries import group_counts
from rlpipe.policy.checkpoint import WEIGHTS_FILE
from rlpipe.rl.advantages import overlong_penalty
from rlpipe.schemas.algorithm import OverlongConfig
from rlpipe.schemas.config import RunConfig
from rlpipe.schemas.payloads import WORKFLOW_QUEUE
from rlpipe.storage import buffer
from rlpipe.storage.db import Database
from rlpipe.storage.runs import register_run
from rlpipe.tracking.cursor import tracker_lines
from rlpipe.tracking.follow import advance, catch_up
from rlpipe.tracking.sinks import open_sink
from tests.integration.runs import RUN_TIMEOUT_S, assert_audit_trail, rows, run_to_end, tiny_config
from tests.integration.tracking_checks import assert_tensorboard_shows, tensorboard_steps
from tests.waiting import run_result

pytestmark = [pytest.mark.stack, pytest.mark.vllm, pytest.mark.usefixtures("clean_workflows")]


async def test_async_run_completes_with_a_consistent_audit_trail(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path,
        inference_servers: list[str]) -> None:
    cfg = tiny_config(tiny_model)
    handle = await start_run(temporal_client, cfg)
    result = await run_result(handle, RUN_TIMEOUT_S)
    assert result.steps == cfg.steps
    assert_audit_trail(migrated_db, cfg)
    # the server now serves the last version: its greedy output equals transformers' on those weights
    probe = rows(migrated_db, "select probe from policy_versions where run_id = :r and version = :v",
                 r=cfg.name, v=cfg.steps)[0].probe
    async with InferenceClient(inference_servers[0], SERVED_MODEL_NAME) as client:
        served = await client.complete(probe["prompt_ids"], max_tokens=len(probe["greedy_ids"]), temperature=0.0,
                                       ignore_eos=True)
        assert served.token_ids == probe["greedy_ids"]
        assert await client.weight_version() == str(cfg.steps)


@pytest.mark.parametrize("objective", [{"ratio_level": "sequence", "clip_low": 3e-3, "clip_high": 4e-3},
                                       {"policy_loss": "cispo"}], ids=["gspo", "cispo"])
async def test_gspo_and_cispo_runs_complete_with_verified_syncs(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path,
        objective: dict[str, object]) -> None:
    cfg = tiny_config(tiny_model, steps=2, loss=objective)
    await run_to_end(temporal_client, cfg)
    assert_audit_trail(migrated_db, cfg)
    metrics = [r.metrics for r in rows(migrated_db, "select metrics from train_steps where run_id = :r", r=cfg.name)]
    assert len(metrics) == cfg.steps and all("clip_seq_frac" in m for m in metrics)


async def test_a_bf16_trainer_publishing_bf16_weights_syncs_at_the_fp32_bound(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path) -> None:
    """bf16 compute and half-size bf16 checkpoints; the session's fp32 server verifies each one at the
    fp32 bound (assert_audit_trail), since the trainer probes the published bytes in fp32."""
    cfg = tiny_config(tiny_model, steps=2, batch={"precision": "bf16"}, sync={"weights_dtype": "bfloat16"})
    await run_to_end(temporal_client, cfg)
    assert_audit_trail(migrated_db, cfg)
    fp32_bytes = (tiny_model / WEIGHTS_FILE).stat().st_size
    sizes = [r.size_bytes for r in rows(migrated_db, "select size_bytes from policy_versions where run_id = :r",
                                        r=cfg.name)]
    assert len(sizes) == cfg.steps + 1 and all(size < 0.6 * fp32_bytes for size in sizes)


async def test_overlong_shaping_and_truncation_masking_reach_the_buffer_and_the_loss(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path) -> None:
    # the tiny model's answers are 5-8 tokens: a budget of 12 with a window of 8 punishes most of them a
    # little, and a 6-token sampling limit cuts some off
    overlong = OverlongConfig(max_tokens=12, window=8, penalty=0.5)
    cfg = tiny_config(tiny_model, steps=2, sampling={"max_tokens": 6},
                      advantage={"overlong": overlong.model_dump()}, loss={"mask_truncated": True})
    await run_to_end(temporal_client, cfg)
    assert_audit_trail(migrated_db, cfg)
    kept = rows(migrated_db, "select t.reward, t.loss_mask, t.finish_reason, g.score from trajectories t "
                             "join grades g on g.trajectory_id = t.id where t.run_id = :r and t.reward is not null",
                r=cfg.name)
    assert kept
    for t in kept:  # the stored reward is the grader's score plus the length penalty
        assert t.reward == pytest.approx(t.score + overlong_penalty(sum(t.loss_mask), overlong))
    assert any(t.reward != t.score for t in kept), "no trajectory reached the punished window"
    steps = rows(migrated_db, "select step, metrics from train_steps where run_id = :r order by step", r=cfg.name)
    trained = {r.step: rows(migrated_db, "select t.loss_mask, t.finish_reason from trajectories t join rollout_groups "
                                         "g on g.id = t.group_id where g.run_id = :r and g.claimed_step = :s and "
                                         "t.status = 'completed'", r=cfg.name, s=r.step)
               for r in steps}
    assert any(t.finish_reason == "length" for batch in trained.values() for t in batch), "nothing was truncated"
    for step in steps:  # truncated completions add no loss tokens
        batch = trained[step.step]
        assert step.metrics["num_loss_tokens"] == sum(sum(t.loss_mask) for t in batch if t.finish_reason != "length")
        assert step.metrics["truncated_frac"] == pytest.approx(
            sum(t.finish_reason == "length" for t in batch) / len(batch))


async def test_dynamic_sampling_trains_only_on_informative_groups(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path) -> None:
    # two samples per prompt: most groups of the tiny model are uniform (about 5 in 6 all wrong); a budget
    # that is never reached, so that every consumed group must be informative
    cfg = tiny_config(tiny_model, steps=3,
                      rollout={"group_size": 2, "groups_per_step": 2, "dynamic_sampling": True,
                               "dynamic_sampling_budget": 10_000})
    await run_to_end(temporal_client, cfg)
    assert_audit_trail(migrated_db, cfg)
    groups = rows(migrated_db, "select status, status_reason, claimed_step, reward_std from rollout_groups "
                               "where run_id = :r", r=cfg.name)
    consumed = [g for g in groups if g.claimed_step is not None]
    assert len(consumed) == cfg.steps * 2 and all(g.reward_std > 0 for g in consumed), consumed
    skipped = [g for g in groups if g.status == "dropped" and g.status_reason.startswith("uninformative")]
    assert skipped and all(g.reward_std == 0 and g.claimed_step is None for g in skipped)
    with migrated_db.begin() as s:
        assert group_counts(s, cfg.name).uninformative_dropped == len(skipped)


def test_dynamic_sampling_keeps_a_group_once_its_budget_is_spent(migrated_db: Database) -> None:
    cfg = RunConfig(name=f"ds-{uuid.uuid4().hex[:8]}")
    with migrated_db.begin() as s:
        register_run(s, cfg)
    verdicts = []
    for index in range(3):   # budget 2: two uniform groups in a row are dropped, the third is kept
        with migrated_db.begin() as s:
            buffer.start_group(s, run_id=cfg.name, group_index=index, prompt_index=index, task_id=f"t{index}",
                               workflow_id=f"w{index}", n_samples=2, prompt_ids=[1])
            status, reason = buffer.admit_uninformative(s, run_id=cfg.name, group_index=index, rewards=[1.0, 1.0],
                                                        budget=2)
            buffer.finish_group(s, run_id=cfg.name, group_index=index, samples=[], discarded_ids=[], status=status,
                                reason=reason)
            verdicts.append((status, reason))
    assert verdicts[:2] == [("dropped", "uninformative: all 2 rewards are 1")] * 2
    assert verdicts[2] == ("completed", None)
    [failure] = rows(migrated_db, "select kind, message from failures where run_id = :r", r=cfg.name)
    assert failure.kind == "dynamic_sampling" and "rollout.dynamic_sampling_budget=2" in failure.message
    with migrated_db.begin() as s:   # a kept group starts the count again
        assert buffer.uninformative_in_a_row(s, cfg.name) == 0


async def test_sync_mode_never_overlaps_training_and_rollouts(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path) -> None:
    cfg = tiny_config(tiny_model, mode="sync", max_staleness=0)
    await run_to_end(temporal_client, cfg)
    assert_audit_trail(migrated_db, cfg)
    assert rows(migrated_db, "select max(staleness) as m from v_version_lag where run_id = :r", r=cfg.name)[0].m == 0
    # every model call of the groups a step trains on happened after the previous step and its sync
    overlaps = rows(migrated_db, """
        select g.group_index, s.step, tu.created_at, e.finished_at as synced_at
        from rollout_groups g
        join trajectories t on t.group_id = g.id
        join turns tu on tu.trajectory_id = t.id
        join train_steps s on s.run_id = g.run_id and s.step = g.claimed_step - 1
        join sync_events e on e.run_id = g.run_id and e.version = s.published_version
        where g.run_id = :r and tu.created_at - tu.generate_latency_s * interval '1 second' < e.finished_at
    """, r=cfg.name)
    assert overlaps == []
    windows = rows(migrated_db, "select started_at, finished_at from train_steps where run_id = :r", r=cfg.name)
    calls = rows(migrated_db, "select tu.created_at - tu.generate_latency_s * interval '1 second' as began, "
                              "tu.created_at as ended from turns tu join trajectories t on t.id = tu.trajectory_id "
                              "where t.run_id = :r", r=cfg.name)
    for w in windows:
        assert not any(c.began < w.finished_at and c.ended > w.started_at for c in calls), "generation during training"


async def test_run_started_with_json_input_like_the_web_ui(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path, endpoints) -> None:  # type: ignore[no-untyped-def]
    cfg = tiny_config(tiny_model, steps=2)
    payload = json.dumps(cfg.model_dump(mode="json"))
    subprocess.run([temporal_binary(), "workflow", "start", "--address", endpoints.temporal_address,
                    "--type", "TrainingRunWorkflow", "--task-queue", WORKFLOW_QUEUE,
                    "--workflow-id", cfg.workflow_id, "--input", payload], check=True, capture_output=True)
    handle = temporal_client.get_workflow_handle(cfg.workflow_id)
    result = await run_result(handle, RUN_TIMEOUT_S)
    assert result["steps"] == 2 if isinstance(result, dict) else result.steps == 2
    assert_audit_trail(migrated_db, cfg)


async def test_json_input_with_a_bad_field_fails_the_run_naming_it(
        temporal_client: Client, pipeline_workers, endpoints) -> None:  # type: ignore[no-untyped-def]
    workflow_id = f"run-bad-{uuid.uuid4().hex[:8]}"
    payload = json.dumps({"name": "bad", "rollout": {"group_sise": 4}})
    subprocess.run([temporal_binary(), "workflow", "start", "--address", endpoints.temporal_address,
                    "--type", "TrainingRunWorkflow", "--task-queue", WORKFLOW_QUEUE,
                    "--workflow-id", workflow_id, "--input", payload], check=True, capture_output=True)
    handle = temporal_client.get_workflow_handle(workflow_id)
    with pytest.raises(Exception) as caught:
        await asyncio.wait_for(handle.result(), 60)
    assert "rollout.group_sise" in str(caught.value.__cause__ or caught.value)


async def test_trainer_killed_during_a_step_is_replaced_and_the_step_commits_once(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path, tmp_path: Path) -> None:
    from rlpipe.infra.process import kill

    # the experiment trackers ride along (issue #23): TensorBoard, and an MLflow server that is not there
    cfg = tiny_config(tiny_model, steps=4, rollout={"group_size": 8, "groups_per_step": 4},
                      sampling={"max_tokens": 48}, tracking=["tensorboard", "mlflow"],
                      trackers={"tensorboard": {"log_dir": str(tmp_path / "tb")},
                                "mlflow": {"tracking_uri": f"http://127.0.0.1:{free_port()}"}})
    handle = await start_run(temporal_client, cfg)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    killed_mid_step = None
    while killed_mid_step is None:
        assert time.monotonic() < deadline, "never caught a train step in flight"
        if not await _train_step_running(handle):
            await asyncio.sleep(0.05)
            continue
        committed = _committed_steps(migrated_db, cfg.name)
        assert kill(pipeline_workers.table.get("trainer"))  # SIGKILL
        if _committed_steps(migrated_db, cfg.name) == committed:  # the step had not committed: mid-step
            killed_mid_step = committed + 1
        pipeline_workers.up(only=["trainer"], progress=lambda msg: None)
    result = await run_result(handle, RUN_TIMEOUT_S)
    assert result.steps == cfg.steps
    assert_audit_trail(migrated_db, cfg)  # (run, step) committed once each: n_groups per step exact
    assert (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED
    attempts = rows(migrated_db, "select count(*) as n from activity_spans where run_id = :r and activity = "
                                 "'train_step'", r=cfg.name)[0].n
    assert attempts == cfg.steps, "the killed attempt leaves no span; every step has one finished attempt"
    assert_tracked(migrated_db, cfg, tmp_path)


def assert_tracked(db: Database, cfg: RunConfig, tmp_path: Path) -> None:
    """TensorBoard has every step once, the held-out accuracy of the evaluated versions and every sync,
    and shows the reward and accuracy charts; the unreachable MLflow left the run going, with one
    `failures` row and a warning for `rlpipe run status`."""
    assert catch_up(db, cfg.name, "tensorboard", open_sink("tensorboard", cfg.name, cfg.trackers)) == "idle"
    assert advance(db, cfg.name, "mlflow", open_sink("mlflow", cfg.name, cfg.trackers), wait=True) == "failed"
    logged = tensorboard_steps(tmp_path / "tb" / cfg.name)
    every_step = list(range(1, cfg.steps + 1))
    for tag in ("train/loss", "train/reward_mean", "reward/p50", "train/tokens_per_s", "phase/engine_s",
                "box/grader_share"):
        assert logged[tag] == every_step, (tag, logged[tag])
    assert logged["heldout/eval/accuracy"] == [0, cfg.steps]  # the base and the final version, at their steps
    published = sorted(r.trained_steps for r in rows(db, "select trained_steps from policy_versions where "
                                                         "run_id = :r", r=cfg.name))
    assert sorted(logged["sync/0/verified"]) == published
    assert all(len(steps) == len(set(steps)) for steps in logged.values()), "a point logged twice"
    failures = rows(db, "select message from failures where run_id = :r and kind = 'tracking'", r=cfg.name)
    assert len(failures) == 1 and "tracker mlflow failed" in failures[0].message
    with db.begin() as s:
        assert [(line.split(":")[0], warning) for line, warning in tracker_lines(s, cfg.name)] == \
            [("mlflow", True), ("tensorboard", False)]
    assert_tensorboard_shows(tmp_path / "tb", ["train/reward_mean", "heldout/eval/accuracy"], tmp_path)


async def _train_step_running(handle) -> bool:  # type: ignore[no-untyped-def]
    described = await handle.describe()
    return any(a.activity_type.name == "train_step" and a.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
               for a in described.raw_description.pending_activities)


def _committed_steps(db: Database, run: str) -> int:
    return rows(db, "select count(*) as n from train_steps where run_id = :r", r=run)[0].n
