"""Agentic rollouts on the real stack: multi-turn tool use with token-level masks, a rollout
worker killed mid-group, injected long-tail tool latency under a group deadline, and the grader
box (cache hits, a failing grader retried and recorded)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from rlpipe.cli.run_commands import start_run
from rlpipe.infra.process import kill
from rlpipe.storage.db import Database
from tests.integration.runs import RUN_TIMEOUT_S, assert_audit_trail, rows, run_to_end, tiny_config
from tests.waiting import run_result

pytestmark = [pytest.mark.stack, pytest.mark.vllm, pytest.mark.usefixtures("clean_workflows")]


async def test_multi_turn_tool_run_masks_tool_tokens_out_of_the_loss(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path) -> None:
    cfg = tiny_config(tiny_model, "tiny-calculator.toml", steps=2)
    await run_to_end(temporal_client, cfg)
    assert_audit_trail(migrated_db, cfg)
    tool_turns = rows(migrated_db, """
        select t.id, t.completion_ids, t.loss_mask, t.sampler_logprobs
        from trajectories t where t.run_id = :r and t.status = 'completed' and t.n_turns >= 2""", r=cfg.name)
    assert tool_turns, "the model never called the calculator"
    for traj in tool_turns:
        turns = rows(migrated_db, "select turn_index, input_ids, output_ids, tool_calls from turns "
                                  "where trajectory_id = :t order by turn_index", t=traj.id)
        assert turns[0].tool_calls and turns[0].tool_calls[0]["result"] is not None
        expected_mask: list[int] = []
        for turn in turns:  # observation tokens (input of turns >= 1) are 0, model tokens 1
            if turn.turn_index > 0:
                expected_mask += [0] * len(turn.input_ids)
            expected_mask += [1] * len(turn.output_ids)
        assert traj.loss_mask == expected_mask
        assert all(lp == 0 for lp, m in zip(traj.sampler_logprobs, traj.loss_mask) if m == 0)
        observation = [i for i, m in zip(traj.completion_ids, traj.loss_mask) if m == 0]
        assert observation == [i for turn in turns[1:] for i in turn.input_ids]


async def test_rollout_worker_killed_mid_group_never_regenerates_a_finished_turn(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path) -> None:
    # a slow tool keeps groups in flight for seconds, so the kill lands between turns
    cfg = tiny_config(tiny_model, "tiny-calculator.toml", steps=2,
                      rollout={"tool_latency": {"kind": "constant", "seconds": 1.0}})
    handle = await start_run(temporal_client, cfg)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while rows(migrated_db, "select count(*) as n from turns tu join trajectories t on t.id = tu.trajectory_id "
                            "where t.run_id = :r", r=cfg.name)[0].n < 4:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    turns_before = rows(migrated_db, "select tu.trajectory_id, tu.turn_index, tu.output_ids from turns tu "
                                     "join trajectories t on t.id = tu.trajectory_id where t.run_id = :r", r=cfg.name)
    assert kill(pipeline_workers.table.get("rollout"))  # SIGKILL: workflows and generation go down together
    pipeline_workers.up(only=["rollout"], progress=lambda msg: None)
    await run_result(handle, RUN_TIMEOUT_S)
    assert_audit_trail(migrated_db, cfg)

    after = {(r.trajectory_id, r.turn_index): r.output_ids for r in rows(
        migrated_db, "select tu.trajectory_id, tu.turn_index, tu.output_ids from turns tu join trajectories t "
                     "on t.id = tu.trajectory_id where t.run_id = :r", r=cfg.name)}
    for turn in turns_before:  # finished turns are kept as they were sampled
        assert after[(turn.trajectory_id, turn.turn_index)] == turn.output_ids
    groups = rows(migrated_db, "select workflow_id from rollout_groups where run_id = :r", r=cfg.name)
    for group in groups:  # the history schedules one generate per (trajectory, turn), even across the crash
        scheduled = await _scheduled_generates(temporal_client, group.workflow_id)
        assert len(scheduled) == len(set(scheduled)), f"{group.workflow_id} generated a turn twice"


async def _scheduled_generates(client: Client, workflow_id: str) -> list[tuple[int, int]]:
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    converter = client.data_converter
    keys = []
    for event in history.events:
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = event.activity_task_scheduled_event_attributes
            if attrs.activity_type.name == "generate":
                (payload,) = await converter.decode(attrs.input.payloads)
                keys.append((payload["trajectory_id"], payload["turn_index"]))
    return keys


async def test_long_tail_tool_latency_is_governed_by_the_group_deadline(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path) -> None:
    cfg = tiny_config(tiny_model, "tiny-calculator.toml", steps=2,
                      # P(one call > 2.5 s) = P(z > ln 2.5) = 18 %: over the ~20 calls of a run, a straggler
                      # is all but certain (P(none) < 2 %), and the run still takes seconds, not minutes
                      rollout={"tool_latency": {"kind": "lognormal", "median_seconds": 1.0, "sigma": 1.0, "seed": 3},
                               "group_deadline_s": 2.5, "straggler_policy": "partial", "min_partial_samples": 2})
    await run_to_end(temporal_client, cfg)
    assert_audit_trail(migrated_db, cfg)
    outcome = rows(migrated_db, """
        select count(*) filter (where status_reason like 'partial group%') as partial,
               count(*) filter (where status in ('dropped', 'failed')) as lost,
               count(*) filter (where status = 'completed') as completed
        from rollout_groups where run_id = :r""", r=cfg.name)[0]
    stragglers = rows(migrated_db, "select count(*) as n from failures where run_id = :r and kind = 'straggler'",
                      r=cfg.name)[0].n
    assert outcome.partial + outcome.lost > 0, "no group hit the deadline: the latency tail was not exercised"
    assert stragglers == outcome.partial + outcome.lost  # every straggler decision is on record
    partial_sizes = rows(migrated_db, "select n_completed from rollout_groups where run_id = :r and status_reason "
                                      "like 'partial group%'", r=cfg.name)
    assert all(2 <= g.n_completed < cfg.rollout.group_size for g in partial_sizes)
