"""`python -m rlpipe.infra.session_reaper ARGV...`: run ARGV so that its children end with it.

vLLM's engine core keeps running (~2.4 GB) when its API server is SIGKILLed. Under this module
the server first starts a reaper, then execs ARGV in place (so its pid, start time and command
line are the ones `spawn` recorded). The reaper is a member of the server's session but no child
of it (a server need not meet a stranger among its children): it waits for the server to exit,
however it exits, then stops every process left in the session and exits itself.

The reaper ignores the signals that stop a server, which `stop` sends to the whole session, so
that it outlives the server; `stop` waits for it like for any other member. Linux only (pidfd).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

from rlpipe.infra.process import REAPER, session_processes, terminate

WATCH = "--watch"
GRACE_S = 5.0
"""How long the processes left behind get between SIGTERM and SIGKILL."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def run(argv: list[str]) -> None:
    """Start this session's reaper, then become `argv`."""
    subprocess.run([*REAPER, WATCH, str(os.getpid())], check=True)
    os.execvp(argv[0], argv)


def reap(leader: int) -> None:
    """Watch `leader` from the background and stop the rest of its session once it exits."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    leader_exit = os.pidfd_open(leader)
    if os.fork() != 0:
        os._exit(0)  # `run` goes on once the watch is set, and the reaper is no child of the server
    select.select([leader_exit], [], [])
    left = [proc for proc in session_processes(os.getsid(0)) if proc.pid != os.getpid()]
    if left:
        print(f"session reaper: process {leader} exited; stopping what it left running: "
              f"{', '.join(str(proc.pid) for proc in left)}", flush=True)
        terminate(left, GRACE_S)


if __name__ == "__main__":
    if sys.argv[1:2] == [WATCH]:
        reap(int(sys.argv[2]))
    else:
        run(sys.argv[1:])
