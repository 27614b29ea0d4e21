"""Bounded histories: a rollout group continues-as-new before its history passes
`max_history_events`, keeping every finished turn, and a run continues-as-new between steps even
while its rollouts stay ahead of the trainer. Fake activities, real Temporal dev server."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from dataclasses import replace

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory

from rlpipe.cli.run_commands import start_run
from rlpipe.schemas.payloads import WORKFLOW_QUEUE, GroupInput, GroupSummary
from rlpipe.workflows.rollout_group import RolloutGroupWorkflow
from tests.workflows.fakes import FakeBooks
from tests.workflows.test_training_run_logic import config, fake_pipeline, finished

pytestmark = [pytest.mark.stack, pytest.mark.usefixtures("clean_workflows")]

TURNS = 12  # per sample: eleven model turns that call a tool, then the answer
BOUND = 60  # events: a group of 3 samples x 12 turns needs more than 3 x 12 x 6 (3 per model call, 3 per tool call)
OVERSHOOT = 3 * 12 + 4
"""Events past the bound: each of 3 samples finishes the turn it is in (a model call and a tool call,
3 events each, and a workflow task of 3 events after each), then the hand-over's workflow task
completes with the continued-as-new event (and a slow machine may time one workflow task out)."""


async def executions(client: Client, workflow_id: str, first_run_id: str) -> list[WorkflowHistory]:
    """The histories of the workflow's chain of runs, first to last (followed through each
    continued-as-new event, so visibility's lag does not matter)."""
    chain, run_id = [], first_run_id
    while True:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        chain.append(history)
        last = history.events[-1]
        if last.event_type != EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
            return chain
        run_id = last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id


def patches(history: WorkflowHistory) -> list[str]:
    """The patch ids a run took (`workflow.patched` markers), in order."""
    return [json.loads(e.marker_recorded_event_attributes.details["patch-data"].payloads[0].data)["id"]
            for e in history.events if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED]


def group_input(index: int, max_history_events: int | None) -> GroupInput:
    r = config().rollout
    return GroupInput(
        run_id="bounded", run_workflow_id=f"no-such-run-{uuid.uuid4().hex[:8]}", group_index=index, server="0",
        group_size=3, hedge_samples=0, max_turns=64, group_deadline_s=None, straggler_policy="drop",
        min_partial_samples=2, generate_timeout_s=r.generate_timeout_s, generate_attempts=r.generate_attempts,
        tool_timeout_s=r.tool_timeout_s, tool_attempts=r.tool_attempts, grade_timeout_s=r.grade_timeout_s,
        grade_attempts=r.grade_attempts, max_history_events=max_history_events)


async def play_group(client: Client, inp: GroupInput) -> tuple[GroupSummary, list[WorkflowHistory]]:
    handle = await client.start_workflow(RolloutGroupWorkflow.run, inp, id=f"bounded-group-{uuid.uuid4().hex[:8]}",
                                         task_queue=WORKFLOW_QUEUE)
    summary = await handle.result()
    assert handle.first_execution_run_id is not None
    return summary, await executions(client, handle.id, handle.first_execution_run_id)


async def test_a_group_past_its_history_bound_continues_as_new_keeping_its_turns(temporal_client: Client) -> None:
    books = FakeBooks(tool_turns=TURNS - 1, generate_delay_s=0.0)
    async with fake_pipeline(temporal_client, books):
        unbounded, [one] = await play_group(temporal_client, group_input(0, None))
        n_unbounded = len(books.generated)
        bounded, chain = await play_group(temporal_client, group_input(1, BOUND))

    assert len(one.events) > 2 * BOUND  # the bound below is one the group would pass
    assert len(chain) >= 3, [len(h.events) for h in chain]
    assert all(len(h.events) <= BOUND + OVERSHOOT for h in chain), [len(h.events) for h in chain]
    # no finished turn played again: every sample's turns once each, in order
    turns = Counter(books.generated[n_unbounded:])
    assert turns == Counter((100 + s, t) for s in range(3) for t in range(TURNS))
    # the same result as the group that never continued
    assert replace(bounded, group_index=0) == unbounded
    first, second = books.finished_groups
    assert [i - 100 for i in second.trajectory_ids] == first.trajectory_ids
    assert (second.rewards, second.status, second.reason) == (first.rewards, first.status, first.reason)


async def test_a_group_continued_as_new_keeps_its_deadline_and_hedging(temporal_client: Client) -> None:
    books = FakeBooks(tool_turns=TURNS - 1, generate_delay_s=0.0)
    inp = replace(group_input(2, BOUND), hedge_samples=1, group_deadline_s=600.0)
    async with fake_pipeline(temporal_client, books):
        summary, chain = await play_group(temporal_client, inp)
    assert summary.status == "completed" and len(chain) >= 2
    [closed] = books.finished_groups
    assert len(closed.trajectory_ids) == 3 and len(closed.discarded_ids) == 1  # the first 3 of 4 samples kept
    assert max(Counter(books.generated).values()) == 1


async def test_a_run_bounds_its_groups_histories_from_the_config(temporal_client: Client) -> None:
    books = FakeBooks(tool_turns=TURNS - 1, generate_delay_s=0.0)
    cfg = config(steps=1, rollout={"group_size": 3, "groups_per_step": 1, "max_concurrent_groups": 1,
                                   "max_group_history_events": BOUND})
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        result = await finished(handle)
        group = temporal_client.get_workflow_handle(f"{handle.id}-group-0")
        first_run_id = (await group.describe()).raw_description.workflow_execution_info.first_run_id
        chain = await executions(temporal_client, group.id, first_run_id)
    assert result.steps == 1 and len(chain) >= 3
    assert max(Counter(books.generated).values()) == 1


async def test_a_run_whose_rollouts_stay_ahead_continues_as_new_between_steps(temporal_client: Client) -> None:
    books = FakeBooks(train_delay_s=0.3)  # groups finish far faster than steps: a batch always waits
    cfg = config(steps=5, continue_as_new_every=2, max_staleness=2, sync={"interval": 1})
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        result = await finished(handle)
        assert handle.first_execution_run_id is not None
        chain = await executions(temporal_client, handle.id, handle.first_execution_run_id)
    assert result.steps == 5 and len(chain) == 3  # continued after steps 2 and 4
    # it continued with a batch ready to train (the new path; the old one trained on instead)
    assert all("continue-as-new-between-steps" in patches(h) for h in chain[:2]), [patches(h) for h in chain]
    assert sorted(g["claimed"] for g in books.groups.values() if g["claimed"]) == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
