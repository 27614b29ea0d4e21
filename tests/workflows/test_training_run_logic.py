"""The TrainingRun/RolloutGroup orchestration on the real Temporal dev server, with every
activity replaced by an in-memory fake (the workflows' own logic is what is under test)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Worker

from rlpipe.cli.run_commands import RunCommandError, cancel, find_run, run_status, start_run
from rlpipe.schemas.config import RunConfig, parse_run_config
from rlpipe.schemas.payloads import (
    GRADER_QUEUE,
    ROLLOUT_QUEUE,
    SANDBOX_QUEUE,
    TRAINER_QUEUE,
    WORKFLOW_QUEUE,
    DrainRequest,
    JoinRequest,
    PauseRequest,
    RunResult,
    RunStatus,
    ScheduleUpdate,
    ServerState,
    sync_queue,
)
from rlpipe.workers.common import workflow_runner
from rlpipe.workflows.rollout_group import RolloutGroupWorkflow
from rlpipe.workflows.training_run import SERVER_STATE_SIGNAL, TrainingRunWorkflow
from tests.waiting import RunStalled, run_result, until
from tests.workflows.fakes import FakeBooks

RESULT_TIMEOUT_S = 120
pytestmark = [pytest.mark.stack, pytest.mark.usefixtures("clean_workflows")]


@asynccontextmanager
async def fake_pipeline(client: Client, books: FakeBooks) -> AsyncIterator[None]:
    queues = [WORKFLOW_QUEUE, ROLLOUT_QUEUE, SANDBOX_QUEUE, GRADER_QUEUE, TRAINER_QUEUE,
              *(sync_queue(server) for server in books.servers + books.spare)]
    workers = [Worker(client, task_queue=q, activities=books.activities(),
                      workflows=[TrainingRunWorkflow, RolloutGroupWorkflow] if q == WORKFLOW_QUEUE else [],
                      workflow_runner=workflow_runner()) for q in queues]
    tasks = [asyncio.create_task(w.run()) for w in workers]
    try:
        yield
    finally:
        for w in workers:
            await w.shutdown()
        await asyncio.gather(*tasks, return_exceptions=True)


def config(**overrides: object) -> RunConfig:
    base = {"name": f"logic-{uuid.uuid4().hex[:8]}", "steps": 4,
            "rollout": {"group_size": 2, "groups_per_step": 2, "max_concurrent_groups": 8}}
    return parse_run_config(base | overrides)


async def finished(handle: WorkflowHandle) -> RunResult:
    """The run's result; a run that pauses or fails ends the wait at once, one that stalls
    otherwise (an activity no fake serves) in RESULT_TIMEOUT_S."""
    return await run_result(handle, RESULT_TIMEOUT_S)


def consumed_staleness(books: FakeBooks) -> dict[int, int]:
    """group -> staleness at the step that consumed it."""
    return {i: (g["claimed"] - 1) - books.version_steps[g["version"]]
            for i, g in books.groups.items() if g["claimed"] is not None}


async def test_async_run_trains_every_step_within_the_staleness_bound(temporal_client: Client) -> None:
    books = FakeBooks()
    cfg = config(max_staleness=1)
    async with fake_pipeline(temporal_client, books):
        result = await finished(await start_run(temporal_client, cfg))
    assert (result.steps, result.version) == (4, 4)
    claimed = [g["claimed"] for g in books.groups.values() if g["claimed"] is not None]
    assert sorted(claimed) == [1, 1, 2, 2, 3, 3, 4, 4]  # each step its batch, no group twice
    assert max(consumed_staleness(books).values()) <= 1
    assert books.statuses[-1] == "completed"
    assert [i for _, kind, i in books.events if kind == "eval"] == [0, 4]  # the base and the final version


async def test_sync_mode_never_overlaps_rollouts_and_training(temporal_client: Client) -> None:
    books = FakeBooks()
    async with fake_pipeline(temporal_client, books):
        await finished(await start_run(temporal_client, config(mode="sync")))
    assert set(consumed_staleness(books).values()) == {0}
    busy = []  # (start, end) of each train step through the end of the sync it published
    starts = {i: t for t, kind, i in books.events if kind == "train_start"}
    sync_ends = {i: t for t, kind, i in books.events if kind == "sync_end"}
    for step, start in starts.items():
        busy.append((start, sync_ends[step]))  # step s publishes version s
    for t, kind, index in books.events:
        if kind == "group_start":
            assert not any(a < t < b for a, b in busy), f"group {index} started during a train/sync window"


async def test_budget_admits_no_more_than_the_staleness_rule(temporal_client: Client) -> None:
    """With max_staleness 0 in async mode and a slow trainer, at most one batch is ever ahead."""
    books = FakeBooks(train_delay_s=0.3)
    cfg = config(mode="async", max_staleness=0, steps=3)
    async with fake_pipeline(temporal_client, books):
        await finished(await start_run(temporal_client, cfg))
    assert set(consumed_staleness(books).values()) == {0}
    assert len(books.groups) == 6  # exactly the groups needed: none generated and thrown away


async def test_continue_as_new_carries_state_and_in_flight_groups(temporal_client: Client) -> None:
    books = FakeBooks()
    cfg = config(steps=5, continue_as_new_every=2)
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        first_run = (await handle.describe()).run_id
        result = await finished(handle)
        last_run = (await temporal_client.get_workflow_handle(cfg.workflow_id).describe()).run_id
    assert result.steps == 5 and first_run != last_run
    assert sorted(g["claimed"] for g in books.groups.values() if g["claimed"]) == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]


async def test_pause_stops_new_groups_and_resume_finishes(temporal_client: Client) -> None:
    books = FakeBooks(generate_delay_s=0.05)
    cfg = config(steps=3)
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        while not books.groups:
            await asyncio.sleep(0.05)
        status = await handle.execute_update(TrainingRunWorkflow.pause, PauseRequest("maintenance"))
        assert status.paused and status.pause_reason == "maintenance"
        with pytest.raises(WorkflowUpdateFailedError):
            await handle.execute_update(TrainingRunWorkflow.pause, PauseRequest("again"))
        await asyncio.sleep(0.5)  # in-flight groups drain
        started = len(books.groups)
        await asyncio.sleep(0.5)
        assert len(books.groups) == started, "groups started while paused"
        assert (await handle.query(TrainingRunWorkflow.status)).phase == "paused"
        await handle.execute_update(TrainingRunWorkflow.resume)
        result = await finished(handle)
    assert result.steps == 3 and "paused" in books.statuses


def every_group_failing_config(pause_after: int, max_concurrent_groups: int) -> RunConfig:
    """Two steps of two groups, for books whose grading always fails: the run pauses after `pause_after`."""
    return config(steps=2, rollout={"group_size": 2, "groups_per_step": 2, "pause_after_failed_groups": pause_after,
                                    "max_concurrent_groups": max_concurrent_groups})


async def test_a_run_whose_every_group_fails_pauses_saying_why(temporal_client: Client) -> None:
    books = FakeBooks(grading_error="grader 'judge' produced an invalid grade '<'")
    cfg = every_group_failing_config(pause_after=3, max_concurrent_groups=4)
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        status = await handle.query(TrainingRunWorkflow.status)
        while not status.paused:
            await asyncio.sleep(0.05)
            status = await handle.query(TrainingRunWorkflow.status)
        assert status.pause_reason is not None and "groups in a row failed" in status.pause_reason
        assert "invalid grade '<'" in status.pause_reason, status.pause_reason
        await asyncio.sleep(0.5)  # the groups in flight end; no new one starts
        started = len(books.groups)
        await asyncio.sleep(0.5)
        assert len(books.groups) == started <= 4 + 3, "groups started while paused for failures"
        assert books.statuses[-1] == "paused" and status.step == 0
        books.grading_error = None  # the grader is mended: resuming starts the count again
        await handle.execute_update(TrainingRunWorkflow.resume)
        result = await finished(handle)
    assert result.steps == 2 and result.groups_failed == started


async def test_waiting_on_a_run_that_pauses_fails_at_once_quoting_the_reason(temporal_client: Client) -> None:
    books = FakeBooks(grading_error="grader 'judge' produced an invalid grade 'I agree'")
    cfg = every_group_failing_config(pause_after=2, max_concurrent_groups=2)
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        with pytest.raises(RunStalled, match=r"paused at step 0/2: paused after 2 groups in a row failed") as stalled:
            await run_result(handle, timeout_s=RESULT_TIMEOUT_S, poll_s=0.1)  # not a TimeoutError after 120 s
        status = await handle.query(TrainingRunWorkflow.status)
        await handle.cancel()
    assert status.paused and status.pause_reason is not None and status.pause_reason in str(stalled.value)
    assert "invalid grade 'I agree'" in str(stalled.value)


async def test_waiting_on_a_run_that_fails_quotes_the_failure(temporal_client: Client) -> None:
    async with fake_pipeline(temporal_client, FakeBooks()):
        handle = await temporal_client.start_workflow(  # the Web UI's form: one JSON argument, a bad field
            "TrainingRunWorkflow", {"name": "bad", "rollout": {"group_sise": 4}},
            id=f"run-bad-{uuid.uuid4().hex[:8]}", task_queue=WORKFLOW_QUEUE)
        with pytest.raises(RunStalled, match=r"failed: .*rollout\.group_sise"):
            await run_result(handle, timeout_s=RESULT_TIMEOUT_S, poll_s=0.1)


async def paused_with_both_servers(client: Client, cfg: RunConfig, books: FakeBooks) -> WorkflowHandle:
    """The run started, paused, the base policy on both servers and no group in flight; what
    the servers generated so far forgotten."""
    handle = await start_run(client, cfg)
    await handle.execute_update(TrainingRunWorkflow.pause, PauseRequest("waiting for the sidecar's report"))
    while True:
        status = await handle.query(TrainingRunWorkflow.status)
        if status.server_versions == {"0": 0, "1": 0} and status.in_flight == 0:
            break
        await asyncio.sleep(0.05)
    books.generated_on.clear()
    return handle


async def test_a_server_reported_down_gets_no_groups(temporal_client: Client) -> None:
    books = FakeBooks(servers=["0", "1"])
    cfg = config(steps=3)
    async with fake_pipeline(temporal_client, books):
        handle = await paused_with_both_servers(temporal_client, cfg, books)
        books.down.add("1")
        await handle.signal(SERVER_STATE_SIGNAL, ServerState("1", None))
        status = await handle.query(TrainingRunWorkflow.status)
        assert status.unavailable_servers == ["1"] and status.server_versions == {"0": 0}
        await handle.execute_update(TrainingRunWorkflow.resume)
        result = await finished(handle)
    assert result.steps == 3
    assert set(books.generated_on) == {"0"}, "a group went to the server reported down"
    assert any(f.message.startswith("server 1 did not take version 1") for f in books.failures)


async def test_a_server_reported_back_takes_groups_again(temporal_client: Client) -> None:
    books = FakeBooks(servers=["0", "1"])
    cfg = config(steps=3)
    async with fake_pipeline(temporal_client, books):
        handle = await paused_with_both_servers(temporal_client, cfg, books)
        await handle.signal(SERVER_STATE_SIGNAL, ServerState("1", None))
        await handle.signal(SERVER_STATE_SIGNAL, ServerState("1", 0))  # restored and verified
        status = await handle.query(TrainingRunWorkflow.status)
        assert status.unavailable_servers == [] and status.server_versions == {"0": 0, "1": 0}
        await handle.execute_update(TrainingRunWorkflow.resume)
        await finished(handle)
    assert set(books.generated_on) == {"0", "1"}


async def test_groups_on_a_server_that_goes_down_go_on_on_another(temporal_client: Client) -> None:
    """Server 1's model calls hang (it died mid-call); when its sidecar reports it down, the groups
    in flight on it move to server 0, their hung calls are made again there, and none fails."""
    books = FakeBooks(servers=["0", "1"], hung={"1"})
    cfg = config(steps=3)
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        await until(lambda: "1" in books.generated_on, "a model call on server 1", timeout_s=30)
        books.down.add("1")  # and it stays down: its next syncs fail
        await handle.signal(SERVER_STATE_SIGNAL, ServerState("1", None))
        result = await finished(handle)
        status = await handle.query(TrainingRunWorkflow.status)
    assert result.steps == 3 and result.groups_failed == 0 and status.groups_rerouted >= 1
    calls = list(zip(books.generated, books.generated_on, strict=True))
    hung = {call for call, server in calls if server == "1"}
    assert hung and hung <= {call for call, server in calls if server == "0"}, "each hung call was made again on 0"
    assert status.unavailable_servers == ["1"]


async def test_a_drained_server_finishes_its_groups_takes_no_more_and_leaves(temporal_client: Client) -> None:
    # server 1's calls wait until released, server 0 is slow: while 1 drains, 0 is the busier one
    books = FakeBooks(servers=["0", "1"], hung={"1"}, slow_servers={"0": 0.3}, train_delay_s=3.0)
    cfg = config(steps=3, max_staleness=10)  # room for many groups in flight at once
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        await until(lambda: "1" in books.generated_on, "a model call on server 1", timeout_s=30)
        status = await handle.execute_update(TrainingRunWorkflow.drain_server, DrainRequest("1"))
        assert status.draining_servers == ["1"], "its group in flight keeps it until that group finishes"
        started = status.groups_completed + status.groups_dropped + status.groups_failed + status.in_flight
        await asyncio.sleep(1.0)  # groups start meanwhile, all on server 0
        books.hung.clear()

        async def left_the_run() -> RunStatus | None:
            status = await handle.query(TrainingRunWorkflow.status)
            return status if "1" in status.left_servers else None

        left = await until(left_the_run, "server 1 leaves the run", timeout_s=60, interval_s=0.05)
        calls_before_leaving, version_held = len(books.generated_on), books.server_version["1"]
        result = await finished(handle)
        status = await handle.query(TrainingRunWorkflow.status)
    assert left.draining_servers == [] and status.left_servers == ["1"] and status.unavailable_servers == []
    assert result.steps == 3 and result.groups_failed == 0
    assert "1" not in books.generated_on[calls_before_leaving:], "no group went to server 1 after it left"
    on_1 = {trajectory // 100 for (trajectory, _), server in zip(books.generated, books.generated_on, strict=True)
            if server == "1"}  # the fakes number trajectories group * 100 + sample
    assert on_1 and max(on_1) < started, "no group started after the drain went to server 1"
    assert books.server_version["1"] == version_held < result.version, "a drained server loads nothing more"


async def test_a_server_drained_with_move_hands_its_groups_over_at_once(temporal_client: Client) -> None:
    books = FakeBooks(servers=["0", "1"], hung={"1"})  # its model calls would never end
    cfg = config(steps=3)
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        await until(lambda: "1" in books.generated_on, "a model call on server 1", timeout_s=30)
        status = await handle.execute_update(TrainingRunWorkflow.drain_server, DrainRequest("1", move=True))
        assert status.left_servers == ["1"] and status.groups_rerouted >= 1
        calls_on_1 = books.generated_on.count("1")   # it has left: each of its groups was told to move first
        result = await finished(handle)
    assert result.steps == 3 and result.groups_failed == 0
    assert books.generated_on.count("1") == calls_on_1, "a model call started on server 1 after it left"


async def test_a_server_drained_during_a_load_leaves_once_the_load_has_ended(temporal_client: Client) -> None:
    books = FakeBooks(servers=["0", "1"], train_delay_s=0.3)
    cfg = config(steps=4)
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        await until(lambda: books.server_version.get("1", -1) >= 0, "server 1 holds the base policy", timeout_s=30)
        books.held_loads.add("1")
        await until(lambda: [v for s, v in books.loads_started if s == "1" and v >= 1], "a load into server 1",
                    timeout_s=30)
        status = await handle.execute_update(TrainingRunWorkflow.drain_server, DrainRequest("1", move=True))
        assert status.draining_servers == ["1"] and status.left_servers == [], "its load in flight keeps it"
        [(_, loading)] = [(s, v) for s, v in books.loads_started if s == "1" and v >= 1]
        books.held_loads.clear()

        async def left_the_run() -> RunStatus | None:
            status = await handle.query(TrainingRunWorkflow.status)
            return status if "1" in status.left_servers else None

        await until(left_the_run, "server 1 leaves the run", timeout_s=30, interval_s=0.05)
        assert books.server_version["1"] == loading, "it left once the load had ended"
        result = await finished(handle)
    assert result.steps == 4 and result.version > loading
    assert [v for s, v in books.loads_started if s == "1" and v > loading] == [], "a drained server loads no more"


async def test_a_server_drained_while_down_leaves_at_once_and_its_late_load_does_not_count(
        temporal_client: Client) -> None:
    books = FakeBooks(servers=["0", "1"], train_delay_s=0.3)
    cfg = config(steps=4)
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        await until(lambda: books.server_version.get("1", -1) >= 0, "server 1 holds the base policy", timeout_s=30)
        books.held_loads.add("1")
        await until(lambda: [v for s, v in books.loads_started if s == "1" and v >= 1], "a load into server 1",
                    timeout_s=30)
        await handle.signal(SERVER_STATE_SIGNAL, ServerState("1", None))   # its sidecar: it went down
        status = await handle.execute_update(TrainingRunWorkflow.drain_server, DrainRequest("1", move=True))
        assert status.left_servers == ["1"], "a server that is down does not wait for its load"
        calls_on_1 = books.generated_on.count("1")
        books.held_loads.clear()   # the load lands after all
        result = await finished(handle)
        status = await handle.query(TrainingRunWorkflow.status)
    assert result.steps == 4 and "1" not in status.server_versions, "a load that landed after it left does not count"
    assert books.generated_on.count("1") == calls_on_1, "no group went to server 1 after it left"
    assert len([v for s, v in books.loads_started if s == "1" and v >= 1]) == 1, "its loop ended with that load"


async def test_draining_an_unknown_or_the_last_server_is_refused(temporal_client: Client) -> None:
    books = FakeBooks(servers=["0", "1"], train_delay_s=0.3)
    cfg = config(steps=3)
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        await until(lambda: "1" in books.generated_on, "a model call on server 1", timeout_s=30)
        with pytest.raises(WorkflowUpdateFailedError) as unknown:
            await handle.execute_update(TrainingRunWorkflow.drain_server, DrainRequest("7"))
        await handle.execute_update(TrainingRunWorkflow.drain_server, DrainRequest("1", move=True))
        with pytest.raises(WorkflowUpdateFailedError) as last:
            await handle.execute_update(TrainingRunWorkflow.drain_server, DrainRequest("0"))
        await finished(handle)
    assert "no server '7' (its servers: 0, 1)" in str(unknown.value.cause)
    assert "server 0 is the run's last server" in str(last.value.cause)


async def test_a_server_joins_a_running_run_and_takes_groups_only_once_it_verified_the_current_version(
        temporal_client: Client) -> None:
    # server 1 is down when it joins: its first load fails, and what its sidecar reports meanwhile
    # does not make it routable; once it is back, the next publish loads it and groups follow
    books = FakeBooks(servers=["0"], spare=["1"], down={"1"}, train_delay_s=0.3)
    cfg = config(steps=8)
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        await until(lambda: books.server_version.get("0", 0) >= 1, "server 0 holds a trained version", timeout_s=30)
        with pytest.raises(WorkflowUpdateFailedError) as unknown:
            await handle.execute_update(TrainingRunWorkflow.join_server, JoinRequest("7"))
        with pytest.raises(WorkflowUpdateFailedError) as member:
            await handle.execute_update(TrainingRunWorkflow.join_server, JoinRequest("0"))
        joined = await handle.execute_update(TrainingRunWorkflow.join_server, JoinRequest("1"))
        assert joined.joining_servers == ["1"] and "1" in joined.unavailable_servers
        await handle.signal(SERVER_STATE_SIGNAL, ServerState("1", 0))  # a sidecar's report of old weights
        await asyncio.sleep(1.0)
        assert "1" not in books.generated_on, "a joining server took a group before it verified its load"
        books.down.clear()
        await until(lambda: "1" in books.generated_on, "a model call on server 1", timeout_s=60)
        result = await finished(handle)
        status = await handle.query(TrainingRunWorkflow.status)
    assert "no inference server named '7'" in str(unknown.value.cause)
    assert "server 0 already serves run" in str(member.value.cause)
    assert result.steps == 8 and result.groups_failed == 0
    assert status.joining_servers == [] and status.server_versions["1"] == result.version
    [(_, first_version, calls_before), *_] = [load for load in books.loads if load[0] == "1"]
    assert first_version >= joined.version, "it joined on a version at least as new as the run's at the join"
    assert books.generated_on.index("1") >= calls_before, "no model call on server 1 before its load was verified"


async def test_a_server_whose_load_is_refused_goes_on_to_the_version_published_meanwhile(
        temporal_client: Client) -> None:
    """v1's load is refused (retention deleted it) after step 2 has published v2: the server's
    sync loop loads v2 instead of ending, so the server ends on the final version."""
    books = FakeBooks(refused={1})
    cfg = config(steps=2)
    async with fake_pipeline(temporal_client, books):
        result = await finished(await start_run(temporal_client, cfg))
    assert result.steps == 2 and books.server_version == {"0": 2}
    loads = [i for _, kind, i in books.events if kind == "sync_start"]
    assert loads == [0, 1, 2], "v2 was published while v1's load was in flight"
    assert any(f.message.startswith("server 0 did not take version 1") for f in books.failures)


async def test_a_slow_server_gets_fewer_groups(temporal_client: Client) -> None:
    """Groups go to the least loaded server: one whose model calls take 50x longer holds its groups
    longer and is given fewer (round-robin would split them evenly)."""
    books = FakeBooks(servers=["0", "1"], generate_delay_s=0.02, slow_servers={"1": 1.0})
    # a budget wide enough that groups are in flight on both servers at once
    cfg = config(steps=12, max_staleness=4, rollout={"group_size": 2, "groups_per_step": 2, "max_concurrent_groups": 6})
    async with fake_pipeline(temporal_client, books):
        result = await finished(await start_run(temporal_client, cfg))
    assert result.steps == 12
    groups_on = {server: books.generated_on.count(server) // 2 for server in ("0", "1")}  # one turn, two samples
    assert groups_on["0"] > 1.5 * groups_on["1"], groups_on


async def test_schedule_update_is_validated(temporal_client: Client) -> None:
    books = FakeBooks(train_delay_s=0.2)
    cfg = config(steps=3, max_staleness=1)
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        with pytest.raises(WorkflowUpdateFailedError):
            await handle.execute_update(TrainingRunWorkflow.set_schedule, ScheduleUpdate(sync_interval=5))
        status = await handle.execute_update(TrainingRunWorkflow.set_schedule, ScheduleUpdate(max_staleness=2))
        assert status.max_staleness == 2
        await finished(handle)


async def test_a_run_whose_environment_cannot_produce_tasks_fails_at_once(temporal_client: Client) -> None:
    books = FakeBooks(task_error="environment 'spelling' cannot be built: FileNotFoundError: words.jsonl")
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, config())
        with pytest.raises(RunStalled, match="words.jsonl"):
            await run_result(handle, timeout_s=RESULT_TIMEOUT_S, poll_s=0.1)
        status = await handle.query(TrainingRunWorkflow.status)
    assert status.phase == "failed" and status.close_reason is not None and "words.jsonl" in status.close_reason
    assert books.statuses == ["failed"] and not books.groups, "no group may start on tasks that cannot be drawn"


async def test_a_group_whose_task_cannot_be_drawn_fails_and_the_run_pauses_saying_why(temporal_client: Client) -> None:
    books = FakeBooks(group_start_error="environment 'spelling' cannot produce train task 3: IndexError")
    cfg = config(rollout={"group_size": 2, "groups_per_step": 2, "pause_after_failed_groups": 2})
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        try:
            with pytest.raises(RunStalled, match="cannot produce train task 3"):
                await run_result(handle, timeout_s=RESULT_TIMEOUT_S, poll_s=0.1)
            status = await handle.query(TrainingRunWorkflow.status)
        finally:
            await handle.cancel()
    assert status.groups_failed >= 2 and status.paused
    assert any("could not start" in f.message for f in books.failures)


async def test_cancelling_a_run_cancels_its_groups(temporal_client: Client) -> None:
    books = FakeBooks(generate_delay_s=60)  # every group stays in flight until cancelled
    cfg = config()
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        while (await handle.query(TrainingRunWorkflow.status)).in_flight < 2 or len(books.groups) < 2:
            await asyncio.sleep(0.05)
        await cancel(temporal_client, cfg.name)
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        groups = await group_workflows(temporal_client, handle.id)  # none can finish: all are in flight
        closed = await statuses_once_cancelled(groups)  # the cancels land a moment after the run closes
    assert len(groups) >= 2 and closed == [WorkflowExecutionStatus.CANCELED] * len(groups)
    # every group that wrote its rows closed them, also one cancelled while its start was in flight
    assert sorted(books.cancelled_groups) == sorted(books.groups), "a cancelled group must close its books"
    assert books.statuses[-1] == "cancelled"


async def test_a_group_cancelled_while_it_starts_closes_its_books(temporal_client: Client) -> None:
    books = FakeBooks(start_delay_s=2)  # the cancel lands while every group's rows are being written
    cfg = config()
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        while (await handle.query(TrainingRunWorkflow.status)).in_flight < 2:
            await asyncio.sleep(0.05)
        assert not books.groups
        await cancel(temporal_client, cfg.name)
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        groups = await group_workflows(temporal_client, handle.id)
        closed = await statuses_once_cancelled(groups)  # each waits for its start, then closes its books
    assert len(groups) >= 2 and closed == [WorkflowExecutionStatus.CANCELED] * len(groups)
    assert sorted(books.groups) == [i for i in range(len(groups))], "every group's start ran to its end"
    assert sorted(books.cancelled_groups) == sorted(books.groups), "a cancelled group must close its books"


async def statuses_once_cancelled(groups: list[WorkflowHandle[Any, Any]]) -> list[WorkflowExecutionStatus | None]:
    """The groups' statuses once all are cancelled, or after 10 s of waiting for it."""
    for _ in range(100):
        closed = [(await g.describe()).status for g in groups]
        if all(s == WorkflowExecutionStatus.CANCELED for s in closed):
            break
        await asyncio.sleep(0.1)
    return closed


async def group_workflows(client: Client, run_workflow_id: str) -> list[WorkflowHandle[Any, Any]]:
    """The run's group workflows, in the order it started them (their indices have no gaps)."""
    handles = []
    while True:
        handle = client.get_workflow_handle(f"{run_workflow_id}-group-{len(handles)}")
        try:
            await handle.describe()
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return handles
            raise
        handles.append(handle)


async def test_a_rejected_config_gets_a_row_and_a_status_that_says_why(temporal_client: Client) -> None:
    workflow_id = f"from-the-ui-{uuid.uuid4().hex[:8]}"
    async with fake_pipeline(temporal_client, books := FakeBooks()):
        handle = await temporal_client.start_workflow(
            "TrainingRunWorkflow", {"name": "typo", "rollout": {"group_sise": 4}}, id=workflow_id,
            task_queue=WORKFLOW_QUEUE)
        with pytest.raises(WorkflowFailureError):
            await handle.result()
    [rejected] = books.rejected
    assert rejected.workflow_id == workflow_id and "rollout.group_sise" in rejected.reason
    assert rejected.config == {"name": "typo", "rollout": {"group_sise": 4}}
    async with fake_pipeline(temporal_client, FakeBooks()):  # new workers: the query replays the history
        status = await run_status(temporal_client, workflow_id)
    assert status.phase == "failed" and status.close_reason is not None
    assert "rollout.group_sise" in status.close_reason


async def test_a_run_started_under_another_id_is_found_by_its_name(temporal_client: Client) -> None:
    cfg = config(steps=2)
    workflow_id = f"started-from-the-ui-{uuid.uuid4().hex[:8]}"
    async with fake_pipeline(temporal_client, FakeBooks()):
        handle = await temporal_client.start_workflow(TrainingRunWorkflow.run, cfg, id=workflow_id,
                                                      task_queue=WORKFLOW_QUEUE)
        await finished(handle)
        for _ in range(100):  # visibility (the RunName search attribute) lags the history a little
            try:
                found = await find_run(temporal_client, cfg.name)
                break
            except RunCommandError:
                await asyncio.sleep(0.1)
        status = await run_status(temporal_client, cfg.name)
    assert found.id == workflow_id and status.run == cfg.name and status.step == 2


async def test_an_outage_is_waited_out_without_spending_the_tasks_attempts(temporal_client: Client) -> None:
    books = FakeBooks(tool_turns=1, tool_outages=4)  # four failures in a row, against one attempt per call
    cfg = config(steps=1, rollout={"group_size": 2, "groups_per_step": 1, "max_concurrent_groups": 1,
                                   "tool_attempts": 1})
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        result = await finished(handle)
    assert result.groups_failed == 0 and books.tool_outages == 0
    [outage] = [f for f in books.failures if f.kind == "outage"]
    assert outage.message.startswith("4 call(s) failed while a service was unreachable"), outage.message
    tries = outage.details["tries"]
    assert isinstance(tries, list) and len(tries) == 4 and all("database unreachable" in t for t in tries)


async def test_an_outage_longer_than_the_budget_fails_the_sample_saying_why(temporal_client: Client) -> None:
    books = FakeBooks(tool_turns=1, tool_outages=10**6)  # the database never comes back
    cfg = config(rollout={"group_size": 2, "groups_per_step": 1, "max_concurrent_groups": 1,
                          "pause_after_failed_groups": 1, "outage_budget_s": 2.5})
    async with fake_pipeline(temporal_client, books):
        handle = await start_run(temporal_client, cfg)
        try:
            with pytest.raises(RunStalled, match="database unreachable"):
                await run_result(handle, timeout_s=RESULT_TIMEOUT_S, poll_s=0.1)
        finally:
            await handle.cancel()
    assert any(f.kind == "outage" for f in books.failures)
