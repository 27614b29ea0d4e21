"""RolloutGroupWorkflow: one prompt × G samples, each a multi-turn agent episode.

    start_group ─▶ for each sample (in parallel):  generate ─▶ run_tool* ─▶ generate ─▶ …
                ─▶ keep the first G finished (hedging), or apply the straggler policy at the deadline
                ─▶ grade_group ─▶ finish_group (advantages, one transaction) ─▶ signal the run

Every model call and tool call is its own activity, so a worker crash re-runs only the call in
flight: completed turns are in the history (and in `turns`), never generated again. A group whose
task cannot be drawn fails at once (the reason is the environment's); a cancelled group (its run
was cancelled) closes its books as dropped before it ends.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from rlpipe.activities import definitions as act
    from rlpipe.schemas.payloads import (
        FailureRecord,
        FinishGroupInput,
        GenerateInput,
        GradeGroupInput,
        GroupInput,
        GroupSummary,
        StartGroupInput,
        ToolInput,
    )
    from rlpipe.workflows.calls import Outages, execute, execute_through_outages
    from rlpipe.workflows.policies import BOOKKEEPING, generate_options, grade_options, tool_options

GROUP_FINISHED_SIGNAL = "group_finished"
RUN_CANCELLED = "run cancelled"


@workflow.defn
class RolloutGroupWorkflow:
    def __init__(self) -> None:
        self.finished: list[int] = []  # sample indices, in the order they finished
        self.failed: dict[int, str] = {}  # sample index -> why
        self.samples: list[asyncio.Task[None]] = []
        self.outages = Outages(budget_s=0.0)  # the run's budget, set in `run`

    @workflow.run
    async def run(self, inp: GroupInput) -> GroupSummary:
        self.outages.budget_s = inp.outage_budget_s
        try:
            started = await execute(
                act.START_GROUP, StartGroupInput(inp.run_id, inp.group_index, workflow.info().workflow_id,
                                                 inp.group_size + inp.hedge_samples), **BOOKKEEPING)
        except ActivityError as err:  # not retried: the environment cannot produce this group's task
            reason = f"group {inp.group_index} could not start: {_cause(err)}"
            await self._record(inp, "rollout", reason)
            return await self._report(inp, GroupSummary(inp.group_index, "failed", reason=reason))
        ids = started.trajectory_ids
        try:
            return await self._report(inp, await self._play(inp, ids))
        except asyncio.CancelledError:
            # the run was cancelled: close the group's books, so that no trajectory stays "generating"
            for task in self.samples:
                task.cancel()
            await execute(act.FINISH_GROUP, FinishGroupInput(inp.run_id, inp.group_index, [], [], ids, "dropped",
                                                             RUN_CANCELLED), **BOOKKEEPING)
            raise

    async def _play(self, inp: GroupInput, ids: list[int]) -> GroupSummary:
        """Run the samples, keep the first `group_size` that finish, grade them and close the group."""
        self.samples = [asyncio.create_task(self._sample(inp, i, ids[i])) for i in range(len(ids))]
        enough = lambda: len(self.finished) >= inp.group_size or len(self.finished) + len(self.failed) == len(ids)  # noqa: E731
        timeout = timedelta(seconds=inp.group_deadline_s) if inp.group_deadline_s else None
        deadline_passed = False
        try:
            await workflow.wait_condition(enough, timeout=timeout)
        except TimeoutError:
            deadline_passed = True
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

    async def _report(self, inp: GroupInput, summary: GroupSummary) -> GroupSummary:
        """Tell the run how the group ended, and return that."""
        try:
            await workflow.get_external_workflow_handle(inp.run_workflow_id).signal(GROUP_FINISHED_SIGNAL, summary)
        except Exception:  # noqa: BLE001 - the run has ended (cancelled or finished): nobody to tell
            workflow.logger.info("run %s is closed; group %d not reported", inp.run_workflow_id, inp.group_index)
        return summary

    async def _sample(self, inp: GroupInput, index: int, trajectory_id: int) -> None:
        """One episode: model turns and the tool calls they make, until the episode is done."""
        try:
            for turn in range(inp.max_turns):
                generated = await execute_through_outages(
                    act.GENERATE, GenerateInput(inp.run_id, trajectory_id, turn, inp.server), self.outages,
                    **generate_options(inp.generate_timeout_s, inp.generate_attempts))
                calls = [execute_through_outages(
                    act.RUN_TOOL, ToolInput(inp.run_id, trajectory_id, turn, call), self.outages,
                    **tool_options(inp.tool_timeout_s, inp.tool_attempts))
                    for call in range(generated.n_tool_calls)]
                await asyncio.gather(*calls)
                if generated.done:
                    break
            self.finished.append(index)
        except ActivityError as err:
            self.failed[index] = _cause(err)

    async def _record(self, inp: GroupInput, kind: str, message: str, details: dict[str, object] | None = None) -> None:
        await execute(
            act.RECORD_FAILURE, FailureRecord(inp.run_id, kind, message, workflow_id=workflow.info().workflow_id,
                                              activity_id=f"group-{inp.group_index}-{kind}", details=details or {}),
            **BOOKKEEPING)


def _cause(err: BaseException) -> str:
    """The message of the error the activity raised, which names the server or grader involved
    (its own causes, e.g. a bare "ConnectError", do not)."""
    while isinstance(err, ActivityError) and err.__cause__ is not None:
        err = err.__cause__
    return str(err)
