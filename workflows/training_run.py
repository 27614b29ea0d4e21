"""TrainingRunWorkflow: the run's control loop.

Two loops share the run's state:
- the rollout launcher keeps RolloutGroup children in flight while the staleness budget allows
  (`workflows.admission`: no trajectory can be more than max_staleness steps old when trained on);
- the trainer loop runs a train step whenever enough fresh groups are buffered, and syncs every
  server after each step that publishes a checkpoint.

Sync mode is the same code with max_staleness 0: the budget then admits exactly one batch per
published version, so rollouts never overlap training. Children report back by signal, so they
outlive a continue-as-new of the run; the in-flight set travels in `RunState`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributeKey, WorkflowIDReusePolicy
from temporalio.exceptions import ActivityError, ApplicationError, FailureError, is_cancelled_exception
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from rlpipe.activities import definitions as act
    from rlpipe.schemas.config import RunConfig, describe_validation_error
    from rlpipe.schemas.payloads import (
        WORKFLOW_QUEUE,
        DrainRequest,
        EvalInput,
        FailureRecord,
        GroupInput,
        GroupSummary,
        InitPolicyInput,
        JoinRequest,
        PauseRequest,
        RejectedRun,
        RunCheckInput,
        RunResult,
        RunState,
        RunStatus,
        RunStatusUpdate,
        ScheduleUpdate,
        ServerState,
        SyncInput,
        TrainStepInput,
        sync_queue,
    )
    from rlpipe.workflows.admission import LauncherLimits, LauncherView, admitted_server, least_loaded_freshest
    from rlpipe.workflows.calls import Outages, execute, execute_through_outages
    from rlpipe.workflows.policies import BOOKKEEPING, EVALUATE, TRAIN, sync_options
    from rlpipe.workflows.rollout_group import GROUP_FINISHED_SIGNAL, REROUTE_SIGNAL, RolloutGroupWorkflow

RUN_NAME = SearchAttributeKey.for_keyword("RunName")
MODE = SearchAttributeKey.for_keyword("Mode")
STEP = SearchAttributeKey.for_int("Step")
POLICY_VERSION = SearchAttributeKey.for_int("PolicyVersion")
PHASE = SearchAttributeKey.for_keyword("Phase")
SERVER_STATE_SIGNAL = "server_state"


@workflow.defn
class TrainingRunWorkflow:
    @workflow.init
    def __init__(self, config: RunConfig, carried: RunState | None = None) -> None:
        # the carried state is in place before any handler runs: signals of groups that finished
        # during continue-as-new are delivered with the new run's first task, ahead of `run`
        self.config = RunConfig()
        self.state = carried if carried is not None else RunState()
        self.stopping = False
        self.syncing: dict[str, asyncio.Task[None]] = {}  # server -> its catch-up loop (`_keep_in_sync`)
        self.pauses_on_failures = False
        self.routes_by_load = False
        self.reroutes = False  # groups leave a server that goes down (runs started before: they stay)
        self.moving_off: set[str] = set()  # drained servers whose groups have not all heard of their move yet

    # -- the run ------------------------------------------------------------------------------------
    @workflow.run
    async def run(self, config: RunConfig, carried: RunState | None = None) -> RunResult:
        try:
            self.config = config = _validated(config)
        except ApplicationError as err:  # a run that was started has a row, even one that never ran
            self._close("failed", err.message)
            await execute(act.RECORD_REJECTED_RUN, RejectedRun(workflow.info().workflow_id, config, err.message),
                          **BOOKKEEPING)
            raise
        if workflow.patched("run-name-at-start"):  # the CLI finds a run started under another id by its name
            workflow.upsert_search_attributes([RUN_NAME.value_set(config.name)])
        try:
            if carried is None:
                await self._start()
            else:
                self.state.steps_this_run = 0
            self._publish_attributes()
            launcher = asyncio.create_task(self._keep_rollouts_in_flight())
            while self.state.step < config.steps:
                await workflow.wait_condition(lambda: self._can_train() or self._should_continue_as_new())
                if self._should_continue_as_new() and (not self._can_train() or self._continues_between_steps()):
                    await self._stop_launcher(launcher)
                    await self._await_syncs()
                    await workflow.wait_condition(workflow.all_handlers_finished)
                    workflow.continue_as_new(args=[config, self.state])
                await self._train_step()
            await self._stop_launcher(launcher)
            await self._await_syncs()
        except (asyncio.CancelledError, FailureError) as err:
            # a cancel reaches `run` as CancelledError, or as ActivityError while it awaits an activity;
            # any other FailureError fails the run: Postgres then says why, as the workflow's failure does
            self.stopping = True
            status, reason = ("cancelled", "cancelled by user") if is_cancelled_exception(err) else \
                ("failed", _describe(err))
            self._close(status, reason)
            if workflow.patched("cancel-groups-with-run"):
                await self._cancel_groups()
            await self._set_status(status, reason)
            raise
        self._set_phase("completed")
        await self._set_status("completed", None)
        return RunResult(config.name, self.state.step, self.state.version, self.state.groups_consumed,
                         self.state.groups_dropped, self.state.groups_failed)

    async def _start(self) -> None:
        cfg = self.config
        # update handlers may run before `run` (a pause sent with the start): keep what they set
        self.state.sync_interval, self.state.max_staleness = cfg.sync.interval, cfg.staleness
        registered = await execute(act.REGISTER_RUN, cfg, **BOOKKEEPING)
        if not registered.servers:
            raise ApplicationError("no inference servers are configured for the workers (INFERENCE_URLS or "
                                   "`rlpipe stack up --inference N`)", non_retryable=True)
        self.state.servers = registered.servers
        if workflow.patched("check-tasks-at-start"):  # an environment that cannot produce tasks fails the run now
            self._set_phase("checking tasks")
            await execute(act.CHECK_TASKS, RunCheckInput(cfg.name), **BOOKKEEPING)
        self._set_phase("publishing base policy")
        base = await execute(act.INIT_POLICY, InitPolicyInput(cfg.name), **TRAIN)
        self.state.version, self.state.version_steps = base.version, [base.trained_steps]
        self._set_phase(f"syncing v{base.version}")
        self._publish(base.version, evaluate=True)  # the baseline, evaluated before any rollout starts
        await workflow.wait_condition(lambda: (bool(self.state.server_versions) and
                                               base.version not in self.state.evals_due) or not self._syncing())
        if not self.state.server_versions:
            raise ApplicationError("no inference server could load the base policy (see sync_events/failures)",
                                   non_retryable=True)
        self._set_phase("running")

    # -- rollouts -----------------------------------------------------------------------------------
    async def _keep_rollouts_in_flight(self) -> None:
        # runs started before the pause-on-failures rule replay without it (docs/workflow-changes.md)
        self.pauses_on_failures = workflow.patched("pause-after-failed-groups")
        self.routes_by_load = workflow.patched("route-groups-by-load")
        self.reroutes = self.routes_by_load and workflow.patched("reroute-groups-off-down-servers")
        while not self.stopping:
            await workflow.wait_condition(
                lambda: self.stopping or self._failing_every_group() or self._launch_server() is not None)
            if self.stopping:
                return
            if self._failing_every_group():
                await self._pause(f"paused after {self.state.groups_failed_in_a_row} groups in a row failed; "
                                  f"the last: {self.state.last_group_failure}")
                continue
            server = self._launch_server()
            assert server is not None
            index = self.state.next_group_index
            self.state.next_group_index += 1
            self.state.in_flight.append(index)
            if self.routes_by_load:
                self.state.in_flight_servers[index] = server
            await workflow.start_child_workflow(
                RolloutGroupWorkflow.run, self._group_input(index, server),
                id=f"{workflow.info().workflow_id}-group-{index}", task_queue=WORKFLOW_QUEUE,
                parent_close_policy=ParentClosePolicy.ABANDON,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE)

    async def _cancel_groups(self) -> None:
        """Cancel the groups in flight. They are abandoned children (so that they outlive a
        continue-as-new of the run): a cancelled or failed run does not stop them by itself."""
        run_workflow_id = workflow.info().workflow_id
        await asyncio.gather(*(workflow.get_external_workflow_handle(f"{run_workflow_id}-group-{index}").cancel()
                               for index in self.state.in_flight), return_exceptions=True)  # closed ones: nothing to do

    def _launch_server(self) -> str | None:
        """The server the next group should go to, or None if no group may start now."""
        s, rollout = self.state, self.config.rollout
        view = LauncherView(paused=s.paused, in_flight=len(s.in_flight), consumed=s.groups_consumed,
                            fresh_ready=self._fresh_ready(), step=s.step, max_staleness=s.max_staleness,
                            server_steps=self._routable_steps(),
                            next_group_index=s.next_group_index,
                            server_load=self._server_load() if self.routes_by_load else {})
        return admitted_server(view, LauncherLimits(self.config.steps, rollout.groups_per_step,
                                                    rollout.max_concurrent_groups))

    def _server_load(self) -> Counter[str]:
        """Server -> groups in flight on it (recorded with load-aware routing)."""
        return Counter(self.state.in_flight_servers.values())

    def _routable_steps(self) -> dict[str, int]:
        """Server -> trained steps of the version it verifiably holds, for the servers groups may go to."""
        s = self.state
        return {name: s.version_steps[v] for name, v in s.server_versions.items() if name not in s.draining}

    def _failing_every_group(self) -> bool:
        """Has the pause-on-failures count been reached (and the run not paused for it yet)?"""
        limit = self.config.rollout.pause_after_failed_groups
        return (self.pauses_on_failures and limit is not None and not self.state.paused
                and self.state.groups_failed_in_a_row >= limit)

    def _group_input(self, index: int, server: str) -> GroupInput:
        r = self.config.rollout
        return GroupInput(
            run_id=self.config.name, run_workflow_id=workflow.info().workflow_id, group_index=index, server=server,
            group_size=r.group_size, hedge_samples=r.hedge_samples, max_turns=self._max_turns(),
            group_deadline_s=r.group_deadline_s, straggler_policy=r.straggler_policy,
            min_partial_samples=r.min_partial_samples, generate_timeout_s=r.generate_timeout_s,
            generate_attempts=r.generate_attempts, tool_timeout_s=r.tool_timeout_s, tool_attempts=r.tool_attempts,
            grade_timeout_s=r.grade_timeout_s, grade_attempts=r.grade_attempts, outage_budget_s=r.outage_budget_s,
            max_history_events=r.max_group_history_events)

    def _max_turns(self) -> int:
        # the environment's own default applies when the config leaves it unset (activities resolve it);
        # 64 is the config's upper bound, so the loop in the group never cuts an episode short
        return self.config.env.max_turns or 64

    @workflow.signal(name=GROUP_FINISHED_SIGNAL)
    def group_finished(self, summary: GroupSummary) -> None:
        s = self.state
        if summary.group_index not in s.in_flight:
            return  # a repeated signal: counted already
        s.in_flight.remove(summary.group_index)
        s.in_flight_servers.pop(summary.group_index, None)
        self._let_drained_servers_leave()
        if summary.status == "completed":
            s.ready.append(summary)
            s.groups_completed += 1
            s.groups_failed_in_a_row = 0
        elif summary.status == "dropped":
            s.groups_dropped += 1
        else:
            s.groups_failed += 1
            s.groups_failed_in_a_row += 1
        if summary.status != "completed":  # the status query says why, e.g. a server that is down
            s.last_group_failure = f"group {summary.group_index} {summary.status}: {summary.reason}"

    @workflow.signal(name=SERVER_STATE_SIGNAL)
    def server_state(self, report: ServerState) -> None:
        """A sidecar saw its server go down or come back: route groups only to servers that
        verifiably hold a published version."""
        s = self.state
        if report.server not in s.servers:
            return  # before the run registered its servers, or a server it does not use
        if report.version is None:
            s.server_versions.pop(report.server, None)
        elif report.server in s.joining:
            pass  # a joining server takes groups once the load that its join started is verified
        elif report.version < len(s.version_steps):
            s.server_versions[report.server] = report.version
        # else: a version whose train step this workflow has not heard of yet; its sync follows
        if self.reroutes:
            self._reroute_stranded_groups()

    def _reroute_stranded_groups(self, leaving: str | None = None) -> list[asyncio.Task[None]]:
        """Move the groups in flight on servers that are down (or on `leaving`) to the least loaded
        of the freshest servers up; each group's model call in flight is made again there. With no
        server up they stay (their calls are retried) until one comes back. Returns the signals'
        deliveries: once one is done, that group makes no new call on its old server."""
        s = self.state
        load = self._server_load()
        up = self._routable_steps()
        deliveries = []
        for index, server in sorted(s.in_flight_servers.items()):
            if server in s.server_versions and server != leaving:
                continue
            target = least_loaded_freshest(up, load, index)
            if target is None:
                break
            load[server], load[target] = load[server] - 1, load[target] + 1
            s.in_flight_servers[index] = target
            s.groups_rerouted += 1
            deliveries.append(asyncio.create_task(self._reroute(index, target)))
        return deliveries

    async def _reroute(self, index: int, server: str) -> None:
        group = workflow.get_external_workflow_handle(f"{workflow.info().workflow_id}-group-{index}")
        try:
            await group.signal(REROUTE_SIGNAL, server)
        except Exception:  # noqa: BLE001 - the group finished meanwhile: nothing to move
            workflow.logger.info("group %d finished before it could be rerouted to server %s", index, server)

    def _is_fresh(self, group: GroupSummary, step: int) -> bool:
        """Would `group` be within the staleness budget if trained on at `step`?"""
        s = self.state
        generated_at = s.version_steps[group.min_version or 0]
        return (step - 1) - generated_at <= s.max_staleness

    def _fresh_ready(self) -> int:
        return sum(self._is_fresh(g, self.state.step + 1) for g in self.state.ready)

    # -- training and syncing -----------------------------------------------------------------------
    def _can_train(self) -> bool:
        return not self.state.paused and self._fresh_ready() >= self.config.rollout.groups_per_step

    async def _train_step(self) -> None:
        s, cfg = self.state, self.config
        step = s.step + 1
        publish = step % s.sync_interval == 0 or step == cfg.steps
        self._set_phase("training")
        summary = await execute(
            act.TRAIN_STEP,
            TrainStepInput(run_id=cfg.name, step=step, policy_version=s.version,
                           min_trained_steps=(step - 1) - s.max_staleness,
                           groups_per_step=cfg.rollout.groups_per_step, publish=publish),
            **TRAIN)
        consumed, dropped = set(summary.consumed_groups), set(summary.dropped_groups)
        s.ready = [g for g in s.ready if g.group_index not in consumed | dropped]
        s.groups_consumed += len(consumed)
        s.groups_dropped += len(dropped)
        s.step, s.steps_this_run, s.last_step_summary = step, s.steps_this_run + 1, summary
        if summary.published is not None:
            s.version = summary.published.version
            s.version_steps.append(summary.published.trained_steps)
            every = cfg.eval.every_versions
            self._publish(s.version, evaluate=step == cfg.steps or (every is not None and s.version % every == 0))
        self._set_phase("running")
        self._publish_attributes()

    def _publish(self, version: int, *, evaluate: bool) -> None:
        """Bring every server to the newly published `version`, each server on its own: a server's
        version counts (for routing and evaluation) as soon as it verifies it, and a server that is
        down or slow holds back neither the trainer nor the other servers."""
        if evaluate and self.config.eval.prompts:
            self.state.evals_due.append(version)
        for server in self.state.servers:
            if server not in self.state.draining:  # a draining server loads nothing more
                self._start_syncing(server)

    def _start_syncing(self, server: str) -> None:
        """Start `server`'s catch-up loop unless it is running (it then loads the newest version anyway)."""
        if server not in self.syncing or self.syncing[server].done():
            self.syncing[server] = asyncio.create_task(self._keep_in_sync(server))

    def _syncing(self) -> bool:
        return any(not task.done() for task in self.syncing.values())

    def _loading(self, server: str) -> bool:
        """Whether `server`'s sync loop (a load, or the evaluation after it) is running on it while it
        is up: a drained server leaves the run only once it ends. One reported down, or still joining,
        does not wait for a load that may retry for sync.timeout_s: it leaves, and `_gone` makes its
        loop end and its late load not count. Runs whose drains were recorded before this let every
        drained server leave at once."""
        loop = self.syncing.get(server)
        return (loop is not None and not loop.done() and server in self.state.server_versions
                and workflow.patched("leave-after-last-load"))

    def _gone(self, server: str) -> bool:
        """Whether `server` left the run while its sync loop ran (see `_loading`); runs whose drains
        were recorded before this went on loading it."""
        return server not in self.state.servers and workflow.patched("leave-after-last-load")

    async def _keep_in_sync(self, server: str) -> None:
        """Load the newest version into `server` until it holds it (a version published meanwhile
        is the next load, skipping those in between); the first server to verify a version due for
        evaluation evaluates it before it loads another. A failed load (retried for sync.timeout_s)
        ends the loop unless a newer version was published meanwhile (the failed one may have been
        deleted by the retention policy for it): the next publish starts it again, and the server's
        sidecar restores the newest version when the server comes back. A server drained meanwhile
        may leave the run once the loop ends."""
        await self._catch_up(server)
        if server in self.state.draining and workflow.patched("leave-after-last-load"):
            self.syncing.pop(server, None)
            self._let_drained_servers_leave()

    async def _catch_up(self, server: str) -> None:
        while server not in self.state.draining and not self._gone(server) and \
                (version := self.state.version) > self.state.server_versions.get(server, -1):
            if not await self._load(server, version):
                if workflow.patched("sync-newer-after-a-failed-load") and self.state.version > version:
                    continue
                return
            if version in self.state.evals_due:
                self.state.evals_due.remove(version)
                await self._evaluate(version, server)

    async def _load(self, server: str, version: int) -> bool:
        """Sync `version` into `server`; True once the server verifiably holds it."""
        try:
            outcome = await execute(act.SYNC_WEIGHTS, SyncInput(self.config.name, version),
                                    task_queue=sync_queue(server), **sync_options(self.config.sync.timeout_s))
            why = outcome.error
        except ActivityError as err:
            outcome, why = None, _describe(err)
        if outcome is not None and outcome.status == "ok":
            if self._gone(server):   # it left the run while loading: what it holds is not the run's to route to
                return False
            self.state.server_versions[server] = max(version, self.state.server_versions.get(server, 0))
            if server in self.state.joining:
                self.state.joining.remove(server)
            self._publish_attributes()
            return True
        await self._record("sync", f"server {server} did not take version {version}: {why}",
                           f"sync-{server}-v{version}")
        return False

    async def _evaluate(self, version: int, server: str) -> None:
        """Held-out accuracy of `version` on `server`, which holds it and loads nothing else until
        the evaluation ends (it runs inside the server's sync loop)."""
        self._set_phase(f"evaluating v{version}")
        outages = Outages(self.config.rollout.outage_budget_s)
        try:
            result = await execute_through_outages(act.EVALUATE, EvalInput(self.config.name, version, server),
                                                   outages, **EVALUATE)
            self.state.evals.append(result)
        except ActivityError as err:  # an evaluation is worth having, not worth stopping the run for
            await self._record("eval", f"evaluation of v{version} failed: {_describe(err)}", f"eval-v{version}")
        if outages.waited:
            await self._record("outage", f"evaluation of v{version}: {len(outages.waited)} call(s) failed while a "
                                         "service was unreachable and were run again", f"eval-v{version}-outage",
                               {"tries": outages.waited[-50:]})
        self._set_phase("running")

    async def _await_syncs(self) -> None:
        """Wait until every server's sync loop has ended; a version due for evaluation that no
        server took then never will be (servers load only the newest)."""
        await workflow.wait_condition(lambda: not self._syncing())
        for version in self.state.evals_due:
            await self._record("eval", f"v{version} was not evaluated: no server took it", f"eval-v{version}")
        self.state.evals_due.clear()

    async def _stop_launcher(self, launcher: asyncio.Task[None]) -> None:
        self.stopping = True
        await launcher
        self.stopping = False

    def _should_continue_as_new(self) -> bool:
        every = self.config.continue_as_new_every
        return workflow.info().is_continue_as_new_suggested() or (every is not None and
                                                                 self.state.steps_this_run >= every)

    def _continues_between_steps(self) -> bool:
        """Continue-as-new when due even though a step could train now (the step committed, the
        next not started), so that a run whose rollouts stay ahead of the trainer continues too.
        Runs that started before this replay the old path, training on (docs/workflow-changes.md)."""
        return workflow.patched("continue-as-new-between-steps")

    # -- handlers -----------------------------------------------------------------------------------
    @workflow.query
    def status(self) -> RunStatus:
        s = self.state
        return RunStatus(run=self.config.name, mode=self.config.mode, phase=s.phase, step=s.step,
                         steps=self.config.steps, version=s.version, server_versions=dict(s.server_versions),
                         in_flight=len(s.in_flight), buffered=len(s.ready), groups_completed=s.groups_completed,
                         groups_consumed=s.groups_consumed, groups_dropped=s.groups_dropped,
                         groups_failed=s.groups_failed, paused=s.paused, pause_reason=s.pause_reason,
                         sync_interval=s.sync_interval, max_staleness=s.max_staleness, last_step=s.last_step_summary,
                         evals=list(s.evals), last_group_failure=s.last_group_failure,
                         unavailable_servers=[name for name in s.servers if name not in s.server_versions],
                         groups_rerouted=s.groups_rerouted, draining_servers=list(s.draining),
                         in_flight_by_server=dict(self._server_load()),
                         left_servers=list(s.left), joining_servers=list(s.joining),
                         close_reason=s.close_reason)

    @workflow.update
    async def pause(self, request: PauseRequest) -> RunStatus:
        await self._pause(request.reason)
        return self.status()

    @pause.validator
    def _validate_pause(self, request: PauseRequest) -> None:
        if self.state.paused:
            raise ApplicationError(f"run {self.config.name} is already paused ({self.state.pause_reason})")
        if self.state.step >= self.config.steps:
            raise ApplicationError(f"run {self.config.name} has finished; there is nothing to pause")

    @workflow.update
    async def resume(self) -> RunStatus:
        self.state.paused, self.state.pause_reason = False, None
        self.state.groups_failed_in_a_row = 0  # whatever made every group fail has been seen to
        self._set_phase("running")
        await self._set_status("running", None)
        return self.status()

    @resume.validator
    def _validate_resume(self) -> None:
        if not self.state.paused:
            raise ApplicationError(f"run {self.config.name} is not paused")

    @workflow.update
    async def drain_server(self, request: DrainRequest) -> RunStatus:
        """Take a server out of the run: no new groups or loads go to it, and it leaves the run
        (status `left_servers`: safe to stop) once its groups in flight have finished there, or with
        `move` as soon as each has been told to move to another server (its next model call, or the
        one in flight, goes there; a group that has not heard yet could still start one on it), and
        once a load into it that was in flight has ended."""
        self.state.draining.append(request.server)
        if request.move:
            deliveries = self._reroute_stranded_groups(leaving=request.server)
            if workflow.patched("drain-after-groups-moved"):
                self.moving_off.add(request.server)
                try:
                    await asyncio.gather(*deliveries)
                finally:
                    self.moving_off.discard(request.server)
        self._let_drained_servers_leave()
        return self.status()

    @drain_server.validator
    def _validate_drain(self, request: DrainRequest) -> None:
        s = self.state
        if request.server not in s.servers:
            known = ", ".join(s.servers) or "none yet"
            raise ApplicationError(f"run {self.config.name} has no server {request.server!r} (its servers: {known})")
        if request.server in s.draining:
            raise ApplicationError(f"server {request.server} is already being drained")
        if not self.routes_by_load:
            raise ApplicationError(f"run {self.config.name} started before servers could be drained: it does not "
                                   "know which server each group is on")
        if not [name for name in s.servers if name != request.server and name not in s.draining]:
            raise ApplicationError(f"server {request.server} is the run's last server: draining it would stop "
                                   "every rollout (cancel or pause the run instead)")

    @workflow.update
    async def join_server(self, request: JoinRequest) -> RunStatus:
        """Add a server to the running run (one drained out of it may come back): it loads the
        current version and takes groups once it has verified it (status `joining_servers` until
        then); each later version is published to it like to the others."""
        try:
            await execute(act.CHECK_SERVER, request, **BOOKKEEPING)
        except ActivityError as err:  # the workers cannot reach a server by that name
            raise ApplicationError(_describe(err), type="UnknownServer") from err
        s, server = self.state, request.server
        self._validate_join(request)  # again: another join of the same server may have landed meanwhile
        if server in s.left:
            s.left.remove(server)
        s.servers.append(server)
        s.joining.append(server)
        s.server_versions.pop(server, None)  # whatever it held before is not verified for this run now
        self._start_syncing(server)
        return self.status()

    @join_server.validator
    def _validate_join(self, request: JoinRequest) -> None:
        s, name = self.state, self.config.name
        if not s.servers:
            raise ApplicationError(f"run {name} has not registered its servers yet: join once it is running")
        if s.step >= self.config.steps or s.close_reason is not None:
            raise ApplicationError(f"run {name} has finished training: no server can join it")
        if request.server in s.draining:
            raise ApplicationError(f"server {request.server} is being drained from run {name}: join it again once "
                                   "it has left (status: drained servers)")
        if request.server in s.servers:
            raise ApplicationError(f"server {request.server} already serves run {name}")
        if not self.routes_by_load:
            raise ApplicationError(f"run {name} started before servers could join: it routes groups without "
                                   "knowing which server each is on")

    def _let_drained_servers_leave(self) -> None:
        """Draining servers with no group left on them, and no load in flight, leave the run's servers."""
        s, load = self.state, self._server_load()
        for server in [name for name in s.draining if not load[name] and name not in self.moving_off
                       and not self._loading(name)]:
            s.draining.remove(server)
            s.servers.remove(server)
            if server in s.joining:
                s.joining.remove(server)
            s.server_versions.pop(server, None)
            s.left.append(server)

    @workflow.update
    def set_schedule(self, update: ScheduleUpdate) -> RunStatus:
        if update.sync_interval is not None:
            self.state.sync_interval = update.sync_interval
        if update.max_staleness is not None:
            self.state.max_staleness = update.max_staleness
        return self.status()

    @set_schedule.validator
    def _validate_schedule(self, update: ScheduleUpdate) -> None:
        interval = update.sync_interval if update.sync_interval is not None else self.state.sync_interval
        staleness = update.max_staleness if update.max_staleness is not None else self.state.max_staleness
        if interval < 1:
            raise ApplicationError(f"sync_interval must be >= 1, got {interval}")
        if staleness < 0:
            raise ApplicationError(f"max_staleness must be >= 0, got {staleness}")
        if self.config.mode == "sync" and (interval != 1 or staleness != 0):
            raise ApplicationError("a sync-mode run keeps sync_interval 1 and max_staleness 0")
        if interval > staleness + 1:
            raise ApplicationError(f"sync_interval ({interval}) > max_staleness + 1 ({staleness + 1}) would starve "
                                   "the trainer of fresh data")

    # -- bookkeeping --------------------------------------------------------------------------------
    async def _pause(self, reason: str) -> None:
        """No new groups until `resume`; groups in flight finish, and steps train on what is buffered."""
        self.state.paused, self.state.pause_reason = True, reason
        self._set_phase("paused")
        await self._set_status("paused", reason)

    async def _record(self, kind: str, message: str, activity_id: str,
                      details: dict[str, object] | None = None) -> None:
        """Add to the run's failure log (`failures`)."""
        await execute(act.RECORD_FAILURE, FailureRecord(self.config.name, kind, message,
                                                        workflow_id=workflow.info().workflow_id,
                                                        activity_id=activity_id, details=details or {}),
                      **BOOKKEEPING)

    def _close(self, status: str, reason: str) -> None:
        """What the status query says of a run that failed or was cancelled (no command: replays
        of runs closed before this existed stay the same)."""
        self.state.phase, self.state.close_reason = status, reason

    def _set_phase(self, phase: str) -> None:
        self.state.phase = phase
        workflow.upsert_search_attributes([PHASE.value_set(phase)])

    def _publish_attributes(self) -> None:
        workflow.upsert_search_attributes([
            RUN_NAME.value_set(self.config.name), MODE.value_set(self.config.mode),
            STEP.value_set(self.state.step), POLICY_VERSION.value_set(self.state.version),
            PHASE.value_set(self.state.phase)])

    async def _set_status(self, status: str, reason: str | None) -> None:
        await execute(act.SET_RUN_STATUS, RunStatusUpdate(self.config.name, status, reason),
                      start_to_close_timeout=timedelta(seconds=60))


def _validated(config: RunConfig | dict[str, Any]) -> RunConfig:
    """The run's config, validated. A run started with one JSON argument (the Web UI's Start
    Workflow form, `temporal workflow start --input`) arrives as a plain dict: Temporal applies
    the parameter types only when the argument count matches, and continue-as-new passes two.
    A bad config fails the run at once with the fields named, instead of retrying forever."""
    if isinstance(config, RunConfig):
        return config
    try:
        return RunConfig.model_validate(config)
    except ValidationError as exc:
        raise ApplicationError(describe_validation_error(exc, "run config"), type="ConfigError",
                               non_retryable=True) from None


def _describe(err: BaseException) -> str:
    while isinstance(err, ActivityError) and err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {err}"
