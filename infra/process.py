"""Start, find and stop the background processes of the local stack and its workers.

Each process is started in its own session (so a terminal's Ctrl-C does not reach it), with
stdout/stderr in a log file, and recorded in a JSON file: pid, start time, command and log. The
start time guards against pid reuse: a record whose pid now belongs to another process counts as
stopped, so `down` never kills a stranger.

A server's process tree is its session: whatever the server starts stays in it (unless it starts a
session of its own), also after the server is gone: vLLM's engine core outlives a killed API
server. So `stop` and `kill` end the whole session, whether its leader is alive or not, and
`ProcessRecord.strays` names what outlived a dead leader. A server whose children outlive it is
started under a reaper (session_reaper.py) that ends the session as soon as the server exits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict

import psutil

REAPER = [sys.executable, "-P", "-m", "rlpipe.infra.session_reaper"]
"""The command that runs the command after it under a session reaper (session_reaper.py)."""


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
            if proc.status() == psutil.STATUS_ZOMBIE or not self._describes(proc):
                return None
            return proc
        except psutil.Error:
            return None

    def is_running(self) -> bool:
        return self.process() is not None

    def session(self) -> list[psutil.Process]:
        """Every live process of the session `spawn` started for this record, the leader's included.

        Found by session id, so that children which outlived the leader are found too. Linux keeps
        a pid from reuse while any process has it as its session id: while one member of ours
        lives, no stranger can hold `pid`, so a stranger holding it means our session is over."""
        try:
            if not self._describes(psutil.Process(self.pid)):
                return []
        except psutil.NoSuchProcess:
            pass  # the leader has exited and been reaped; members may live on
        except psutil.AccessDenied:
            return []  # not ours to judge, so not ours to signal
        return session_processes(self.pid)

    def strays(self) -> list[psutil.Process]:
        """The processes of the session that outlived its leader (none while the leader runs):
        memory and devices held for a server that is gone."""
        return [] if self.is_running() else self.session()

    def _describes(self, proc: psutil.Process) -> bool:
        """Whether `proc` (running or a zombie) is this record's process, not a later one with its pid."""
        # psutil derives create_time from the boot time, which moves when the clock is stepped
        # (seen: 11 s on a VM): a same-pid process with our argv is still ours
        if abs(proc.create_time() - self.started_at) <= 1.0:
            return True
        try:
            return proc.cmdline() == self.argv
        except psutil.ZombieProcess:
            return False


def session_processes(sid: int) -> list[psutil.Process]:
    """The live processes of session `sid` (zombies left out: they hold nothing but their pid)."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (OSError, psutil.Error):
            continue  # it exited meanwhile
    return members


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
    reap_orphans: bool = False,
) -> ProcessRecord:
    """Start `argv` detached in a new session, appending its output to `log`. `reap_orphans`
    starts it under a reaper that ends the session when it exits (session_reaper.py); the record
    still names `argv`'s own process, which the reaper execs in place."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {name}: {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            [*REAPER, *argv] if reap_orphans else argv,
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
    """Send `sig` to the record's session, then SIGKILL what is left of its tree after `timeout_s`.

    The leader need not be alive: what outlived it is stopped the same way. The leader's
    descendants that started sessions of their own (Postgres backends) get no signal, since the
    leader stops them, but are waited for and killed with the rest. Returns False if nothing of
    the record was running."""
    session = record.session()
    if not session:
        return False
    tree = _with_descendants(record, session)
    _send(session, sig)
    _, alive = psutil.wait_procs(tree, timeout=timeout_s)
    if alive:
        _kill([*alive, *record.session()])  # the session again: a member may have forked meanwhile
    return True


def kill(record: ProcessRecord) -> bool:
    """SIGKILL the record's process tree at once (used by crash tests); False if none of it ran."""
    tree = _with_descendants(record, record.session())
    _kill(tree)
    return bool(tree)


def terminate(procs: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM each process, then SIGKILL those still alive after `grace_s`."""
    _send(procs, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    _kill(alive)


def _with_descendants(record: ProcessRecord, session: list[psutil.Process]) -> list[psutil.Process]:
    tree = {proc.pid: proc for proc in session}
    leader = record.process()
    if leader is not None:
        try:
            tree.update((proc.pid, proc) for proc in leader.children(recursive=True))
        except psutil.Error:
            pass  # the leader exited meanwhile: its session holds what is left
    return list(tree.values())


def _send(procs: list[psutil.Process], sig: signal.Signals) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)  # psutil checks the pid still names the same process
        except psutil.Error:
            pass


def _kill(procs: list[psutil.Process]) -> None:
    _send(procs, signal.SIGKILL)
    psutil.wait_procs(procs, timeout=10)


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
