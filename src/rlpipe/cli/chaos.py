"""`rlpipe chaos`: a training run under fire, then its books audited.

While an async run is in flight, a seeded plan SIGKILLs and restarts workers (rollout, sandbox,
grader, trainer, sync sidecars), restarts the Temporal dev server, PostgreSQL and SeaweedFS, and
SIGKILLs and restarts vLLM servers, one disruption at a time, bounded in count and time. Services
come back on the same ports with the same data directories (the stack's records). Afterwards the
stack and every worker are brought back up, and the run's invariants (observe/invariants.py) are
checked and printed as a table, with two of the harness's own: no worker died without being
killed, and everything is healthy again.

Used by tests/chaos (small scale, every target once) and by hand as a benchmark (docs/runbook.md).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa
from rich.console import Console
from rich.table import Table
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.service import RPCError

from rlpipe.cli.run_commands import start_run
from rlpipe.infra.process import kill, port_holder, wait_for
from rlpipe.infra.stack import Stack
from rlpipe.observe.invariants import Invariant, check_run
from rlpipe.schemas.config import RunConfig
from rlpipe.storage.db import Database
from rlpipe.storage.object_store import ObjectStore
from rlpipe.workers.launcher import WorkerSet

Progress = Callable[[str], None]
PROGRESS_WAIT_S = 120.0
"""How long a disruption waits for the run to move on since the previous one, before it goes anyway."""
PORT_WAIT_S = 120.0
"""How long a restart waits for the stopped service's ports to be free again."""
SETTLE_TIMEOUT_S = 300.0
"""After the run: how long groups it abandoned (still in flight at its last step) may take to close."""


@dataclass(frozen=True)
class Disruption:
    target: str
    """A worker (`rollout`, `sidecar-0`, ...) or a local service (`temporal`, `inference-0`, ...)."""
    gap_s: float
    """Quiet time before it, after the previous disruption is over."""
    down_s: float
    """How long the target stays down before it is restarted."""


def plan(seed: int, count: int, targets: Sequence[str], gap_s: tuple[float, float] = (1.0, 5.0),
         down_s: tuple[float, float] = (0.5, 3.0)) -> list[Disruption]:
    """`count` disruptions: every target once in a shuffled order, then again, and so on, so a plan
    as long as the target list hits each exactly once. The same seed gives the same plan."""
    rng = random.Random(seed)
    chosen: list[Disruption] = []
    while len(chosen) < count:
        order = list(targets)
        rng.shuffle(order)
        chosen += [Disruption(t, round(rng.uniform(*gap_s), 1), round(rng.uniform(*down_s), 1))
                   for t in order[: count - len(chosen)]]
    return chosen


class Monkey:
    """Kills and restarts the processes of one stack directory: its services and its workers."""

    def __init__(self, stack: Stack, workers: WorkerSet, *, hard: bool = False, progress: Progress = print) -> None:
        self.stack = stack
        self.workers = workers
        self.hard = hard
        """SIGKILL Temporal, Postgres and SeaweedFS too (default: their ordinary stop, then a start)."""
        self.progress = progress
        self.crashed: list[str] = []
        """Workers found dead that the monkey had not killed."""

    def targets(self) -> list[str]:
        return [*self.workers.status(), *(svc.name for svc in self.stack.services())]

    def disrupt(self, d: Disruption) -> None:
        """Take `d.target` down, wait `d.down_s`, bring it back (blocking until it is healthy)."""
        self.take_down(d.target)
        time.sleep(d.down_s)
        self.bring_back(d.target)

    def take_down(self, target: str) -> None:
        """SIGKILL a worker or an inference server; stop another service (SIGKILL it when hard)."""
        if target in self.workers.status():
            record = self.workers.table.get(target)
            if record is not None:
                kill(record)
            return
        svc = self.stack.service(target)
        record = self.stack.table.get(svc.name)
        if record is not None and (self.hard or svc.name.startswith("inference-")):
            kill(record)
            self.stack.table.remove(svc.name)
        else:
            self.stack.stop_service(svc, progress=lambda msg: None)

    def bring_back(self, target: str) -> None:
        """Start what `take_down` stopped, on the same ports (blocking until it is healthy)."""
        if target in self.workers.status():
            # no start-up grace wait: a worker that dies again is caught by `revive_crashed`
            self.workers.up(only=[target], progress=lambda msg: None, grace_s=0)
            return
        svc = self.stack.service(target)
        # a killed server's ports can stay unbindable for up to a minute (sockets it left closing,
        # seen with SeaweedFS's S3 port); the service must come back on the same ones
        wait_for(lambda: all(port_holder(self.stack.settings.host, p) is None for p in svc.ports()), PORT_WAIT_S)
        self.stack.start(svc, progress=lambda msg: None)

    def revive_crashed(self) -> list[str]:
        """Restart workers that died on their own (a crash loop shows up here), and remember them."""
        dead = [name for name, record in self.workers.status().items() if record is None]
        if dead:
            self.crashed += dead
            self.progress(f"[red]worker(s) died without being killed: {', '.join(dead)}[/] (restarting)")
            self.workers.up(only=dead, progress=lambda msg: None)
        return dead

    def heal(self) -> Invariant:
        """Bring every service and worker back up; the check that everything is healthy again."""
        self.stack.up(progress=lambda msg: None)
        self.revive_crashed()
        unhealthy = [row.name for row in self.stack.status() if not row.healthy]
        down = [name for name, record in self.workers.status().items() if record is None]
        return Invariant("stack and workers healthy at the end", "all up", ", ".join(unhealthy + down) or "all up",
                         not unhealthy and not down)


@dataclass
class ChaosReport:
    run: str
    seed: int
    planned: list[Disruption]
    done: list[tuple[Disruption, float, float]] = field(default_factory=list)
    """(disruption, seconds into the run when it began, seconds until the target was back)."""
    status: str = "unknown"
    invariants: list[Invariant] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.invariants) and all(inv.ok for inv in self.invariants)


async def run_under_chaos(client: Client, db: Database, store: ObjectStore, monkey: Monkey, cfg: RunConfig,
                          seed: int, schedule: list[Disruption], max_minutes: float,
                          run_timeout_s: float = 1800.0) -> ChaosReport:
    """Start `cfg`, apply `schedule` while it runs (stopping early when the run ends or `max_minutes`
    pass), wait for the run and the groups it abandoned, heal everything, check the invariants."""
    say = monkey.progress
    report = ChaosReport(cfg.name, seed, schedule)
    handle = await start_run(client, cfg)
    t0 = time.monotonic()
    say(f"run [bold]{cfg.name}[/] started ({cfg.steps} steps); chaos seed {seed}, {len(schedule)} disruptions")
    for d in schedule:
        mark = await asyncio.to_thread(_progress, db, cfg.name)
        # each disruption lands on a run that moved since the previous one, so they spread over
        # its phases (base sync, rollouts, steps, syncs) instead of piling up at its start
        if not await _moved_on(handle, db, cfg.name, mark, d.gap_s) or time.monotonic() - t0 > max_minutes * 60:
            break
        await asyncio.to_thread(monkey.revive_crashed)
        began = time.monotonic()
        await asyncio.to_thread(monkey.disrupt, d)
        report.done.append((d, began - t0, time.monotonic() - began))
        say(f"  {began - t0:6.1f}s  {d.target:<12} down {d.down_s:.1f}s, back after {time.monotonic() - began:5.1f}s"
            f"  (step {_steps_done(db, cfg.name)}/{cfg.steps})")
    say(f"{len(report.done)}/{len(schedule)} disruptions done; waiting for the run to finish")
    report.status = await _wait_closed(handle, run_timeout_s, monkey)
    say(f"run {report.status.lower()} after {time.monotonic() - t0:.0f}s; waiting for its last groups to close")
    await asyncio.to_thread(wait_for, lambda: not monkey.revive_crashed() and _running_groups(db, cfg.name) == 0,
                            SETTLE_TIMEOUT_S, 2.0)
    healthy = await asyncio.to_thread(monkey.heal)
    started = await _groups_started(client, cfg.workflow_id)
    with db.begin() as s:
        report.invariants = check_run(s, cfg.name, store=store, groups_started=started)
    report.invariants += [Invariant("run workflow closed (Temporal)", "COMPLETED", report.status,
                                    report.status == "COMPLETED"),
                          Invariant("no worker died unless killed", "none", ", ".join(monkey.crashed) or "none",
                                    not monkey.crashed), healthy]
    report.wall_s = time.monotonic() - t0
    return report


async def _moved_on(handle: WorkflowHandle, db: Database, run: str, mark: int, gap_s: float) -> bool:
    """Wait `gap_s`, then until the run's progress count passes `mark` (at most PROGRESS_WAIT_S);
    False if the run closed meanwhile."""
    await asyncio.sleep(gap_s)
    deadline = time.monotonic() + PROGRESS_WAIT_S
    while await _status(handle) in (None, WorkflowExecutionStatus.RUNNING):
        if time.monotonic() > deadline or await asyncio.to_thread(_progress, db, run) > mark:
            return True
        await asyncio.sleep(0.5)
    return False


async def _status(handle: WorkflowHandle) -> WorkflowExecutionStatus | None:
    """The run's status, or None while Temporal does not answer (it may be restarting)."""
    try:
        return (await handle.describe()).status
    except RPCError:
        return None


async def _wait_closed(handle: WorkflowHandle, timeout_s: float, monkey: Monkey) -> str:
    """The run's final status; meanwhile a worker that crashes is restarted (and counted), as a
    supervisor would, so that the run can still end and the report be printed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = await _status(handle)
        if status not in (None, WorkflowExecutionStatus.RUNNING):
            return status.name
        await asyncio.to_thread(monkey.revive_crashed)
        await asyncio.sleep(2.0)
    return "STILL RUNNING"


async def _groups_started(client: Client, run_workflow_id: str) -> int | None:
    """Rollout-group workflows Temporal knows for the run: the orchestrator's own count of the
    groups it started, independent of the database (None if visibility cannot say)."""
    try:
        return (await client.count_workflows(f'WorkflowId STARTS_WITH "{run_workflow_id}-group-"')).count
    except RPCError:
        return None


def _scalar(db: Database, sql: str, run: str) -> int:
    try:
        with db.begin() as s:
            return int(s.scalar(sa.text(sql), {"run": run}) or 0)
    except sa.exc.OperationalError:
        return -1  # the database is down (restarting): not known now


def _progress(db: Database, run: str) -> int:
    """Model turns written plus steps committed plus syncs verified: grows whenever the run moves."""
    return _scalar(db, """
        select (select count(*) from turns tu join trajectories t on t.id = tu.trajectory_id where t.run_id = :run)
             + (select count(*) from train_steps where run_id = :run)
             + (select count(*) from sync_events where run_id = :run and status = 'ok')""", run)


def _steps_done(db: Database, run: str) -> int:
    return _scalar(db, "select count(*) from train_steps where run_id = :run", run)


def _running_groups(db: Database, run: str) -> int:
    return _scalar(db, "select count(*) from rollout_groups where run_id = :run and status = 'running'", run)


# -- output ---------------------------------------------------------------------------------------
def plan_table(schedule: Sequence[Disruption], seed: int) -> Table:
    table = Table(title=f"chaos plan (seed {seed})")
    for col in ("#", "target", "gap before (s)", "down (s)"):
        table.add_column(col)
    for i, d in enumerate(schedule, 1):
        table.add_row(str(i), d.target, f"{d.gap_s:.1f}", f"{d.down_s:.1f}")
    return table


def invariant_table(report: ChaosReport) -> Table:
    table = Table(title=f"invariants of run {report.run} after {len(report.done)} disruptions "
                        f"({report.wall_s:.0f}s, seed {report.seed})")
    for col in ("invariant", "expected", "observed", "pass"):
        table.add_column(col, overflow="fold")
    for inv in report.invariants:
        table.add_row(inv.name, inv.expected, inv.observed, "[green]yes[/]" if inv.ok else "[red]NO[/]")
    return table


# -- `rlpipe chaos` -------------------------------------------------------------------------------
def main_chaos(config_file: Path, kills: int, minutes: float, seed: int | None, hard: bool, steps: int | None,
               stack_config: Path | None = None, console: Console | None = None) -> int:
    """Bring up the local stack (+ a vLLM server with the config's model) and the workers, run the
    config under chaos, print the plan, the progress and the invariant table; 0 if all hold."""
    from alembic import command

    from rlpipe.infra.endpoints import resolve_endpoints
    from rlpipe.infra.settings import load_settings, save_settings
    from rlpipe.migrations import alembic_config
    from rlpipe.schemas.config import load_run_config
    from rlpipe.workers.common import connect

    console = console or Console()
    overrides: dict[str, object] = {"name": f"chaos-{time.strftime('%Y%m%d-%H%M%S')}"}
    if steps is not None:
        overrides["steps"] = steps
    cfg = load_run_config(config_file, overrides)
    settings = load_settings(stack_config)
    if not settings.inference_servers and not settings.external_inference_urls:
        settings.inference_servers, settings.inference_model = 1, Path(cfg.model.path).resolve()
        save_settings(settings)
    stack = Stack(settings)
    stack.up(progress=lambda msg: console.print(f"  {msg}"))
    endpoints = resolve_endpoints(settings)
    command.upgrade(alembic_config(endpoints.database_url), "head")
    workers = WorkerSet(settings)
    workers.up(progress=lambda msg: console.print(f"  {msg}"))

    seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
    monkey = Monkey(stack, workers, hard=hard, progress=console.print)
    schedule = plan(seed, kills, monkey.targets())
    console.print(plan_table(schedule, seed))
    db = Database(endpoints.database_url)

    async def go() -> ChaosReport:
        client = await connect(endpoints)
        return await run_under_chaos(client, db, ObjectStore.from_endpoints(endpoints), monkey, cfg, seed, schedule,
                                     minutes)

    try:
        report = asyncio.run(go())
    finally:
        db.dispose()
    console.print(invariant_table(report))
    console.print(f"rerun this plan with --seed {seed}; "
                  "stop everything with `rlpipe workers down && rlpipe stack down`")
    return 0 if report.ok else 1
