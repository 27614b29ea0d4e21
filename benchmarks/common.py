"""What every benchmark shares: the machine's description, summary statistics of repeats, the
results folder, and a private stack of real servers that is always stopped.

Benchmarks compare things side by side in one process run (the machine is shared and noisy), so
every table reports the median of repeats with its min-max, never a single measurement.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, is_dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODELS = ROOT / ".rlpipe" / "models"


def machine() -> dict[str, Any]:
    """Cores, memory and CPU model: a benchmark number means nothing without the machine."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(mem_kib / 2**20, 1),
            "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "load_avg_at_start": os.getloadavg()}


@dataclass(frozen=True)
class Summary:
    """Median and range of repeated measurements of one quantity."""

    median: float
    min: float
    max: float
    n: int

    def fmt(self, digits: int = 2, unit: str = "") -> str:
        """'median (min–max)' for a Markdown table."""
        if self.n == 1:
            return f"{self.median:.{digits}f}{unit} (n=1)"
        return f"{self.median:.{digits}f}{unit} ({self.min:.{digits}f}–{self.max:.{digits}f})"


def summarize(values: Sequence[float]) -> Summary:
    vals = [float(v) for v in values]
    return Summary(statistics.median(vals), min(vals), max(vals), len(vals))


def timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def write_result(name: str, data: dict[str, Any], command: str | None = None) -> Path:
    """benchmarks/results/<name>.json with the machine, the command (by default the module of the
    same name, without arguments) and the UTC time stamped in."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "command": command or f".venv/bin/python -m benchmarks.{name}",
               "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
               "machine": machine(), **data}
    path.write_text(json.dumps(payload, indent=2, default=_jsonable))
    return path


def _jsonable(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return asdict(obj)
    if isinstance(obj, Path | datetime):
        return str(obj)
    raise TypeError(f"not JSON-serialisable: {type(obj)}")


def tiny_model() -> Path:
    """The tiny test model (`rlpipe model prepare tiny`), built once and reused."""
    from rlpipe.policy.models import prepare_tiny

    return prepare_tiny(MODELS / "tiny")


def smollm2_model() -> Path:
    from rlpipe.policy.models import prepare_smollm2

    return prepare_smollm2(MODELS / "smollm2")


@contextmanager
def private_stack(inference_model: Path | None = None, workers: bool = False,
                  only: list[str] | None = None, overrides: dict[str, Any] | None = None) -> Iterator[Any]:
    """A stack of real servers on free ports in a temporary directory, migrated, optionally with one
    vLLM server and the pipeline's workers, and with `overrides` of its StackSettings; always
    stopped and removed, even on failure."""
    from alembic import command

    from rlpipe.infra.endpoints import resolve_endpoints
    from rlpipe.infra.settings import save_settings
    from rlpipe.infra.stack import Stack
    from rlpipe.migrations import alembic_config
    from rlpipe.workers.launcher import WorkerSet
    from tests.conftest import test_stack_settings

    quiet = lambda msg: None  # noqa: E731
    home = Path(tempfile.mkdtemp(prefix="rlpipe-bench-"))
    settings = test_stack_settings(home).model_copy(update=overrides or {})
    if inference_model is not None:
        settings.inference_servers, settings.inference_model = 1, inference_model
    save_settings(settings)
    stack, worker_set = Stack(settings), None
    try:
        stack.up(only=only, progress=quiet)
        if only is None or "postgres" in only:
            command.upgrade(alembic_config(resolve_endpoints(settings).database_url), "head")
        if workers:
            worker_set = WorkerSet(settings)
            worker_set.up(progress=quiet)
        yield stack
    finally:
        if worker_set is not None:
            worker_set.down(progress=quiet)
        stack.down(progress=quiet)
        subprocess.run(["rm", "-rf", str(home)], check=False)


def progress_bar():  # type: ignore[no-untyped-def]
    """One rich progress bar style for all benchmarks (long work must show where it is)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), transient=not sys.stdout.isatty())
