"""`rlpipe stack up|down|status|logs`: the local stack of real servers.

`up` is idempotent: a service already running (per its record and a health check) is left
alone; a port held by someone else, a missing binary or a failed health check stops with an
error naming the service, the port and the log file. `down` stops only what `up` recorded,
each service's whole process tree. A service whose main process died may leave children running
("strays", see infra/process.py): `status` lists them, `up` stops them before it starts the
service again, and `down` stops them.
A service whose address is given from outside (TEMPORAL_ADDRESS, DATABASE_URL,
S3_ENDPOINT_URL, INFERENCE_URLS) is never started, only checked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from rlpipe.infra.postgres import PostgresService
from rlpipe.infra.process import ProcessRecord, ProcessTable, port_holder, spawn, stop
from rlpipe.infra.seaweed import SeaweedService
from rlpipe.infra.service import HealthError, Service
from rlpipe.infra.settings import StackSettings, save_settings
from rlpipe.infra.temporal import TemporalService


class StackError(RuntimeError):
    """A service could not be started or is unhealthy; the message names it, its port and log."""


@dataclass(frozen=True)
class StrayProcess:
    """A process of a service's session that outlived the service's main process."""

    pid: int
    command: str
    rss_bytes: int


@dataclass
class ServiceStatus:
    name: str
    address: str
    pid: int | None
    healthy: bool
    detail: str
    external: bool
    log: str | None
    strays: list[StrayProcess] = field(default_factory=list)


def stray_processes(record: ProcessRecord) -> list[StrayProcess]:
    """What outlived the record's main process, described for a person."""
    found = []
    for proc in record.strays():
        try:
            with proc.oneshot():
                found.append(StrayProcess(proc.pid, " ".join(proc.cmdline()) or proc.name(), proc.memory_info().rss))
        except psutil.Error:
            continue  # it exited meanwhile
    return found


def _tail(path: Path, lines: int = 15) -> str:
    if not path.exists():
        return "(no log yet)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class Stack:
    """The set of local services for one settings object (one state directory)."""

    def __init__(self, settings: StackSettings) -> None:
        self.settings = settings
        self.table = ProcessTable(settings.home.resolve() / "stack.json")

    def services(self) -> list[Service]:
        """Local services in start order (databases first, Temporal last)."""
        s = self.settings
        found: list[Service] = []
        if s.external_database_url is None:
            found.append(PostgresService(s))
        if s.external_s3_endpoint is None:
            found.append(SeaweedService(s))
        if s.external_temporal is None:
            found.append(TemporalService(s))
        if s.inference_servers and not s.external_inference_urls:
            from rlpipe.infra.inference import InferenceService

            found += [InferenceService(s, index=i) for i in range(s.inference_servers)]
        return found

    def service(self, name: str) -> Service:
        for svc in self.services():
            if svc.name == name:
                return svc
        known = ", ".join(svc.name for svc in self.services())
        raise StackError(f"no local service named '{name}' (this stack has: {known})")

    # -- up ---------------------------------------------------------------------------------
    def up(self, only: list[str] | None = None, progress: Callable[[str], None] = print) -> None:
        save_settings(self.settings)
        for svc in self.services():
            if only and svc.name not in only:
                continue
            self.start(svc, progress)

    def start(self, svc: Service, progress: Callable[[str], None] = print) -> None:
        record = self.table.get(svc.name)
        if record is not None and record.is_running():
            self._wait_healthy(svc, timeout_s=svc.startup_timeout_s)
            progress(f"{svc.name}: already running (pid {record.pid}) at {svc.address()}")
            return
        if record is not None:
            self._stop_strays(svc, record, progress)
        for port in svc.ports():
            holder = port_holder(self.settings.host, port)
            if holder is not None:
                raise StackError(f"{svc.name}: port {self.settings.host}:{port} is already taken by {holder}; "
                                 f"stop it or choose other ports (rlpipe.toml [stack] / RLPIPE_HOME). "
                                 f"Log: {svc.log}")
        try:
            svc.prepare()
            launch = svc.launch()
        except (FileNotFoundError, HealthError) as exc:
            raise StackError(f"{svc.name}: {exc} (log {svc.log})") from exc
        record = spawn(svc.name, launch.argv, svc.log, env=launch.env, user=launch.user, cwd=launch.cwd,
                       reap_orphans=svc.reap_orphans)
        self.table.put(record)
        progress(f"{svc.name}: starting (pid {record.pid}, log {svc.log})")
        try:
            self._wait_healthy(svc, timeout_s=svc.startup_timeout_s)
            svc.after_start()
        except StackError:
            stop(record, timeout_s=5)
            self.table.remove(svc.name)
            raise
        progress(f"{svc.name}: healthy at {svc.address()}")

    def _stop_strays(self, svc: Service, record: ProcessRecord, progress: Callable[[str], None]) -> None:
        """Stop what the service's previous, dead main process left running (memory, devices)."""
        strays = record.strays()
        if strays and stop(record, timeout_s=svc.stop_timeout_s):
            progress(f"{svc.name}: stopped {len(strays)} stray process(es) of its dead main process "
                     f"(pid {record.pid}): {', '.join(str(proc.pid) for proc in strays)}")

    def _wait_healthy(self, svc: Service, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            record = self.table.get(svc.name)
            if record is not None and not record.is_running():
                raise StackError(f"{svc.name}: the process exited during start-up (ports {svc.ports()}). "
                                 f"Log {svc.log}:\n{_tail(svc.log)}")
            try:
                svc.check_health()
                return
            except HealthError as exc:
                last = str(exc)
            time.sleep(0.5)
        raise StackError(f"{svc.name}: failed its health check for {timeout_s:.0f}s at {svc.address()} "
                         f"(port {svc.ports()[0]}): {last}. Log {svc.log}:\n{_tail(svc.log)}")

    # -- down -------------------------------------------------------------------------------
    def down(self, only: list[str] | None = None, progress: Callable[[str], None] = print) -> None:
        for svc in reversed(self.services()):
            if only and svc.name not in only:
                continue
            self.stop_service(svc, progress)
        # records of services no longer configured (e.g. fewer inference servers now)
        for name, record in self.table.load().items():
            if only and name not in only:
                continue
            stop(record)
            self.table.remove(name)
            progress(f"{name}: stopped")

    def stop_service(self, svc: Service, progress: Callable[[str], None] = print) -> None:
        record = self.table.get(svc.name)
        if record is None:
            return
        if not record.is_running():
            self._stop_strays(svc, record, progress)
        elif stop(record, timeout_s=svc.stop_timeout_s, sig=svc.stop_signal):
            progress(f"{svc.name}: stopped (pid {record.pid})")
        self.table.remove(svc.name)

    # -- status -----------------------------------------------------------------------------
    def status(self) -> list[ServiceStatus]:
        rows: list[ServiceStatus] = []
        for svc in self.services():
            record = self.table.get(svc.name)
            running = record is not None and record.is_running()
            strays = stray_processes(record) if record is not None else []
            healthy, detail = False, f"not running; {len(strays)} stray process(es) left" if strays else "not running"
            if running:
                try:
                    svc.check_health()
                    healthy, detail = True, "healthy"
                except HealthError as exc:
                    detail = f"unhealthy: {exc}"
            rows.append(ServiceStatus(svc.name, svc.address(), record.pid if running and record else None,
                                      healthy, detail, False, str(svc.log), strays))
        rows += self._external_status()
        return rows

    def _external_status(self) -> list[ServiceStatus]:
        from rlpipe.infra.endpoints import check_external

        return [ServiceStatus(name, address, None, ok, detail, True, None)
                for name, address, ok, detail in check_external(self.settings)]

    def healthy(self) -> bool:
        return all(row.healthy for row in self.status())
