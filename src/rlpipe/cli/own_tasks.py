"""The command line's side of users' own tasks: which environments and graders are available and from
where (`rlpipe envs list`, `rlpipe graders list`), and a run's tasks checked before the run starts."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from rlpipe.envs.records import DataNotFound
from rlpipe.registry import Registry, Source
from rlpipe.schemas.config import ConfigError, RunConfig


def plugin_sources(registry: Registry[Any]) -> list[tuple[Source, str]]:
    """Every name `registry` can resolve here, each with "ok" or why it cannot be loaded. Loading imports
    each plugin, the way a worker would when a run names it."""
    checked = []
    for source in registry.sources():
        try:
            registry.get(source.name)
            status = "ok"
        except (LookupError, ValueError, TypeError) as exc:
            status = f"cannot be used: {exc}"
        checked.append((source, status))
    return checked


def print_plugins(console: Console, registry: Registry[Any]) -> None:
    table = Table(title=f"{registry.kind}s available here (entry-point group {registry.group!r})")
    for column in ("name", "from", "class", "package", "status"):
        table.add_column(column, overflow="fold")
    for source, status in plugin_sources(registry):
        table.add_row(source.name, source.origin, source.target, source.package,
                      "[green]ok[/]" if status == "ok" else f"[red]{status}[/]")
    console.print(table)
    console.print("Also usable: any class by import path, e.g. 'my_pkg.tasks:SpellingEnv'"
                  + (" (or a reward function, 'my_pkg.rewards:exact')" if registry.kind == "grader" else "")
                  + ". Running workers find a package installed after they started; a worker that already loaded a "
                  "package needs a restart to use an upgrade of it (docs/own-tasks.md).")


def check_tasks_here(config: RunConfig) -> str | None:
    """Build the run's environment here and draw what the workers check at the run's start (the eval set
    and the first train task), so that bad data stops the command before a run exists: ConfigError naming
    the problem. Data that is not on this machine may be on the workers': the warning to print, if so."""
    from rlpipe.envs.registry import build_environment

    try:
        env = build_environment(config.env)
        for index in range(env.size("eval")):
            env.task("eval", index)
        env.task("train", 0)
    except DataNotFound as exc:
        return f"{exc}; the workers check it when the run starts"
    except Exception as exc:  # noqa: BLE001 - whatever the environment raises is the reason to stop
        raise ConfigError(f"environment {config.env.name!r} cannot produce its tasks: {type(exc).__name__}: "
                          f"{exc}") from exc
    return None
