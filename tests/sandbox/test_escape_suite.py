"""Escape suite: untrusted code tries to break out or bring the host down; every attempt must be
contained AND named (status + reason). Each test also checks the thing it guards against is real on the
host (the listener answers, the secret is readable by root, ...), so a missing isolation makes it fail.

Needs root with CAP_SYS_ADMIN (as in CI); limits are small so the whole file runs in well under a minute.
"""

import asyncio
import ctypes
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlpipe.sandbox import Sandbox, SandboxConfig, SandboxLimits, run

MiB = 1024 * 1024
LIMITS = SandboxLimits(wall_seconds=5, cpu_seconds=2, memory_bytes=256 * MiB, max_processes=16,
                       max_output_bytes=64 * 1024)
REPO = Path(__file__).resolve().parents[2]
UIDS = {"uid_range_start": 1_700_000, "uid_range_size": 256}  # this file's own: leak checks see only ours


@pytest.fixture
def config(tmp_path: Path) -> SandboxConfig:
    """Cold starts (the pool has its own tests) and a scratch root this test can inspect."""
    return SandboxConfig(scratch_root=tmp_path / "scratch", pool_size=0, limits=LIMITS, **UIDS)


@pytest.fixture
async def sandbox(config: SandboxConfig):
    async with Sandbox(config) as box:
        yield box


def processes_of_uids(start: int, size: int) -> list[str]:
    """`pid: name` of every live process whose real uid is in [start, start + size)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:  # exited while we looked
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if start <= int(fields["Uid"].split()[0]) < start + size:
            found.append(f"{entry.name}: {fields['Name'].strip()}")
    return found


def assert_nothing_left(config: SandboxConfig) -> None:
    """No sandbox process, staging dir or mount survives a run."""
    assert processes_of_uids(config.uid_range_start, config.uid_range_size) == []
    assert list((config.scratch_root / "roots").iterdir()) == []
    assert str(config.scratch_root) not in Path("/proc/self/mountinfo").read_text()


# --- normal behaviour -----------------------------------------------------------------------------


async def test_normal_code_returns_its_output(sandbox: Sandbox, config: SandboxConfig) -> None:
    result = await sandbox.run("name = input()\nprint(f'hello {name}', 6 * 7)", stdin="tool\n")
    assert (result.status, result.stdout, result.stderr) == ("ok", "hello tool 42\n", "")
    assert (result.exit_code, result.signal_name, result.reason) == (0, None, "exited with code 0")
    assert not result.truncated and not result.invalid_utf8 and not result.warm
    assert 0 < result.wall_seconds < LIMITS.wall_seconds
    assert_nothing_left(config)


async def test_runs_unprivileged_in_its_own_namespaces(sandbox: Sandbox, config: SandboxConfig) -> None:
    code = """
        import json, os, socket
        print(json.dumps({"uid": os.getuid(), "euid": os.geteuid(), "groups": os.getgroups(),
                          "cwd": os.getcwd(), "pid": os.getpid(), "host": socket.gethostname(),
                          "nics": [l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]],
                          "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
                          "root": sorted(os.listdir("/"))}))
    """
    result = await sandbox.run(textwrap.dedent(code))
    seen = json.loads(result.stdout)
    assert config.uid_range_start <= seen["uid"] == seen["euid"] < config.uid_range_start + config.uid_range_size
    assert seen["groups"] == [] and seen["cwd"] == "/sandbox" and seen["host"] == "sandbox"
    assert seen["nics"] == ["lo"]                    # a fresh network namespace: no route anywhere
    assert seen["pid"] == 2 and seen["pids"] == [1, 2]  # init and the program: no host process visible
    assert not {"work", "home", "tmp", "etc", "var"} & set(seen["root"])  # the host tree is not there


# --- escapes ----------------------------------------------------------------------------------------


async def test_infinite_loop_is_stopped_by_the_cpu_limit(sandbox: Sandbox, config: SandboxConfig) -> None:
    result = await sandbox.run("while True:\n    pass", limits=LIMITS.model_copy(update={"cpu_seconds": 1}))
    assert result.status == "cpu_limit", result
    assert result.signal_name == "SIGXCPU" and "CPU limit of 1 s" in result.reason
    assert_nothing_left(config)


async def test_sleeping_loop_is_killed_at_the_wall_clock_limit(sandbox: Sandbox, config: SandboxConfig) -> None:
    code = "import time\nprint('started', flush=True)\nwhile True:\n    time.sleep(1)"
    result = await sandbox.run(code, limits=LIMITS.model_copy(update={"wall_seconds": 1}))
    assert result.status == "timeout" and "wall-clock limit of 1 s" in result.reason, result
    assert result.stdout == "started\n"  # output written before the kill is kept
    assert 1 <= result.wall_seconds < 4
    assert_nothing_left(config)


async def test_memory_bomb_hits_the_memory_limit(sandbox: Sandbox, config: SandboxConfig) -> None:
    result = await sandbox.run("hoard = []\nwhile True:\n    hoard.append(bytearray(8 * 1024 * 1024))")
    assert result.status == "memory_limit" and "MemoryError" in result.reason, result
    assert result.max_rss_bytes < LIMITS.memory_bytes
    assert_nothing_left(config)


async def test_process_count_is_capped(sandbox: Sandbox) -> None:
    code = """
        import os, time
        started = 0
        for _ in range(100):
            try:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                started += 1
            except OSError:
                break
        print(started)
    """
    result = await sandbox.run(textwrap.dedent(code))
    assert result.status == "ok", result
    assert 0 < int(result.stdout) < LIMITS.max_processes  # the program itself counts as one


async def test_fork_bomb_is_contained_and_cleaned_up(sandbox: Sandbox, config: SandboxConfig) -> None:
    code = """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """
    started = time.perf_counter()
    result = await sandbox.run(textwrap.dedent(code), limits=LIMITS.model_copy(update={"wall_seconds": 2}))
    assert result.status in ("timeout", "cpu_limit"), result
    assert time.perf_counter() - started < 10
    assert_nothing_left(config)  # the sleeping children died with the pid namespace
    assert subprocess.run(["true"]).returncode == 0  # and the host can still start processes


async def test_daemonised_child_does_not_outlive_the_run(sandbox: Sandbox, config: SandboxConfig) -> None:
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    result = await sandbox.run(code)
    assert (result.status, result.stdout) == ("ok", "parent done\n"), result
    assert_nothing_left(config)


async def test_cancelled_run_leaves_nothing_behind(sandbox: Sandbox, config: SandboxConfig) -> None:
    running = asyncio.create_task(sandbox.run("import time\nprint('up', flush=True)\ntime.sleep(60)"))
    await asyncio.sleep(0.5)
    running.cancel()  # e.g. the activity was cancelled
    with pytest.raises(asyncio.CancelledError):
        await running
    deadline = time.monotonic() + 5
    while processes_of_uids(config.uid_range_start, config.uid_range_size) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # the kill finishes in the background of the cancellation
    assert_nothing_left(config)


async def test_network_is_unreachable(sandbox: Sandbox) -> None:
    accepted = []
    server = await asyncio.start_server(lambda r, w: accepted.append(w.close()), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)  # the listener is reachable from the host
    writer.close()
    await asyncio.sleep(0.05)
    assert len(accepted) == 1
    code = f"""
        import socket
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=2)
            print("CONNECTED")
        except OSError as exc:
            print("blocked:", exc.errno)
    """
    result = await sandbox.run(textwrap.dedent(code))
    server.close()
    await server.wait_closed()
    assert result.status == "ok", result
    assert result.stdout.startswith("blocked:") and len(accepted) == 1, result.stdout


async def test_writing_outside_the_workdir_fails(sandbox: Sandbox, tmp_path: Path) -> None:
    targets = [Path("/tmp") / f"escape-{os.getpid()}", REPO / "escape.txt", tmp_path / "escape.txt",
               Path("/escape.txt"), Path("/usr/escape.txt")]
    code = f"""
        for path in {[str(t) for t in targets]!r}:
            try:
                with open(path, "w") as f:
                    f.write("escaped")
                print("WROTE", path)
            except OSError as exc:
                print("refused", exc.errno)
        open("inside.txt", "w").write("fine")
        print(open("inside.txt").read())
    """
    result = await sandbox.run(textwrap.dedent(code))
    assert result.status == "ok", result
    assert "WROTE" not in result.stdout and result.stdout.count("refused") == len(targets)
    assert result.stdout.endswith("fine\n")
    assert not any(t.exists() for t in targets)


async def test_reading_a_secret_file_fails(tmp_path: Path) -> None:
    vault = tmp_path / "vault"
    vault.mkdir(mode=0o700)
    secret = vault / "secret.txt"
    secret.write_text("TOPSECRET")
    secret.chmod(0o600)
    assert secret.read_text() == "TOPSECRET"  # root on the host can read it
    # 1) by path: the host tree is not mounted; 2) even exposed read-only, the sandbox uid may not read it
    config = SandboxConfig(scratch_root=tmp_path / "scratch", pool_size=0, limits=LIMITS,
                           extra_readonly_paths=(vault,), **UIDS)
    code = f"""
        for path in [{str(secret)!r}, "/etc/shadow", "/root/.bashrc", {str(REPO / "pyproject.toml")!r}]:
            try:
                print("READ", open(path).read())
            except OSError as exc:
                print("refused", exc.errno)
    """
    result = await run(textwrap.dedent(code), config=config)
    assert result.status == "ok", result
    assert "TOPSECRET" not in result.stdout and "READ" not in result.stdout
    assert result.stdout.splitlines()[0] == "refused 13"  # EACCES: the vault is exposed but root-only


async def test_environment_has_no_secrets(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = {"DATABASE_URL": "postgresql://u:pw@db/x", "AWS_SECRET_ACCESS_KEY": "AKIA-secret",
               "AWS_ACCESS_KEY_ID": "AKIA-id", "S3_ENDPOINT_URL": "http://s3:8333"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    result = await sandbox.run("import json, os\nprint(json.dumps(dict(os.environ)))")
    env = json.loads(result.stdout)
    assert set(env) == {"PATH", "HOME", "TMPDIR", "LANG", "USER", "LOGNAME"}
    assert not any(value in result.stdout for value in secrets.values())


async def test_100_mb_of_output_is_cut_and_killed(sandbox: Sandbox, config: SandboxConfig) -> None:
    for stream in ("stdout", "stderr"):
        code = f"import sys\nfor _ in range(100):\n    sys.{stream}.buffer.write(b'x' * 1024 * 1024)"
        started = time.perf_counter()
        result = await sandbox.run(code)
        assert result.status == "output_limit" and stream in result.reason, result
        text, truncated = (result.stdout, result.stdout_truncated) if stream == "stdout" else \
            (result.stderr, result.stderr_truncated)
        assert truncated and text == "x" * LIMITS.max_output_bytes
        assert time.perf_counter() - started < LIMITS.wall_seconds  # killed at the cap, not at the timeout
    assert_nothing_left(config)


async def test_syntax_error_is_reported_not_raised(sandbox: Sandbox) -> None:
    result = await sandbox.run("def broken(:\n    return 1")
    assert result.status == "syntax_error" and result.reason.startswith("SyntaxError"), result
    assert 'File "main.py", line 1' in result.stderr
    # a SyntaxError raised at run time is an ordinary error: the code compiled and ran
    runtime = await sandbox.run("print('ran')\neval('1 +')")
    assert runtime.status == "error" and runtime.stdout == "ran\n" and "SyntaxError" in runtime.reason


async def test_exception_and_exit_codes_are_reported(sandbox: Sandbox) -> None:
    crash = await sandbox.run("def f():\n    return 1 / 0\nf()")
    assert crash.status == "error" and crash.exit_code == 1
    assert crash.reason == "exited with code 1: ZeroDivisionError: division by zero"
    assert "main.py" in crash.stderr and "<string>" not in crash.stderr  # the stub's frames are hidden
    exited = await sandbox.run("import sys\nsys.exit(3)")
    assert (exited.status, exited.exit_code) == ("error", 3)
    segv = await sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert (segv.status, segv.signal_name, segv.reason) == ("killed", "SIGSEGV", "killed by SIGSEGV")


async def test_non_utf8_output_is_replaced_and_flagged(sandbox: Sandbox) -> None:
    code = "import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe end\\n')\nsys.stderr.buffer.write(b'\\xc3')"
    result = await sandbox.run(code)
    assert result.status == "ok" and result.invalid_utf8, result
    assert result.stdout == "ok \ufffd\ufffd end\n" and result.stderr == "\ufffd"
    clean = await sandbox.run("print('naïve ✓')")
    assert clean.stdout == "naïve ✓\n" and not clean.invalid_utf8


async def test_concurrent_runs_do_not_interfere(sandbox: Sandbox, config: SandboxConfig) -> None:
    code = """
        import json, os, sys, time
        token = sys.stdin.read()
        open("state.txt", "w").write(token)
        time.sleep(0.3)
        print(json.dumps([open("state.txt").read(), sorted(os.listdir(".")), os.getuid()]))
    """
    tokens = [f"run-{i}" for i in range(8)]
    results = await asyncio.gather(*(sandbox.run(textwrap.dedent(code), stdin=t) for t in tokens))
    assert all(r.status == "ok" for r in results), results
    seen = [json.loads(r.stdout) for r in results]
    assert [token for token, _, _ in seen] == tokens
    assert all(files == ["main.py", "state.txt"] for _, files, _ in seen)
    assert len({uid for _, _, uid in seen}) == len(tokens)
    assert_nothing_left(config)


# --- failing closed ---------------------------------------------------------------------------------


async def test_missing_readonly_path_fails_closed(tmp_path: Path) -> None:
    config = SandboxConfig(scratch_root=tmp_path / "scratch", pool_size=0,
                           extra_readonly_paths=(tmp_path / "missing",), **UIDS)
    result = await run("print('should not run')", config=config)
    assert result.status == "sandbox_error" and result.stdout == ""
    assert "missing" in result.reason and "does not exist" in result.reason
    assert_nothing_left(config)


PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork: the preexec child only calls it


def drop_cap_sys_admin() -> None:
    """preexec: remove CAP_SYS_ADMIN from the bounding set; the exec'd root process then lacks it
    (what a default Docker container does)."""
    pr_capbset_drop, cap_sys_admin = 24, 21
    if PRCTL(pr_capbset_drop, cap_sys_admin, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_without_cap_sys_admin_it_fails_closed(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import asyncio, json
        from rlpipe.sandbox import SandboxConfig, run
        result = asyncio.run(run("print('should not run')",
                                 config=SandboxConfig(scratch_root={str(tmp_path / 'scratch')!r})))
        print(json.dumps([result.status, result.reason, result.stdout]))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          preexec_fn=drop_cap_sys_admin, timeout=60)
    status, reason, stdout = json.loads(done.stdout)
    assert (status, stdout) == ("sandbox_error", ""), done.stderr
    assert "unshare" in reason and "Operation not permitted" in reason and "CAP_SYS_ADMIN" in reason
