"""`rlpipe workers up|down|status`: the worker processes of one machine, started in the
background like the stack's servers (their pids and logs recorded next to the stack's).

One rollout worker (workflows + generation), one sandbox worker, one grader worker, one trainer
worker, and one sync sidecar per inference server. Each is `rlpipe worker KIND` in its own session.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlpipe.infra.process import ProcessRecord, ProcessTable, spawn, stop
from rlpipe.infra.settings import StackSettings

KINDS = ("rollout", "sandbox", "grader", "trainer")
TRAINER_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "68719476736"}
"""glibc keeps the memory a train step frees for the next step instead of unmapping it and faulting
it in again: measured on 2 cores, a SmolLM2 engine step after a publish went from ~7.5 s to ~4.2 s
(benchmarks/findings.md). A value already in the environment wins."""


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def worker_specs(servers: list[str]) -> list[WorkerSpec]:
    # -P: the caller's working directory is not put on sys.path, so a folder of theirs named like a
    # package (rlpipe, envs, ...) cannot shadow ours; relative paths in run configs still resolve there
    base = [sys.executable, "-P", "-m", "rlpipe.workers.main"]
    trainer_env = {key: os.environ.get(key, value) for key, value in TRAINER_MALLOC.items()}
    specs = [WorkerSpec(kind, [*base, kind], trainer_env if kind == "trainer" else {}) for kind in KINDS]
    specs += [WorkerSpec(f"sidecar-{server}", [*base, "sidecar", "--server", server]) for server in servers]
    return specs


class WorkerStartError(RuntimeError):
    """A worker process died right after it was started; the message holds its log's tail."""


def _tail(path: Path, lines: int = 12) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


class WorkerSet:
    """The worker processes started for one stack directory."""

    def __init__(self, settings: StackSettings, env: dict[str, str] | None = None) -> None:
        self.home = settings.home.resolve()
        self.table = ProcessTable(self.home / "workers.json")
        self.env = env or {}
        self.servers = list(settings.inference_servers_by_name())

    def log(self, name: str) -> Path:
        return self.home / "workers" / f"{name}.log"

    def up(self, only: list[str] | None = None, progress: Callable[[str], None] = print,
           grace_s: float = 8.0) -> list[ProcessRecord]:
        """Start the workers not running; those that die within `grace_s` are reported with their log."""
        started = []
        for spec in worker_specs(self.servers):
            if only and spec.name not in only:
                continue
            record = self.table.get(spec.name)
            if record is not None and record.is_running():
                progress(f"{spec.name}: already running (pid {record.pid})")
                continue
            record = spawn(spec.name, spec.argv, self.log(spec.name),
                           env={"RLPIPE_HOME": str(self.home), **spec.env, **self.env})
            self.table.put(record)
            started.append(record)
            progress(f"{spec.name}: started (pid {record.pid}, log {record.log})")
        self._check_alive(started, grace_s)
        return started

    def _check_alive(self, started: list[ProcessRecord], grace_s: float = 8.0) -> None:
        """A worker that dies at start (bad address, import error) is reported with its log."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            dead = [r for r in started if not r.is_running()]
            if dead:
                tails = "\n".join(f"--- {r.name} ({r.log}):\n{_tail(Path(r.log))}" for r in dead)
                raise WorkerStartError(f"worker(s) {', '.join(r.name for r in dead)} exited at start:\n{tails}")
            time.sleep(0.5)

    def down(self, only: list[str] | None = None, progress: Callable[[str], None] = print) -> None:
        for name, record in self.table.load().items():
            if only and name not in only:
                continue
            if stop(record, timeout_s=15):
                progress(f"{name}: stopped (pid {record.pid})")
            self.table.remove(name)

    def status(self) -> dict[str, ProcessRecord | None]:
        records = self.table.load()
        return {spec.name: (r if (r := records.get(spec.name)) and r.is_running() else None)
                for spec in worker_specs(self.servers)}
