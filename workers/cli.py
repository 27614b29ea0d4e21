"""The `rlpipe` command line. Heavy modules (torch, vLLM, Temporal workers) are imported inside
the command that needs them, so `rlpipe --help` answers at once."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console()


class CliError(Exception):
    """An error to print as one clear line (no traceback) with exit status 2."""


# -- stack ---------------------------------------------------------------------------------------
def _stack(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from infra.settings import load_settings
    from infra.stack import Stack

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
    from infra.endpoints import resolve_endpoints

    from migrations import alembic_config

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


def print_status(stack) -> bool:  # type: ignore[no-untyped-def]
    table = Table(title="rlpipe stack")
    for col in ("service", "address", "pid", "health", "log"):
        table.add_column(col)
    rows = stack.status()
    for row in rows:
        health = "[green]healthy[/]" if row.healthy else f"[red]{row.detail}[/]"
        table.add_row(row.name, row.address, str(row.pid or "-"), health, row.log or "(external)")
    console.print(table)
    if stack.settings.temporal_ui_url:
        console.print(f"Temporal Web UI: {stack.settings.temporal_ui_url}")
    return all(row.healthy for row in rows)


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
    from infra.endpoints import resolve_endpoints

    ep = resolve_endpoints(_stack(args).settings)
    print(f"export TEMPORAL_ADDRESS={ep.temporal_address}")
    print(f"export DATABASE_URL='{ep.database_url}'")
    print(f"export S3_ENDPOINT_URL={ep.s3_endpoint or ''}")
    print(f"export AWS_ACCESS_KEY_ID={ep.s3_access_key or ''}")
    print(f"export AWS_SECRET_ACCESS_KEY='{ep.s3_secret_key or ''}'")
    print(f"export RLPIPE_BUCKET={ep.bucket}")
    if ep.inference_urls:
        print(f"export INFERENCE_URLS={','.join(ep.inference_urls)}")


# -- db ------------------------------------------------------------------------------------------
def _alembic(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from infra.endpoints import resolve_endpoints
    from infra.settings import load_settings

    from migrations import alembic_config

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

    db = groups.add_parser("db", help="database migrations (Alembic)").add_subparsers(dest="cmd", required=True)
    command(db, "upgrade", cmd_db_upgrade, "apply migrations").add_argument("revision", nargs="?", default="head")
    command(db, "downgrade", cmd_db_downgrade, "revert migrations").add_argument("revision", nargs="?", default="-1")
    command(db, "current", cmd_db_current, "show the applied revision").add_argument("-v", "--verbose",
                                                                                      action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except CliError as exc:
        console.print(f"[red]error:[/] {exc}")
        sys.exit(2)
    except Exception as exc:  # noqa: BLE001 - known error types print as one line
        from infra.settings import SettingsError
        from infra.stack import StackError

        if isinstance(exc, StackError | SettingsError):
            console.print(f"[red]error:[/] {exc}")
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
