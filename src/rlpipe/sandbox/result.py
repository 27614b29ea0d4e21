"""What one sandboxed execution returns, and how its ending is named.

Every ending of untrusted code is data, never an exception: a grader or a multi-turn environment turns a
syntax error, a timeout or a memory bomb into a reward or an observation, so each gets a status and a
reason a person can read.
"""

import signal
from dataclasses import dataclass
from typing import Literal

from rlpipe.sandbox.limits import MiB, SandboxLimits

SandboxStatus = Literal[
    "ok",              # exited with code 0
    "error",           # exited non-zero (an uncaught exception or sys.exit(n))
    "syntax_error",    # the code does not compile; none of it ran
    "timeout",         # wall-clock limit: the sandbox killed the process tree
    "memory_limit",    # MemoryError under the address-space limit
    "cpu_limit",       # RLIMIT_CPU: SIGXCPU, or SIGKILL at the hard limit
    "output_limit",    # stdout or stderr passed max_output_bytes: the sandbox killed the process tree
    "killed",          # ended by another signal (SIGSEGV, a SIGKILL it sent itself, ...)
    "sandbox_error",   # isolation could not be set up or broke down; the code did not run (fail closed)
]
REASON_CHARS = 300
KillCause = Literal["timeout", "stdout", "stderr"]


@dataclass(frozen=True)
class ProgramExit:
    """How the program ended, as init in the sandbox's pid namespace saw it."""

    returncode: int        # negative: killed by that signal number
    cpu_seconds: float     # user + system time of the program and the children it waited for
    max_rss_bytes: int


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one execution; `reason` says in words what `status` says in a token."""

    status: SandboxStatus
    reason: str
    exit_code: int | None          # the program's exit code, when it exited rather than being killed
    signal_name: str | None        # the signal that ended it, e.g. "SIGXCPU", "SIGKILL"
    stdout: str                    # UTF-8, invalid bytes replaced by U+FFFD, cut at max_output_bytes
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    invalid_utf8: bool             # some output was not UTF-8 and was replaced
    wall_seconds: float            # request sent -> every process of the run gone
    startup_seconds: float         # waiting for a ready sandbox: ~0 from the warm pool, a spawn when cold
    warm: bool                     # a pre-started pool sandbox ran it
    cpu_seconds: float | None = None
    max_rss_bytes: int | None = None
    injected_latency_seconds: float = 0.0

    @classmethod
    def not_started(cls, reason: str, startup_seconds: float) -> "SandboxResult":
        """No sandbox could be set up, so the code did not run (isolation fails closed)."""
        return cls(status="sandbox_error", reason=reason, exit_code=None, signal_name=None, stdout="",
                   stderr="", stdout_truncated=False, stderr_truncated=False, invalid_utf8=False,
                   wall_seconds=0.0, startup_seconds=startup_seconds, warm=False)

    @property
    def ok(self) -> bool:
        """Exited with code 0."""
        return self.status == "ok"

    @property
    def truncated(self) -> bool:
        """Some output was cut at the byte limit."""
        return self.stdout_truncated or self.stderr_truncated


def last_line(text: str) -> str:
    """The last non-empty line (for a traceback: the exception), clipped to fit in a reason."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:REASON_CHARS] if lines else ""


def classify(*, killed_for: KillCause | None, program_exit: ProgramExit | None, compiled: bool | None,
             stderr: str, limits: SandboxLimits) -> tuple[SandboxStatus, str]:
    """Name the ending; checks run from what the sandbox did to what the code did."""
    # 1) the sandbox killed the run
    if killed_for == "timeout":
        return "timeout", f"wall-clock limit of {limits.wall_seconds:g} s exceeded; the process tree was killed"
    if killed_for is not None:
        return "output_limit", (f"{killed_for} exceeded {limits.max_output_bytes} bytes; "
                                f"the process tree was killed")
    if program_exit is None:
        return "sandbox_error", "the sandbox ended without reporting how the program exited"
    # 2) the kernel or the code sent a signal
    code, exception = program_exit.returncode, last_line(stderr)
    if code < 0:
        sig = signal.Signals(-code)
        cpu_used = program_exit.cpu_seconds
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_used >= limits.cpu_seconds):
            return "cpu_limit", (f"CPU limit of {limits.cpu_seconds} s exceeded ({sig.name} after "
                                 f"{cpu_used:.2f} s of CPU)")
        return "killed", f"killed by {sig.name}"
    # 3) the code exited
    if compiled is False:
        return "syntax_error", exception or "the code does not compile"
    if code == 0:
        return "ok", "exited with code 0"
    if exception.startswith("MemoryError"):
        return "memory_limit", (f"address-space limit of {limits.memory_bytes // MiB} MiB reached: "
                                f"{exception}")
    return "error", f"exited with code {code}" + (f": {exception}" if exception else "")
