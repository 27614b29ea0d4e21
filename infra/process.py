"""Start, find and stop the background processes of the local stack and its workers.

Each process is started in its own session (so a terminal's Ctrl-C does not reach it and
`down` can stop its whole process group), with stdout/stderr in a log file, and recorded in a
JSON file: pid, start time, command and log. The start time guards against pid reuse: a record
whose pid now belongs to another process counts as stopped, so `down` never kills a stranger.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict

import psutil


@dataclass
class ProcessRecord:
    name: str
    pid: int
    started_at: float
    """psutil create_time of the process, to tell it from a later process with the same pid."""
    argv: list[str]
    log: str

    def process(self) -> psutil.Process | None:
        """The live process this record describes, or None if it has exited."""
        try:
            proc = psutil.Process(self.pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            # psutil derives create_time from the boot time, which moves when the clock is
            # stepped (seen: 11 s on a VM): a same-pid process with our argv is still ours
            if abs(proc.create_time() - self.started_at) > 1.0 and proc.cmdline() != self.argv:
                return None
            return proc
        except psutil.Error:
            return None

    def is_running(self) -> bool:
        return self.process() is not None


class ProcessTable:
    """The JSON file that records what a stack (or worker set) started."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, ProcessRecord]:
        if not self.path.exists():
            return {}
        return {name: ProcessRecord(**rec) for name, rec in json.loads(self.path.read_text()).items()}

    def save(self, records: dict[str, ProcessRecord]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({n: asdict(r) for n, r in records.items()}, indent=2))
        tmp.replace(self.path)

    def get(self, name: str) -> ProcessRecord | None:
        return self.load().get(name)

    def put(self, record: ProcessRecord) -> None:
        records = self.load()
        records[record.name] = record
        self.save(records)

    def remove(self, name: str) -> None:
        records = self.load()
        if records.pop(name, None) is not None:
            self.save(records)


def spawn(
    name: str,
    argv: list[str],
    log: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    user: str | None = None,
) -> ProcessRecord:
    """Start `argv` detached in a new session, appending its output to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {name}: {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            start_new_session=True,
            **as_user(user),
        )
    started_at = psutil.Process(proc.pid).create_time()
    return ProcessRecord(name=name, pid=proc.pid, started_at=started_at, argv=argv, log=str(log))


class ChildIdentity(TypedDict, total=False):
    """The Popen arguments that say whom a child runs as."""

    user: int
    group: int
    extra_groups: list[int]


def as_user(user: str | None) -> ChildIdentity:
    """Popen arguments that run a child as `user` with that user's own group and no others
    (keeping root's group would let the child past group permission bits, or stop it at them)."""
    if user is None:
        return {}
    import pwd

    entry = pwd.getpwnam(user)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def stop(record: ProcessRecord, timeout_s: float = 20.0, sig: signal.Signals = signal.SIGTERM) -> bool:
    """Send `sig` to the record's process group, then SIGKILL what is left after `timeout_s`.
    Returns False if the process was already gone."""
    proc = record.process()
    if proc is None:
        return False
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return False
    members = [proc, *proc.children(recursive=True)]
    _signal_group(pgid, sig)
    _, alive = psutil.wait_procs(members, timeout=timeout_s)
    if alive:
        _signal_group(pgid, signal.SIGKILL)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
    return True


def kill(record: ProcessRecord) -> bool:
    """SIGKILL the record's process group at once (used by crash tests)."""
    proc = record.process()
    if proc is None:
        return False
    _signal_group(os.getpgid(proc.pid), signal.SIGKILL)
    psutil.wait_procs([proc], timeout=10)
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def port_holder(host: str, port: int) -> str | None:
    """A description of whoever listens on host:port, or None if the port is free."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            return None
        except OSError:
            pass
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                try:
                    p = psutil.Process(conn.pid)
                    return f"pid {conn.pid} ({' '.join(p.cmdline()[:3])})"
                except psutil.Error:
                    return f"pid {conn.pid}"
    except psutil.Error:
        pass
    return "another process"


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free right now (for tests that need their own stack)."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_for(check: Callable[[], object], timeout_s: float, interval_s: float = 0.25) -> bool:
    """Poll `check()` until it returns truthy or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return True
        except Exception:  # noqa: BLE001 - a check that raises is just not healthy yet
            pass
        time.sleep(interval_s)
    return False
