"""The privileged half of one sandbox: namespaces, a private root filesystem, an unprivileged uid.

The runner starts this file as root with `python -I -S bootstrap.py <plan-json>`. It is stdlib-only and
imports nothing from rlpipe, so it starts fast and nothing the sandboxed code can write is on its path.
Python 3.11 has no `os.unshare`, so the few syscalls it needs go through ctypes.

Process tree (the right-hand two live in a fresh pid namespace):

    outer ──fork──▶ init (pid 1) ──fork──▶ program (leased uid, execs the stub interpreter)

- outer:   unshare(mount, net, pid, ipc, uts); forks init; waits for it; exits. SIGTERM from the runner
           makes it SIGKILL init, so a kill is complete (namespace empty) exactly when outer exits.
- init:    builds a tmpfs root holding only read-only system dirs, /dev nodes, /proc and a writable
           tmpfs workdir; pivots into it; forks the program; reaps every orphan; reports the program's
           exit status and rusage. When init exits the kernel SIGKILLs whatever is left in the pid
           namespace and waits for it, so fork bombs and daemonised children die with the run.
- program: drops to the leased uid with no supplementary groups and no_new_privs, then execs the
           stub, which waits on stdin for the request (so a warm-pool sandbox idles here).

Every step is required: any failure is reported as {"error": ...} and the code never runs (fail closed).
Status messages to the runner are JSON lines on `status_fd`: {"ready"}, {"exit"} or {"error"}.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import socket
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
NAMESPACES = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
PIVOT_ROOT_SYSCALL = {"x86_64": 155, "aarch64": 41}  # no libc wrapper exists

WORKDIR = "/sandbox"  # the program's cwd, HOME and TMPDIR inside the new root
DEV_NODES = ("null", "zero", "full", "random", "urandom")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0",
             "stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2"}
PROGRAM_FD = {"report": 3}  # fds 0-2 are the program's stdio; 3 is the stub's one-byte report
PROGRAM_ENV = {  # built from nothing: no variable of the worker (DATABASE_URL, AWS_*, ...) reaches the code
    "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8",
    "USER": "sandbox", "LOGNAME": "sandbox",
}

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A step of the isolation failed; the message names the step and the errno."""


def check(result: int, what: str) -> None:
    """Raise SetupError with errno text when a libc call returned non-zero."""
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: [Errno {err}] {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    """mount(2); None arguments pass NULL."""
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
          f"mount({source!r} -> {target!r}, {fstype or 'bind'})")


def report(status_fd: int, **message: object) -> None:
    """One JSON line to the runner; a single write() under PIPE_BUF bytes is atomic."""
    os.write(status_fd, (json.dumps(message) + "\n").encode())


def bind_readonly(host_path: str, root: str) -> None:
    """Make host_path visible read-only at the same path under root (symlinks are copied as symlinks)."""
    target = root + host_path
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if os.path.islink(host_path):
        os.symlink(os.readlink(host_path), target)
        return
    if not os.path.exists(host_path):
        raise SetupError(f"read-only path {host_path!r} does not exist on the host")
    if os.path.isdir(host_path):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        open(target, "w").close()
    mount(host_path, target, None, MS_BIND)
    # 2) a bind mount ignores MS_RDONLY on creation; read-only needs a remount of the new mount
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(plan: dict) -> None:
    """Populate a tmpfs at the staging dir and pivot into it; afterwards the host filesystem is gone."""
    root, uid = plan["staging_dir"], plan["uid"]
    # 1) nothing below may propagate to the host: without this a mount could leak out of the namespace
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in plan["readonly_paths"]:
        bind_readonly(path, root)
    os.mkdir(root + "/dev", 0o755)
    for node in DEV_NODES:  # writable device binds: writing to /dev/null must work
        open(f"{root}/dev/{node}", "w").close()
        mount(f"/dev/{node}", f"{root}/dev/{node}", None, MS_BIND)
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"{root}/dev/{name}")
    os.mkdir(root + "/proc", 0o555)  # this pid namespace's own /proc: only sandbox processes are visible
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(root + WORKDIR, 0o755)  # the only writable place, size-capped, owned by the leased uid
    mount("tmpfs", root + WORKDIR, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={plan['workdir_bytes']},mode=0700,uid={uid},gid={uid}")
    pivot_root = PIVOT_ROOT_SYSCALL.get(platform.machine())
    if pivot_root is None:
        raise SetupError(f"pivot_root syscall number unknown for {platform.machine()}")
    os.chdir(root)
    check(libc.syscall(pivot_root, b".", b"."), "pivot_root")  # old root is stacked under the new one
    check(libc.umount2(b".", MNT_DETACH), "umount old root")  # ...and detached: unreachable from here on
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def become_program(plan: dict, status_fd: int) -> None:
    """In the forked program: drop every privilege, then exec the stub (never returns)."""
    uid = plan["uid"]
    os.dup2(plan["report_fd"], PROGRAM_FD["report"])
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    if os.getuid() == 0 or os.geteuid() == 0:
        raise SetupError("still root after setresuid")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.chdir(WORKDIR)
    if not os.access(plan["python"], os.X_OK):
        raise SetupError(f"{plan['python']} is not executable inside the sandbox: add its prefix to the "
                         f"read-only paths")
    report(status_fd, ready=True)
    os.closerange(PROGRAM_FD["report"] + 1, os.sysconf("SC_OPEN_MAX"))  # status fd and all others
    argv = [plan["python"], "-I", "-S", "-B", "-u", "-X", "utf8", "-c", plan["stub"]]
    os.execve(plan["python"], argv, PROGRAM_ENV)


def silence_stdio() -> None:
    """Drop this process's copies of the program's pipes so EOF arrives when the program is gone."""
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def run_init(plan: dict, status_fd: int) -> int:
    """pid 1 of the namespace: set up, fork the program, reap until it exits, report its status."""
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    socket.sethostname("sandbox")
    build_root(plan)
    program = os.fork()
    if program == 0:
        try:
            become_program(plan, status_fd)
        except BaseException as exc:  # any failure must reach the runner, then exit
            report(status_fd, error=f"starting the program: {exc}")
        os._exit(127)
    silence_stdio()
    os.close(plan["report_fd"])
    while True:  # as pid 1 we inherit every orphan; reap them so the table cannot fill with zombies
        pid, wait_status, usage = os.wait4(-1, 0)
        if pid == program:
            break
    report(status_fd, exit={"returncode": os.waitstatus_to_exitcode(wait_status),
                            "cpu_seconds": usage.ru_utime + usage.ru_stime,
                            "max_rss_bytes": usage.ru_maxrss * 1024})
    return 0


def main() -> int:
    """outer: create the namespaces, fork init into them, wait for it; SIGTERM means "kill the run"."""
    plan = json.loads(sys.argv[1])
    status_fd = plan["status_fd"]
    try:
        # if the runner dies, so does the sandbox (init follows outer, the namespace follows init)
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != plan["parent_pid"]:
            raise SetupError("the runner exited while the sandbox was starting")
        check(libc.unshare(NAMESPACES), "unshare(CLONE_NEWNS|CLONE_NEWNET|CLONE_NEWPID|CLONE_NEWIPC|"
                                        "CLONE_NEWUTS) (needs root with CAP_SYS_ADMIN)")
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # held until the handler knows init
        init = os.fork()
        if init == 0:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            try:
                code = run_init(plan, status_fd)
            except BaseException as exc:  # report, never let setup errors pass silently
                report(status_fd, error=str(exc))
                code = 1
            os._exit(code)
    except BaseException as exc:
        report(status_fd, error=str(exc))
        return 1
    # init is our unreaped child, so its pid cannot be reused: killing it by pid is safe until we reap
    signal.signal(signal.SIGTERM, lambda *_: os.kill(init, signal.SIGKILL))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    silence_stdio()
    os.close(plan["report_fd"])
    # init turns zombie only after the kernel has emptied its pid namespace; WNOWAIT keeps it one
    os.waitid(os.P_PID, init, os.WEXITED | os.WNOWAIT)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # nothing left to kill: close the window before reaping
    _, wait_status = os.waitpid(init, 0)
    return os.WEXITSTATUS(wait_status) if os.WIFEXITED(wait_status) else 128 + os.WTERMSIG(wait_status)


if __name__ == "__main__":
    os._exit(main())  # nothing to flush (stdio is /dev/null by now); skipping finalisation saves ms per run
