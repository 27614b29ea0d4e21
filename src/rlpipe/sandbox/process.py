"""One sandbox seen from the host: an isolated process tree, started ahead of time, that runs code once.

Starting (spawn) and running (execute) are separate so the warm pool can pay for the first long before
code arrives. A sandbox is never reused: after one execution its namespaces, tmpfs and uid are gone, so
nothing can leak from one run into the next.
"""

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlpipe.sandbox.config import SandboxConfig
from rlpipe.sandbox.limits import SandboxLimits
from rlpipe.sandbox.output import BoundedCapture, decode_output
from rlpipe.sandbox.result import KillCause, ProgramExit, SandboxResult, classify
from rlpipe.sandbox.uids import UidLease

BOOTSTRAP = Path(__file__).with_name("bootstrap.py")
STUB_SOURCE = Path(__file__).with_name("stub.py").read_text()
SYSTEM_READONLY_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
FIRST_FREE_FD = 4  # 0-2 become the program's stdio and 3 its report fd: side channels must not collide
KILL_GRACE_SECONDS = 5.0  # init is SIGKILLed; this only guards against a kernel that never reaps it
SPAWN_ERROR_BYTES = 2000


class SandboxSetupError(RuntimeError):
    """Isolation could not be set up, so no code was run; the message names the failed step."""


def interpreter() -> str:
    """The real interpreter binary (a venv's python is a symlink into the base prefix)."""
    return os.path.realpath(sys.executable)


def readonly_paths(config: SandboxConfig) -> list[str]:
    """Host paths to show read-only inside: system dirs that exist, the interpreter's prefix, extras."""
    paths = [p for p in SYSTEM_READONLY_PATHS if os.path.lexists(p)]
    prefix = os.path.realpath(sys.base_prefix)
    if not any(prefix == p or prefix.startswith(p + "/") for p in paths):
        paths.append(prefix)
    return paths + [str(p) for p in config.extra_readonly_paths]


def side_channel() -> tuple[int, int]:
    """A pipe whose fds are >= FIRST_FREE_FD, even in a process started with stdin or stdout closed."""
    ends = []
    for fd in os.pipe():
        if fd < FIRST_FREE_FD:
            fd, low = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, FIRST_FREE_FD), fd
            os.close(low)
        ends.append(fd)
    return ends[0], ends[1]


def private_dir(path: Path) -> Path:
    """Create path (0700) or check that an existing one is ours and not writable by others."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise SandboxSetupError(f"{path} must be a directory owned by uid {os.geteuid()} that others "
                                f"cannot write; remove it or choose another SandboxConfig.scratch_root")
    return path


class SandboxProcess:
    """A started sandbox waiting for its one request. Build with `await SandboxProcess.spawn(config)`."""

    def __init__(self, proc: asyncio.subprocess.Process, lease: UidLease, staging: Path, *,
                 status_fd: int, report_fd: int) -> None:
        if proc.stdin is None or proc.stdout is None or proc.stderr is None:
            raise ValueError("a sandbox process needs pipes for stdin, stdout and stderr")
        self._proc = proc
        self._stdin, self._stdout, self._stderr = proc.stdin, proc.stdout, proc.stderr
        self._lease = lease
        self._staging = staging
        self._status_fd = status_fd   # JSON lines from bootstrap.py (trusted: closed before the code runs)
        self._status = asyncio.StreamReader()
        self._status_transport: asyncio.BaseTransport | None = None
        self._report_fd = report_fd   # one byte from the stub: b"S" did not compile, b"R" running
        self._used = False
        self._closed = False

    @classmethod
    async def spawn(cls, config: SandboxConfig) -> "SandboxProcess":
        """Start a sandbox and wait until its interpreter is blocked on stdin, ready for code."""
        scratch = private_dir(config.scratch_root)
        lease = UidLease.acquire(private_dir(scratch / "leases"), config.uid_range_start, config.uid_range_size)
        staging = Path(tempfile.mkdtemp(prefix=f"{lease.uid}-", dir=private_dir(scratch / "roots")))
        report_r, report_w = side_channel()
        status_r, status_w = side_channel()
        plan = {"uid": lease.uid, "staging_dir": str(staging), "python": interpreter(),
                "readonly_paths": readonly_paths(config), "workdir_bytes": config.workdir_bytes,
                "report_fd": report_w, "status_fd": status_w, "parent_pid": os.getpid(), "stub": STUB_SOURCE}
        try:
            proc = await asyncio.create_subprocess_exec(
                interpreter(), "-I", "-S", str(BOOTSTRAP), json.dumps(plan),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                pass_fds=(report_w, status_w), start_new_session=True, env={"PATH": "/usr/bin:/bin"})
        except BaseException:
            for fd in (report_r, report_w, status_r, status_w):
                os.close(fd)
            os.rmdir(staging)
            lease.release()
            raise
        os.close(report_w)
        os.close(status_w)
        sandbox = cls(proc, lease, staging, status_fd=status_r, report_fd=report_r)
        try:
            await asyncio.wait_for(sandbox._await_ready(), timeout=config.spawn_timeout_seconds)
        except BaseException as exc:
            await asyncio.shield(sandbox.discard())  # a cancelled caller must not leak the process tree
            if isinstance(exc, TimeoutError):
                raise SandboxSetupError(f"sandbox not ready after {config.spawn_timeout_seconds:g} s") from None
            raise
        return sandbox

    async def _await_ready(self) -> None:
        """Wait for the program's "ready" (its interpreter is next), or raise the setup error."""
        self._status_transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(self._status), os.fdopen(self._status_fd, "rb", buffering=0))
        while True:
            line = await self._status.readline()
            if not line:
                stderr = (await self._stderr.read(SPAWN_ERROR_BYTES)).decode(errors="replace").strip()
                raise SandboxSetupError(f"sandbox exited during setup without a reason: {stderr or 'no output'}")
            message = json.loads(line)
            if "error" in message:
                raise SandboxSetupError(message["error"])
            if message.get("ready"):
                return

    @property
    def alive(self) -> bool:
        """Still waiting for code (a pool checks this before handing a sandbox out)."""
        return self._proc.returncode is None and not self._closed

    async def exited(self) -> None:
        """Return once the sandbox's process tree is gone, for whatever reason."""
        await self._proc.wait()

    async def execute(self, code: str, stdin: bytes, limits: SandboxLimits) -> SandboxResult:
        """Run code once under limits; every ending is returned as a result, never raised."""
        if self._used:
            raise RuntimeError("a sandbox runs code once: take a fresh one")
        self._used = True
        header = json.dumps({"code": code, "rlimits": limits.rlimits()}).encode()
        overflowed: list[KillCause] = []
        overflow = asyncio.Event()

        def on_overflow(stream: KillCause) -> None:
            overflowed.append(stream)
            overflow.set()

        captures = {"stdout": BoundedCapture(limits.max_output_bytes, lambda: on_overflow("stdout")),
                    "stderr": BoundedCapture(limits.max_output_bytes, lambda: on_overflow("stderr"))}
        started = time.perf_counter()
        feeder = asyncio.create_task(self._feed(b"%d\n" % len(header) + header + stdin))
        finished: asyncio.Future[Any] = asyncio.gather(
            captures["stdout"].drain(self._stdout), captures["stderr"].drain(self._stderr), self._proc.wait())
        overflow_seen = asyncio.create_task(overflow.wait())
        try:
            done, _ = await asyncio.wait({finished, overflow_seen}, timeout=limits.wall_seconds,
                                         return_when=asyncio.FIRST_COMPLETED)
            killed_for: KillCause | None = overflowed[0] if overflowed else None
            if finished not in done:
                killed_for = killed_for or "timeout"
                await self._kill()
            await finished
            wall = time.perf_counter() - started
            program_exit = await self._read_exit()
            compiled = {b"S": False, b"R": True}.get(os.read(self._report_fd, 1))
        finally:
            for task in (feeder, overflow_seen, finished):
                task.cancel()
            await asyncio.shield(self.discard())  # a cancelled caller must not leak the process tree
        stdout, bad_stdout = decode_output(bytes(captures["stdout"].data), captures["stdout"].truncated)
        stderr, bad_stderr = decode_output(bytes(captures["stderr"].data), captures["stderr"].truncated)
        status, reason = classify(killed_for=killed_for, program_exit=program_exit, compiled=compiled,
                                  stderr=stderr, limits=limits)
        returncode = None if program_exit is None else program_exit.returncode
        return SandboxResult(
            status=status, reason=reason,
            exit_code=returncode if returncode is not None and returncode >= 0 else None,
            signal_name=(signal.Signals(-returncode).name if returncode is not None and returncode < 0
                         else "SIGKILL" if returncode is None and killed_for else None),  # None: we killed it
            stdout=stdout, stderr=stderr,
            stdout_truncated=captures["stdout"].truncated, stderr_truncated=captures["stderr"].truncated,
            invalid_utf8=bad_stdout or bad_stderr, wall_seconds=wall, startup_seconds=0.0, warm=False,
            cpu_seconds=None if program_exit is None else program_exit.cpu_seconds,
            max_rss_bytes=None if program_exit is None else program_exit.max_rss_bytes)

    async def _feed(self, data: bytes) -> None:
        """Send the request and the program's stdin, then close it; a program that exits early is fine."""
        try:
            self._stdin.write(data)
            await self._stdin.drain()
            self._stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass

    async def _read_exit(self) -> ProgramExit | None:
        """init's exit report, if it got to send one (it does not when the sandbox killed the run)."""
        while line := await self._status.readline():
            message = json.loads(line)
            if "exit" in message:
                return ProgramExit(**message["exit"])
        return None

    async def _kill(self) -> None:
        """Ask outer to SIGKILL init (the kernel then kills the whole pid namespace) and wait for outer.

        outer, not the runner, kills init: init is outer's unreaped child, so its pid cannot have been
        reused. Only if outer does not answer is its process group SIGKILLed.
        """
        try:
            self._proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(self._proc.wait(), timeout=KILL_GRACE_SECONDS)
        except ProcessLookupError:
            pass
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            await self._proc.wait()

    async def discard(self) -> None:
        """Kill the sandbox if it still runs and free its host-side state (idempotent).

        outer exits only after waitpid(init), and init's exit waits for its namespace to empty, so once
        outer is gone no process of the leased uid is left and the uid can go back to the range.
        """
        if self._closed:
            return
        self._closed = True
        if self._proc.returncode is None:
            await self._kill()
        if self._status_transport is not None:
            self._status_transport.close()  # also closes the status fd
        else:
            os.close(self._status_fd)
        os.close(self._report_fd)
        try:
            self._staging.rmdir()  # empty on the host: the sandbox's tmpfs was mounted only in its namespace
        finally:
            self._lease.release()  # every process of the uid is gone, whatever happened to the dir
