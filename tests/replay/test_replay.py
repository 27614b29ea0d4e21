"""Replay committed histories of representative runs against the current workflow code.

A change to workflow code that would break the determinism of runs already in flight (a new
activity call, a reordered await, a removed timer) fails here instead of in production. To
change workflow code on purpose, guard the new path with `workflow.patched("...")` (see
docs/workflow-changes.md) or re-record with `python -m tests.replay.record_histories`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from rlpipe.workers.common import data_converter, workflow_runner
from rlpipe.workflows.rollout_group import RolloutGroupWorkflow
from rlpipe.workflows.training_run import TrainingRunWorkflow

HISTORY_DIR = Path(__file__).resolve().parent / "histories"
WORKFLOW_IDS: dict[str, str] = json.loads((HISTORY_DIR / "workflow_ids.json").read_text())
HISTORIES = [HISTORY_DIR / name for name in sorted(WORKFLOW_IDS)]


def test_the_representative_histories_are_committed() -> None:
    assert all(path.exists() for path in HISTORIES)
    names = {path.name.split("-")[0] for path in HISTORIES}
    assert {"async", "sync", "multi_turn", "continue_as_new", "ahead", "group_continue_as_new"} <= names
    assert len([p for p in HISTORIES if p.name.startswith("group_continue_as_new-group0-run")]) >= 2


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem)
async def test_history_replays_deterministically(path: Path) -> None:
    history = WorkflowHistory.from_json(WORKFLOW_IDS[path.name], path.read_text())
    replayer = Replayer(workflows=[TrainingRunWorkflow, RolloutGroupWorkflow], data_converter=data_converter(),
                        workflow_runner=workflow_runner())
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name}: {result.replay_failure}"
