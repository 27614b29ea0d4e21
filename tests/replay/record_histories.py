"""Record the Temporal histories that tests/replay/test_replay.py replays against the current
workflow code: an async run, a sync run, a multi-turn run and a run that continues-as-new, each
with one of its rollout groups. Re-record when workflow code changes on purpose (and guard the
change with `workflow.patched` first, see docs/workflow-changes.md), on a stack of its own so no
real worker takes the fakes' tasks:

    RLPIPE_HOME=/tmp/rlpipe-replay python -m tests.replay.record_histories
    RLPIPE_HOME=/tmp/rlpipe-replay rlpipe stack down
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

from temporalio.client import Client

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
}


async def record(client: Client, name: str) -> dict[str, str]:
    """Run case `name` on fakes; write its histories; return file name -> workflow id."""
    overrides, books = CASES[name]
    cfg = config(name=f"replay-{name.replace('_', '-')}-{uuid.uuid4().hex[:6]}", **overrides)
    async with fake_pipeline(client, books):
        await finished(await start_run(client, cfg))
    written = {}
    runs = [wf async for wf in client.list_workflows(f"WorkflowId = '{cfg.workflow_id}'")]
    for index, run in enumerate(sorted(runs, key=lambda r: r.start_time)):
        history = await client.get_workflow_handle(cfg.workflow_id, run_id=run.run_id).fetch_history()
        written[f"{name}-run{index}.json"] = (cfg.workflow_id, history.to_json())
    group_id = f"{cfg.workflow_id}-group-0"
    written[f"{name}-group0.json"] = (group_id, (await client.get_workflow_handle(group_id).fetch_history()).to_json())
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
