"""Record the Temporal histories that tests/replay/test_replay.py replays against the current
workflow code: an async run, a sync run, a multi-turn run, a run that continues-as-new, one that
continues-as-new between steps with its rollouts ahead of the trainer, and one whose rollout groups
continue-as-new (every run of the chain), each with one of its rollout groups. Re-record when
workflow code changes on purpose (and guard the change with `workflow.patched` first, see
docs/workflow-changes.md), on a stack of its own so no real worker takes the fakes' tasks:

    RLPIPE_HOME=/tmp/rlpipe-replay python -m tests.replay.record_histories
    RLPIPE_HOME=/tmp/rlpipe-replay rlpipe stack down
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory

from rlpipe.cli.run_commands import start_run
from rlpipe.workers.common import connect
from tests.workflows.fakes import FakeBooks
from tests.workflows.test_training_run_logic import config, fake_pipeline, finished

OUT = Path(__file__).resolve().parent / "histories"
WORKFLOW_IDS = OUT / "workflow_ids.json"
"""file name -> workflow id: a history replays under the id it ran with (child ids derive from it)."""

CASES = {
    "async": (dict(steps=3), FakeBooks()),
    "sync": (dict(mode="sync", max_staleness=0, steps=2), FakeBooks()),
    "multi_turn": (dict(steps=2), FakeBooks(tool_turns=2)),
    "continue_as_new": (dict(steps=3, continue_as_new_every=1), FakeBooks()),
    "ahead": (dict(steps=4, continue_as_new_every=2, max_staleness=2), FakeBooks(train_delay_s=0.3)),
    "group_continue_as_new": (dict(steps=1, rollout={"group_size": 3, "groups_per_step": 1, "max_concurrent_groups": 1,
                                                     "max_group_history_events": 60}), FakeBooks(tool_turns=5)),
}


async def chain(client: Client, workflow_id: str) -> list[WorkflowHistory]:
    """The histories of every run of `workflow_id`, first to last, through its continue-as-new events."""
    description = await client.get_workflow_handle(workflow_id).describe()
    run_id, histories = description.raw_description.workflow_execution_info.first_run_id, []
    while True:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        histories.append(history)
        last = history.events[-1]
        if last.event_type != EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
            return histories
        run_id = last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id


async def record(client: Client, name: str) -> dict[str, str]:
    """Run case `name` on fakes; write its histories; return file name -> workflow id."""
    overrides, books = CASES[name]
    cfg = config(name=f"replay-{name.replace('_', '-')}-{uuid.uuid4().hex[:6]}", **overrides)
    async with fake_pipeline(client, books):
        await finished(await start_run(client, cfg))
    written = {}
    for index, history in enumerate(await chain(client, cfg.workflow_id)):
        written[f"{name}-run{index}.json"] = (cfg.workflow_id, history.to_json())
    group_id = f"{cfg.workflow_id}-group-0"
    group_runs = await chain(client, group_id)
    for index, history in enumerate(group_runs):  # a group that continued-as-new: each of its runs
        written[f"{name}-group0{f'-run{index}' if len(group_runs) > 1 else ''}.json"] = (group_id, history.to_json())
    for file, (_, text) in written.items():
        (OUT / file).write_text(text)
    return {file: workflow_id for file, (workflow_id, _) in written.items()}


async def record_all(client: Client) -> None:
    OUT.mkdir(exist_ok=True)
    ids: dict[str, str] = {}
    for name in CASES:
        ids |= await record(client, name)
        print(f"recorded {name}")
    WORKFLOW_IDS.write_text(json.dumps(ids, indent=1, sort_keys=True) + "\n")


def main() -> None:
    from rlpipe.infra.endpoints import resolve_endpoints
    from rlpipe.infra.settings import load_settings
    from rlpipe.infra.stack import Stack

    settings = load_settings()
    Stack(settings).up(progress=print)  # the fakes need only Temporal; `up` keeps the stack whole

    async def record_on_stack() -> None:
        await record_all(await connect(resolve_endpoints(settings)))

    asyncio.run(record_on_stack())


if __name__ == "__main__":
    main()
