"""RolloutGroupWorkflow: one prompt × G samples, each a multi-turn agent episode.

    start_group ─▶ for each sample (in parallel):  generate ─▶ run_tool* ─▶ generate ─▶ …
                ─▶ keep the first G finished (hedging), or apply the straggler policy at the deadline
                ─▶ grade_group ─▶ finish_group (advantages, one transaction) ─▶ signal the run

Every model call and tool call is its own activity, so a worker crash re-runs only the call in
flight: completed turns are in the history (and in `turns`), never generated again. Before the
history passes `max_history_events` (or when Temporal suggests it), each sample stops at the end of
its turn and the group continues-as-new, carrying how far each sample got (`GroupProgress`). A group whose
task cannot be drawn fails at once (the reason is the environment's); a cancelled group (its run
was cancelled) closes its books as dropped before it ends.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from rlpipe.activities import definitions as act
    from rlpipe.schemas.payloads import (
        FailureRecord,
        FinishGroupInput,
        GenerateInput,
        GenerateResult,
        GradeGroupInput,
        GroupInput,
        GroupProgress,
        GroupSummary,
        StartGroupInput,
        ToolInput,
    )
    from rlpipe.workflows.calls import Outages, execute, execute_through_outages
    from rlpipe.workflows.policies import BOOKKEEPING, generate_options, grade_options, tool_options

GROUP_FINISHED_SIGNAL = "group_finished"
REROUTE_SIGNAL = "reroute"
RUN_CANCELLED = "run cancelled"


@workflow.defn
class RolloutGroupWorkflow:
    def __init__(self) -> None:
        self.finished: list[int] = []  # sample indices, in the order they finished
        self.failed: dict[int, str] = {}  # sample index -> why
        self.samples: list[asyncio.Task[None]] = []
        self.outages = Outages(budget_s=0.0)  # the run's budget, set in `run`
        self.next_turns: list[int] = []  # per sample: the first turn not yet played
        self.handing_over = False  # the history is long enough: samples stop at the end of their turn
        self.server = ""  # where model calls go: the run's choice at start, or where it rerouted the group
        self.reroutable = False  # started with the reroute rule (older groups replay without it)

    @workflow.signal(name=REROUTE_SIGNAL)
    def reroute(self, server: str) -> None:
        """The group's server went down: model calls go to `server` from now on, the one in flight too."""
        self.server = server

    @workflow.run
    async def run(self, inp: GroupInput) -> GroupSummary:
        self.outages.budget_s = inp.outage_budget_s
        self.server = self.server or inp.server  # a reroute may have arrived with the first task
        self.reroutable = workflow.patched("reroute-model-calls")
        if inp.progress is not None:  # a continued execution: the group started in the first one
            p = inp.progress
            ids, self.next_turns, self.finished, self.failed = p.trajectory_ids, p.next_turns, p.finished, p.failed
            self.outages.waited = p.outages_waited
        else:
            start = asyncio.create_task(execute(
                act.START_GROUP, StartGroupInput(inp.run_id, inp.group_index, workflow.info().workflow_id,
                                                 inp.group_size + inp.hedge_samples), **BOOKKEEPING))
            try:
                started = await asyncio.shield(start)
            except ActivityError as err:  # not retried: the environment cannot produce this group's task
                reason = f"group {inp.group_index} could not start: {_cause(err)}"
                await self._record(inp, "rollout", reason)
                return await self._report(inp, GroupSummary(inp.group_index, "failed", reason=reason))
            except asyncio.CancelledError:
                # cancelled while its rows were being written (or just after): they exist, close them too
                if workflow.patched("close-books-when-cancelled-at-start"):
                    try:
                        ids = (await start).trajectory_ids
                    except ActivityError:  # it could not start: no rows to close
                        raise asyncio.CancelledError from None
                    await self._drop(inp, ids)
                raise
            ids, self.next_turns = started.trajectory_ids, [0] * len(started.trajectory_ids)
        try:
            return await self._report(inp, await self._play(inp, ids))
        except asyncio.CancelledError:
            for task in self.samples:
                task.cancel()
            await self._drop(inp, ids)
            raise

    async def _drop(self, inp: GroupInput, ids: list[int]) -> None:
        """The run was cancelled: close the group's books, so that no trajectory stays "generating"."""
        await execute(act.FINISH_GROUP, FinishGroupInput(inp.run_id, inp.group_index, [], [], ids, "dropped",
                                                         RUN_CANCELLED), **BOOKKEEPING)

    async def _play(self, inp: GroupInput, ids: list[int]) -> GroupSummary:
        """Run the samples, keep the first `group_size` that finish, grade them and close the group
        (or hand the samples still playing over to the next execution, see `_hand_over`)."""
        self.samples = [asyncio.create_task(self._sample(inp, i, ids[i])) for i in range(len(ids))
                        if i not in self.finished and i not in self.failed]

        def enough() -> bool:
            return len(self.finished) >= inp.group_size or len(self.finished) + len(self.failed) == len(ids)

        timeout, deadline_at = self._deadline(inp)
        deadline_passed = False
        try:  # every sample done and not enough finished: they stopped for the hand-over
            await workflow.wait_condition(lambda: enough() or all(task.done() for task in self.samples),
                                          timeout=timeout)
        except TimeoutError:
            deadline_passed = True
        if not deadline_passed and not enough():
            workflow.continue_as_new(replace(inp, server=self.server, progress=GroupProgress(
                ids, self.next_turns, self.finished, self.failed, deadline_at, self.outages.waited[-50:])))
        for task in self.samples:  # hedged extras and stragglers are not waited for
            task.cancel()

        kept = sorted(self.finished[: inp.group_size])
        left_out = [ids[i] for i in range(len(ids)) if i not in kept]
        status, reason = "completed", None
        if len(kept) < inp.group_size:
            why = (f"deadline of {inp.group_deadline_s}s passed" if deadline_passed else "samples failed") + \
                  f" with {len(kept)}/{inp.group_size} samples finished"
            if self.failed:  # the first sample's error says why (a server down, a prompt too long)
                why += f"; sample {min(self.failed)}: {self.failed[min(self.failed)][:500]}"
            if inp.straggler_policy == "partial" and len(kept) >= inp.min_partial_samples:
                reason = f"partial group: {why}"
            else:
                status, reason = ("dropped" if deadline_passed else "failed"), why
            await self._record(inp, "straggler" if deadline_passed else "rollout", reason)

        rewards: list[float] = []
        if status == "completed":
            try:
                graded = await execute_through_outages(
                    act.GRADE_GROUP, GradeGroupInput(inp.run_id, inp.group_index, [ids[i] for i in kept]),
                    self.outages, **grade_options(inp.grade_timeout_s, inp.grade_attempts))
                rewards = graded.rewards
            except ActivityError as err:
                status, reason = "failed", f"grading failed: {_cause(err)}"

        if self.outages.waited:  # the database is back (or was never down): say what was waited out
            await self._record(inp, "outage", f"{len(self.outages.waited)} call(s) failed while a service was "
                                              "unreachable and were run again", {"tries": self.outages.waited[-50:]})
        return await execute(
            act.FINISH_GROUP, FinishGroupInput(inp.run_id, inp.group_index, [ids[i] for i in kept] if rewards else [],
                                               rewards, left_out if rewards else ids, status, reason),
            **BOOKKEEPING)

    def _deadline(self, inp: GroupInput) -> tuple[timedelta | None, float | None]:
        """How long the group may still wait for its samples, and when its deadline passes
        (workflow time, POSIX seconds; carried across continue-as-new). None: no deadline."""
        if not inp.group_deadline_s:
            return None, None
        if inp.progress is None or inp.progress.deadline_at is None:  # the first execution
            return timedelta(seconds=inp.group_deadline_s), workflow.now().timestamp() + inp.group_deadline_s
        left_s = max(0.0, inp.progress.deadline_at - workflow.now().timestamp())
        return timedelta(seconds=left_s), inp.progress.deadline_at

    def _hand_over(self, inp: GroupInput) -> bool:
        """Should the samples stop at the end of their turn for a continue-as-new? Once the history
        holds `max_history_events` events, or Temporal suggests it (it may still grow by the turn
        each sample has in flight)."""
        if not self.handing_over and inp.max_history_events is not None:
            info = workflow.info()
            self.handing_over = (info.get_current_history_length() >= inp.max_history_events
                                 or info.is_continue_as_new_suggested())
        return self.handing_over

    async def _report(self, inp: GroupInput, summary: GroupSummary) -> GroupSummary:
        """Tell the run how the group ended, and return that."""
        try:
            await workflow.get_external_workflow_handle(inp.run_workflow_id).signal(GROUP_FINISHED_SIGNAL, summary)
        except Exception:  # noqa: BLE001 - the run has ended (cancelled or finished): nobody to tell
            workflow.logger.info("run %s is closed; group %d not reported", inp.run_workflow_id, inp.group_index)
        return summary

    async def _sample(self, inp: GroupInput, index: int, trajectory_id: int) -> None:
        """One episode: model turns and the tool calls they make, until the episode is done, or
        until the end of a turn when the group hands over to its next execution (each execution
        plays at least one turn of each sample, so a group always progresses)."""
        first = self.next_turns[index]
        try:
            for turn in range(first, inp.max_turns):
                if turn > first and self._hand_over(inp):
                    return  # the next execution plays on from `turn`
                generated = await self._generate(inp, trajectory_id, turn)
                calls = [execute_through_outages(
                    act.RUN_TOOL, ToolInput(inp.run_id, trajectory_id, turn, call), self.outages,
                    **tool_options(inp.tool_timeout_s, inp.tool_attempts))
                    for call in range(generated.n_tool_calls)]
                await asyncio.gather(*calls)
                self.next_turns[index] = turn + 1
                if generated.done:
                    break
            self.finished.append(index)
        except ActivityError as err:
            self.failed[index] = _cause(err)

    async def _generate(self, inp: GroupInput, trajectory_id: int, turn: int) -> GenerateResult:
        """One model call on the group's server. When the run reroutes the group (its server went
        down), the call in flight is cancelled and made again on the new server, also one that
        failed meanwhile; a turn the old server managed to store is not generated twice (the
        activity returns the stored turn)."""
        while True:
            server = self.server
            call = execute_through_outages(
                act.GENERATE, GenerateInput(inp.run_id, trajectory_id, turn, server), self.outages,
                **generate_options(inp.generate_timeout_s, inp.generate_attempts))
            if not self.reroutable:
                return await call
            task = asyncio.create_task(call)
            await workflow.wait_condition(lambda: task.done() or self.server != server)  # noqa: B023 - awaited here
            if not task.done():
                task.cancel()  # the server is gone: the turn goes to the new one
                task.add_done_callback(_retrieved)
                continue
            try:
                return task.result()
            except ActivityError:
                if self.server == server:
                    raise
                # it failed on the server that went down while the reroute was on its way: go on there

    async def _record(self, inp: GroupInput, kind: str, message: str, details: dict[str, object] | None = None) -> None:
        await execute(
            act.RECORD_FAILURE, FailureRecord(inp.run_id, kind, message, workflow_id=workflow.info().workflow_id,
                                              activity_id=f"group-{inp.group_index}-{kind}", details=details or {}),
            **BOOKKEEPING)


def _retrieved(task: asyncio.Task[GenerateResult]) -> None:
    """Take the outcome of a model call that was given up (its ActivityError says it was cancelled)."""
    if not task.cancelled():
        task.exception()


def _cause(err: BaseException) -> str:
    """The message of the error the activity raised, which names the server or grader involved
    (its own causes, e.g. a bare "ConnectError", do not)."""
    while isinstance(err, ActivityError) and err.__cause__ is not None:
        err = err.__cause__
    return str(err)
