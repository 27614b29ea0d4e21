"""The `rlpipe` command line. Heavy modules (torch, vLLM, Temporal workers) are imported inside
the command that needs them, so `rlpipe --help` answers at once."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from rich.console import Console
from rich.table import Table
from rich.text import Text

from rlpipe.configs import shipped_config

if TYPE_CHECKING:  # imported inside the commands that use them, to keep `rlpipe --help` fast
    from alembic.config import Config as AlembicConfig
    from temporalio.client import Client

    from rlpipe.infra.stack import ServiceStatus, Stack
    from rlpipe.workers.launcher import WorkerSet

T = TypeVar("T")

console = Console()


class CliError(Exception):
    """An error to print as one clear line (no traceback) with exit status 2."""


# -- stack ---------------------------------------------------------------------------------------
def _stack(args: argparse.Namespace) -> Stack:
    from rlpipe.infra.settings import load_settings
    from rlpipe.infra.stack import Stack

    settings = load_settings(args.config)
    if getattr(args, "inference", None) is not None:
        settings.inference_servers = args.inference
    if getattr(args, "model", None) is not None:
        settings.inference_model = args.model.resolve()
    return Stack(settings)


def cmd_stack_up(args: argparse.Namespace) -> None:
    stack = _stack(args)
    stack.up(only=args.services or None, progress=lambda msg: console.print(f"  {msg}"))
    print_status(stack)
    from rlpipe.infra.endpoints import resolve_endpoints
    from rlpipe.migrations import alembic_config

    if stack.settings.external_database_url is None and not args.services:
        from alembic import command

        command.upgrade(alembic_config(resolve_endpoints(stack.settings).database_url), "head")
        console.print("  database: migrations applied (alembic head)")


def cmd_stack_down(args: argparse.Namespace) -> None:
    _stack(args).down(only=args.services or None, progress=lambda msg: console.print(f"  {msg}"))


def cmd_stack_status(args: argparse.Namespace) -> None:
    stack = _stack(args)
    if not print_status(stack):
        raise SystemExit(1)


def print_status(stack: Stack) -> bool:
    table = Table(title="rlpipe stack")
    for col in ("service", "address", "pid", "health", "log"):
        table.add_column(col)
    rows = stack.status()
    for row in rows:
        health = "[green]healthy[/]" if row.healthy else f"[red]{row.detail}[/]"
        table.add_row(row.name, row.address, str(row.pid or "-"), health, row.log or "(external)")
    console.print(table)
    print_strays(rows)
    if stack.settings.temporal_ui_url:
        console.print(f"Temporal Web UI: {stack.settings.temporal_ui_url}")
    return all(row.healthy for row in rows)


def print_strays(rows: Sequence[ServiceStatus]) -> None:
    """The processes that outlived their service's main process, with the memory they hold."""
    strays = [(row.name, stray) for row in rows for stray in row.strays]
    if not strays:
        return
    table = Table(title="stray processes: their service's main process is gone "
                        "(`rlpipe stack up` or `rlpipe stack down` stops them)")
    for col in ("service", "pid", "rss", "command"):
        table.add_column(col)
    for name, stray in strays:
        table.add_row(name, str(stray.pid), f"{stray.rss_bytes / 2**20:.0f} MiB", Text(stray.command))
    console.print(table)


def cmd_stack_logs(args: argparse.Namespace) -> None:
    svc = _stack(args).service(args.service)
    if not svc.log.exists():
        raise CliError(f"{svc.name} has no log yet at {svc.log}")
    lines = svc.log.read_text(errors="replace").splitlines()[-args.lines:]
    print("\n".join(lines))
    if args.follow:
        with open(svc.log, errors="replace") as f:
            f.seek(0, 2)
            while True:
                line = f.readline()
                if line:
                    print(line, end="")
                else:
                    time.sleep(0.5)


def cmd_stack_env(args: argparse.Namespace) -> None:
    """Print `export` lines that point a shell (or another machine's workers) at this stack."""
    from rlpipe.infra.endpoints import libpq_url, resolve_endpoints

    ep = resolve_endpoints(_stack(args).settings)
    print(f"export TEMPORAL_ADDRESS={ep.temporal_address}")
    print(f"export DATABASE_URL='{libpq_url(ep.database_url)}'")  # psql takes it too
    print(f"export S3_ENDPOINT_URL={ep.s3_endpoint or ''}")
    print(f"export AWS_ACCESS_KEY_ID={ep.s3_access_key or ''}")
    print(f"export AWS_SECRET_ACCESS_KEY='{ep.s3_secret_key or ''}'")
    print(f"export RLPIPE_BUCKET={ep.bucket}")
    if ep.inference_urls:
        print(f"export INFERENCE_URLS={','.join(ep.inference_urls)}")
    if ep.inference_urls and ep.inference_token:
        print(f"export RLPIPE_INFERENCE_TOKEN='{ep.inference_token}'")  # what a remote sync sidecar sends


# -- temporal ------------------------------------------------------------------------------------
def cmd_temporal_prepare(args: argparse.Namespace) -> None:
    """Register the run's search attributes on the configured namespace, or say what is missing."""
    import asyncio

    from rlpipe.infra.settings import load_settings
    from rlpipe.infra.temporal_client import TemporalUnreachable, connect_temporal, temporal_connection
    from rlpipe.infra.temporal_cluster import Finding, prepare_cluster

    settings = load_settings(args.config)
    conn = temporal_connection(settings.temporal_address, settings.temporal_namespace,
                               external=settings.external_temporal is not None)

    async def go() -> list[Finding]:
        return await prepare_cluster(await connect_temporal(conn), conn.namespace)

    try:
        findings = asyncio.run(go())
    except TemporalUnreachable as exc:
        raise CliError(str(exc)) from exc
    table = Table(title=f"Temporal at {conn.address}, namespace {conn.namespace}")
    for col in ("item", "ready", "detail"):
        table.add_column(col)
    for f in findings:
        table.add_row(f.item, "[green]yes[/]" if f.ok else "[red]no[/]", Text(f.detail))
    console.print(table)
    if not all(f.ok for f in findings):
        sys.exit(1)


# -- db ------------------------------------------------------------------------------------------
def _alembic(args: argparse.Namespace) -> AlembicConfig:
    from rlpipe.infra.endpoints import resolve_endpoints
    from rlpipe.infra.settings import load_settings
    from rlpipe.migrations import alembic_config

    return alembic_config(resolve_endpoints(load_settings(args.config)).database_url)


def cmd_db_upgrade(args: argparse.Namespace) -> None:
    from alembic import command

    command.upgrade(_alembic(args), args.revision)


def cmd_db_downgrade(args: argparse.Namespace) -> None:
    from alembic import command

    command.downgrade(_alembic(args), args.revision)


def cmd_db_current(args: argparse.Namespace) -> None:
    from alembic import command

    command.current(_alembic(args), verbose=args.verbose)


# -- model ---------------------------------------------------------------------------------------
def cmd_model_prepare(args: argparse.Namespace) -> None:
    from rlpipe.infra.settings import load_settings

    home = load_settings(args.config).home.resolve()
    from rlpipe.policy.models import prepare_smollm2, prepare_tiny

    if args.which in ("tiny", "all"):
        console.print(f"tiny test model: {prepare_tiny(home / 'models' / 'tiny')}")
    if args.which in ("smollm2", "all"):
        console.print(f"SmolLM2-135M-Instruct (fp32 safetensors): {prepare_smollm2(home / 'models' / 'smollm2')}")


# -- workers -------------------------------------------------------------------------------------
def _workers(args: argparse.Namespace) -> WorkerSet:
    from rlpipe.infra.settings import load_settings
    from rlpipe.workers.launcher import WorkerSet

    return WorkerSet(load_settings(args.config))


def cmd_workers_up(args: argparse.Namespace) -> None:
    _workers(args).up(only=args.workers or None, progress=lambda msg: console.print(f"  {msg}"))


def cmd_workers_down(args: argparse.Namespace) -> None:
    _workers(args).down(only=args.workers or None, progress=lambda msg: console.print(f"  {msg}"))


def cmd_workers_status(args: argparse.Namespace) -> None:
    table = Table(title="rlpipe workers")
    for col in ("worker", "pid", "log"):
        table.add_column(col)
    workers = _workers(args)
    for name, record in workers.status().items():
        table.add_row(name, str(record.pid) if record else "[red]not running[/]", str(workers.log(name)))
    console.print(table)


def cmd_worker(args: argparse.Namespace) -> None:
    from rlpipe.workers.main import main as worker_main

    worker_main([args.kind] + (["--server", args.server] if args.server else [])
                + (["--url", args.url] if args.url else []) + ["--per-host", str(args.per_host)])


# -- runs ----------------------------------------------------------------------------------------
async def _client() -> Client:
    from rlpipe.infra.endpoints import START_THE_STACK
    from rlpipe.infra.temporal_client import TemporalUnreachable
    from rlpipe.workers.common import connect, endpoints

    ep = endpoints()
    try:
        return await connect(ep)
    except TemporalUnreachable as exc:
        raise CliError(f"{exc}; if the stack is not running, {START_THE_STACK}") from exc


def cmd_run_start(args: argparse.Namespace) -> None:
    import asyncio

    from rich.markup import escape

    from rlpipe.cli import run_commands
    from rlpipe.cli.own_tasks import check_tasks_here
    from rlpipe.schemas.config import load_run_config

    overrides = {"name": args.name} if args.name else {}
    config = load_run_config(args.config_file, overrides)  # a bad config stops here, before any run
    warning = check_tasks_here(config)  # and so does bad data
    if warning:
        console.print(f"[yellow]warning:[/] {escape(warning)}")

    async def go() -> None:
        client = await _client()
        handle = await run_commands.start_run(client, config)
        console.print(f"run [bold]{config.name}[/] started: workflow {handle.id}")
        from rlpipe.infra.settings import load_settings

        ui = load_settings(args.config).temporal_ui_url
        if ui:
            console.print(f"Temporal UI: {ui}/namespaces/default/workflows/{handle.id}")
        if args.watch:
            closed = await run_commands.watch(client, config.name)
            console.print(f"run {config.name}: {closed.name.lower()}")
            if closed.name != "COMPLETED":
                raise SystemExit(1)

    asyncio.run(go())


def cmd_plugins_list(args: argparse.Namespace) -> None:
    from rlpipe.cli.own_tasks import print_plugins
    from rlpipe.envs.registry import ENVIRONMENTS
    from rlpipe.graders.registry import GRADERS

    print_plugins(console, ENVIRONMENTS if args.group == "envs" else GRADERS)


def _run_call(fn: Callable[[Client], Awaitable[T]]) -> T:
    import asyncio

    async def go() -> T:
        return await fn(await _client())

    return asyncio.run(go())


def cmd_run_status(args: argparse.Namespace) -> None:
    from rlpipe.cli import run_commands

    if args.watch:
        closed = _run_call(lambda c: run_commands.watch(c, args.run))
        console.print(f"run {args.run}: {closed.name.lower()}")
        return
    status = _run_call(lambda c: run_commands.run_status(c, args.run))
    console.print(run_commands.status_table(status))
    _print_trackers(status.run)
    if status.close_reason is not None:  # failed or cancelled: scripts see it in the exit status
        raise SystemExit(1)


def _print_trackers(run_id: str) -> None:
    """The run's experiment trackers, read from Postgres; a tracker that is not receiving is a warning."""
    import sqlalchemy as sa

    from rlpipe.storage.db import Database
    from rlpipe.tracking.cursor import tracker_lines
    from rlpipe.workers.common import endpoints

    db = Database(endpoints().database_url)
    try:
        with db.begin() as s:
            lines = tracker_lines(s, run_id)
    except sa.exc.OperationalError as exc:  # the status above came from Temporal: still worth showing
        lines = [(f"cannot read the trackers' cursors from Postgres: {exc.orig}", True)]
    finally:
        db.dispose()
    for line, warning in lines:
        console.print(Text(f"tracking  {line}", style="yellow" if warning else ""))


def cmd_run_pause(args: argparse.Namespace) -> None:
    from rlpipe.cli import run_commands

    console.print(run_commands.status_table(_run_call(lambda c: run_commands.pause(c, args.run, args.reason))))


def cmd_run_resume(args: argparse.Namespace) -> None:
    from rlpipe.cli import run_commands

    console.print(run_commands.status_table(_run_call(lambda c: run_commands.resume(c, args.run))))


def cmd_run_schedule(args: argparse.Namespace) -> None:
    from rlpipe.cli import run_commands
    from rlpipe.schemas.payloads import ScheduleUpdate

    update = ScheduleUpdate(sync_interval=args.sync_interval, max_staleness=args.max_staleness)
    console.print(run_commands.status_table(_run_call(lambda c: run_commands.set_schedule(c, args.run, update))))


def cmd_run_drain(args: argparse.Namespace) -> None:
    from rlpipe.cli import run_commands
    from rlpipe.schemas.payloads import DrainRequest

    request = DrainRequest(args.server, move=args.move)
    console.print(run_commands.status_table(_run_call(lambda c: run_commands.drain_server(c, args.run, request))))


def cmd_run_join(args: argparse.Namespace) -> None:
    from rlpipe.cli import run_commands
    from rlpipe.schemas.payloads import JoinRequest

    request = JoinRequest(args.server)
    console.print(run_commands.status_table(_run_call(lambda c: run_commands.join_server(c, args.run, request))))


def cmd_run_cancel(args: argparse.Namespace) -> None:
    from rlpipe.cli import run_commands

    _run_call(lambda c: run_commands.cancel(c, args.run))
    console.print(f"run {args.run}: cancellation requested")


def cmd_run_checkpoints(args: argparse.Namespace) -> None:
    from rlpipe.storage.db import Database
    from rlpipe.storage.object_store import ObjectStore
    from rlpipe.storage.runs import load_run_config
    from rlpipe.weights.retention import retention_rows, survey
    from rlpipe.workers.common import endpoints

    ep = endpoints()
    db, store = Database(ep.database_url), ObjectStore.from_endpoints(ep)
    try:
        with db.begin() as s:
            policy = load_run_config(s, args.run).retention
        found = survey(db, store, args.run, policy)
    except LookupError as exc:
        raise CliError(str(exc)) from exc
    finally:
        db.dispose()
    table = Table(title=f"checkpoints of run {args.run} (retention: keep_last {policy.keep_last or 'all'}"
                        f"{f', keep_every {policy.keep_every}' if policy.keep_every else ''})")
    for col in ("version", "trained steps", "MB", "optimizer state", "status"):
        table.add_column(col)
    for row in retention_rows(found):
        table.add_row(*row)
    console.print(table)
    stored = sum(o.size for o in store.list(f"runs/{args.run}/"))
    console.print(f"{stored / 1e6:.1f} MB in the object store under runs/{args.run}/")


def cmd_run_list(args: argparse.Namespace) -> None:
    from rlpipe.cli import run_commands

    table = Table(title="runs")
    for col in ("workflow", "status", "started"):
        table.add_column(col)
    for row in _run_call(run_commands.list_runs):
        table.add_row(*row)
    console.print(table)


def cmd_codec(args: argparse.Namespace) -> None:
    from rlpipe.security.codec import EncryptionCodec
    from rlpipe.security.codec_server import serve

    codec = EncryptionCodec.from_environment()
    if codec is None:
        raise CliError("RLPIPE_PAYLOAD_KEY is not set: there is nothing to decode with")
    server = serve(codec, args.host, args.port, args.origin)
    console.print(f"codec server on http://{args.host}:{server.server_port} (UI origin {args.origin}); "
                  f"start the stack with ui_codec_endpoint = \"http://{args.host}:{server.server_port}\"")
    server.serve_forever()


def cmd_demo(args: argparse.Namespace) -> None:
    from rlpipe.cli.demo import run_demo

    sys.exit(run_demo(args.config_file))


def cmd_chaos(args: argparse.Namespace) -> None:
    from rlpipe.cli.chaos import main_chaos

    sys.exit(main_chaos(args.config_file, kills=args.kills, minutes=args.minutes, seed=args.seed, hard=args.hard,
                        steps=args.steps, stack_config=args.config, console=console))


def _observe(tool: str, argv: list[str]) -> int:
    """`rlpipe report|doctor ...` is `python -m rlpipe.observe.report|doctor ...`."""
    if tool == "report":
        from rlpipe.observe.report import main as report_main

        return report_main(argv)
    from rlpipe.observe.doctor import main as doctor_main

    return doctor_main(argv)


def cmd_eval(args: argparse.Namespace) -> None:
    """Evaluate the version an inference server holds, directly (no Temporal), and record it."""
    import asyncio

    import httpx

    from rlpipe.evaluation.heldout import EvalOutcome, evaluate_served_version
    from rlpipe.graders.base import GraderDeps
    from rlpipe.graders.registry import build_rubric_graders
    from rlpipe.inference.client import InferenceClient
    from rlpipe.infra.inference import SERVED_MODEL_NAME
    from rlpipe.rollout.context import RunContexts
    from rlpipe.sandbox.executor import SandboxExecutor
    from rlpipe.sandbox.runner import Sandbox
    from rlpipe.storage.db import Database
    from rlpipe.storage.evals import record_eval
    from rlpipe.workers.common import endpoints, server_urls

    ep = endpoints()
    urls = server_urls(ep)
    if args.server not in urls:
        raise CliError(f"no inference server '{args.server}' (known: {sorted(urls) or 'none'})")
    db = Database(ep.database_url)
    ctx = RunContexts(db).get(args.run)
    prompts = args.prompts if args.prompts is not None else ctx.config.eval.prompts

    async def go() -> tuple[int, EvalOutcome]:
        async with Sandbox() as sandbox, httpx.AsyncClient(timeout=120) as http, \
                InferenceClient(urls[args.server], SERVED_MODEL_NAME, route="generate") as client:
            executor = SandboxExecutor(sandbox)
            rubric, graders = build_rubric_graders(ctx.env.rubric, ctx.config.grader, GraderDeps(executor, http))
            version = args.version if args.version is not None else int(await client.weight_version())
            return version, await evaluate_served_version(client, ctx.env, ctx.tokenizer, executor, rubric, graders,
                                                          version, prompts, ctx.config.eval.max_tokens,
                                                          ctx.config.model.max_model_len)

    version, outcome = asyncio.run(go())
    low, high = outcome.interval
    with db.begin() as s:
        record_eval(s, run_id=args.run, version=version, split="eval", n_prompts=outcome.n_prompts,
                    n_correct=outcome.n_correct, mean_reward=outcome.mean_reward,
                    details={"ci95": [low, high], "server": args.server, "by": "rlpipe eval"})
    console.print(f"run {args.run} v{version}: accuracy {outcome.accuracy:.1%} (95% CI {low:.1%}–{high:.1%}) "
                  f"on {outcome.n_prompts} held-out prompts, mean reward {outcome.mean_reward:.3f}")


# -- parser --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlpipe", description=__doc__)
    parser.add_argument("--config", type=Path, default=None,
                        help="stack settings file (default: $RLPIPE_CONFIG or ./rlpipe.toml)")
    groups = parser.add_subparsers(dest="group", required=True)

    def command(group: argparse._SubParsersAction, name: str, fn: Callable[[argparse.Namespace], None],
                help: str) -> argparse.ArgumentParser:
        p = group.add_parser(name, help=help, description=help)
        p.set_defaults(fn=fn)
        return p

    stack = groups.add_parser("stack", help="the local stack of real servers").add_subparsers(dest="cmd", required=True)
    up = command(stack, "up", cmd_stack_up, "start Temporal, Postgres, SeaweedFS (and vLLM) if not running")
    up.add_argument("services", nargs="*", help="only these services")
    up.add_argument("--inference", type=int, default=None, help="number of local vLLM servers")
    up.add_argument("--model", type=Path, default=None, help="model directory the vLLM servers load")
    down = command(stack, "down", cmd_stack_down, "stop what `stack up` started")
    down.add_argument("services", nargs="*", help="only these services")
    command(stack, "status", cmd_stack_status, "each service, its address, pid and health")
    logs = command(stack, "logs", cmd_stack_logs, "show a service's log")
    logs.add_argument("service")
    logs.add_argument("-n", "--lines", type=int, default=50)
    logs.add_argument("-f", "--follow", action="store_true")
    command(stack, "env", cmd_stack_env, "print export lines with the stack's addresses and credentials")

    temporal = groups.add_parser("temporal", help="the Temporal cluster").add_subparsers(dest="cmd", required=True)
    command(temporal, "prepare", cmd_temporal_prepare,
            "check the namespace and register the run's search attributes (idempotent; exit 1 if something "
            "is missing or not allowed)")

    db = groups.add_parser("db", help="database migrations (Alembic)").add_subparsers(dest="cmd", required=True)
    command(db, "upgrade", cmd_db_upgrade, "apply migrations").add_argument("revision", nargs="?", default="head")
    command(db, "downgrade", cmd_db_downgrade, "revert migrations").add_argument("revision", nargs="?", default="-1")
    command(db, "current", cmd_db_current, "show the applied revision").add_argument("-v", "--verbose",
                                                                                      action="store_true")
    model = groups.add_parser("model", help="model files").add_subparsers(dest="cmd", required=True)
    prepare = command(model, "prepare", cmd_model_prepare,
                      "build the tiny test model and/or convert SmolLM2-135M-Instruct to safetensors")
    prepare.add_argument("which", nargs="?", choices=["tiny", "smollm2", "all"], default="all")

    workers = groups.add_parser("workers", help="the worker processes").add_subparsers(dest="cmd", required=True)
    for name, fn, text in (("up", cmd_workers_up, "start rollout, sandbox, grader, trainer and sync workers"),
                           ("down", cmd_workers_down, "stop the workers `workers up` started")):
        command(workers, name, fn, text).add_argument("workers", nargs="*", help="only these workers")
    command(workers, "status", cmd_workers_status, "which workers are running")
    worker = groups.add_parser("worker", help="run one worker in the foreground")
    worker.add_argument("kind", choices=["rollout", "sandbox", "grader", "trainer", "sidecar", "ranks"],
                        help="ranks: the trainer's data-parallel ranks on another host (docs/multi-host.md)")
    worker.add_argument("--server", help="sidecar only: the inference server's name")
    worker.add_argument("--url", help="sidecar only: the URL of a server not in INFERENCE_URLS (it registers it)")
    worker.add_argument("--per-host", type=int, default=1, help="ranks only: the trainer's ranks on this host")
    worker.set_defaults(fn=cmd_worker)

    run = groups.add_parser("run", help="training runs").add_subparsers(dest="cmd", required=True)
    start = command(run, "start", cmd_run_start, "validate a run config (TOML) and start the run")
    start.add_argument("config_file", type=Path)
    start.add_argument("--name", help="run name (overrides the config's)")
    start.add_argument("--watch", action="store_true", help="show live progress until the run ends")
    status = command(run, "status", cmd_run_status, "the run's state (or --watch its progress)")
    status.add_argument("run")
    status.add_argument("--watch", action="store_true")
    pause = command(run, "pause", cmd_run_pause, "stop starting rollouts and train steps")
    pause.add_argument("run")
    pause.add_argument("--reason", default="paused by user")
    command(run, "resume", cmd_run_resume, "resume a paused run").add_argument("run")
    schedule = command(run, "schedule", cmd_run_schedule, "change sync interval / max staleness of a running run")
    schedule.add_argument("run")
    schedule.add_argument("--sync-interval", type=int)
    schedule.add_argument("--max-staleness", type=int)
    drain = command(run, "drain", cmd_run_drain, "take an inference server out of a running run: its groups "
                                                 "finish (or --move to the other servers), nothing new goes to it")
    drain.add_argument("run")
    drain.add_argument("server", help="the server's name, as `rlpipe run status` lists it")
    drain.add_argument("--move", action="store_true", help="move its groups in flight to the other servers now")
    join = command(run, "join", cmd_run_join, "add an inference server to a running run: it loads the current "
                                              "version and takes groups once that is verified")
    join.add_argument("run")
    join.add_argument("server", help="the server's name: configured (INFERENCE_URLS) or registered by its "
                                     "sidecar (`rlpipe worker sidecar --server NAME --url URL`)")
    command(run, "cancel", cmd_run_cancel, "cancel a run").add_argument("run")
    command(run, "list", cmd_run_list, "runs known to Temporal")
    command(run, "checkpoints", cmd_run_checkpoints, "the run's versions: which keep their bytes and why, which "
                                                     "the retention policy deleted, and the space they take"
            ).add_argument("run")
    for group, kind in (("envs", "environments"), ("graders", "graders")):
        listing = groups.add_parser(group, help=f"the {kind} runs can use").add_subparsers(dest="cmd", required=True)
        command(listing, "list", cmd_plugins_list, f"the {kind} available here and where each comes from "
                                                   "(rlpipe, an installed package's entry point, an import path)")
    report = groups.add_parser("report", help="plots and a summary page for a run (PNG, markdown, HTML)")
    report.add_argument("run")
    report.add_argument("--out", type=Path, help="output directory (default reports/RUN)")
    report.set_defaults(fn=lambda a: sys.exit(_observe("report", [a.run, *(["--out", str(a.out)] if a.out else [])])))
    doctor = groups.add_parser("doctor", help="diagnose a run: evidence, verdict and remedy per check; exit 1 "
                                              "on a problem")
    doctor.add_argument("run")
    doctor.set_defaults(fn=lambda a: sys.exit(_observe("doctor", [a.run])))

    codec = groups.add_parser("codec", help="serve the payload codec so the Web UI can show encrypted payloads")
    codec.add_argument("--host", default="127.0.0.1")
    codec.add_argument("--port", type=int, default=18234)
    codec.add_argument("--origin", default="http://127.0.0.1:18233", help="the Temporal UI's origin (CORS)")
    codec.set_defaults(fn=cmd_codec)

    demo = groups.add_parser("demo", help="the main job: prepare SmolLM2, start everything, train, evaluate, report")
    demo.add_argument("config_file", nargs="?", type=Path, default=shipped_config("demo.toml"))
    demo.set_defaults(fn=cmd_demo)

    chaos = groups.add_parser("chaos", help="a run under fire: kill and restart workers and servers at random, "
                                            "then check the run's invariants; exit 1 if one fails")
    chaos.add_argument("config_file", type=Path, help="run config (TOML), e.g. configs/tiny-calculator.toml")
    chaos.add_argument("--kills", type=int, default=9, help="disruptions (each target once per round)")
    chaos.add_argument("--minutes", type=float, default=10.0, help="stop disrupting after this long")
    chaos.add_argument("--seed", type=int, help="seed of the plan (printed; default: random)")
    chaos.add_argument("--steps", type=int, help="override the config's steps")
    chaos.add_argument("--hard", action="store_true", help="SIGKILL Temporal, Postgres and SeaweedFS too "
                                                           "(default: their ordinary stop)")
    chaos.set_defaults(fn=cmd_chaos)

    evaluate = groups.add_parser("eval", help="held-out accuracy of the version a server holds")
    evaluate.add_argument("run")
    evaluate.add_argument("--version", type=int, help="the version to evaluate (the server must hold it)")
    evaluate.add_argument("--server", default="0", help="inference server id")
    evaluate.add_argument("--prompts", type=int, help="eval prompts (default: the run's eval.prompts)")
    evaluate.set_defaults(fn=cmd_eval)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except CliError as exc:
        print_error(exc)
        sys.exit(2)
    except Exception as exc:  # noqa: BLE001 - known error types print as one line
        from rlpipe.cli.run_commands import RunCommandError
        from rlpipe.evaluation.heldout import WrongVersionServed
        from rlpipe.infra.endpoints import StackNotRunning
        from rlpipe.infra.settings import SettingsError
        from rlpipe.infra.stack import StackError
        from rlpipe.infra.temporal_client import TemporalSettingsError
        from rlpipe.schemas.config import ConfigError
        from rlpipe.workers.launcher import WorkerStartError

        if isinstance(exc, StackError | StackNotRunning | SettingsError | ConfigError | RunCommandError |
                      WorkerStartError | WrongVersionServed | TemporalSettingsError):
            print_error(exc)
            sys.exit(2)
        raise


def print_error(exc: Exception) -> None:
    """One line per error. The message is escaped: its brackets (a name pattern such as
    '^[a-z0-9]...', a list) are text, not rich markup that would be dropped or fail to parse."""
    from rich.markup import escape

    console.print(f"[red]error:[/] {escape(str(exc))}")


if __name__ == "__main__":
    main()
