"""The stack supervises process trees (issue #15, item 3), on real processes: a server's children
that outlive its main process are found, reported and stopped, by `stop`, `kill`, the stack's
`status`, `up` and `down`, and by the reaper as soon as the main process dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from rlpipe.infra.process import ProcessRecord, free_port, kill, spawn, stop
from rlpipe.infra.service import Launch, Service
from rlpipe.infra.settings import StackSettings
from rlpipe.infra.stack import Stack

SERVER = ("import subprocess, sys, time; "
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)")
"""A server that starts a child in its session and runs on, as vLLM's API server starts its engine."""
SERVER_ARGV = [sys.executable, "-c", SERVER]


def until(condition: Callable[[], object], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def gone(pids: list[int]) -> bool:
    """None of `pids` runs (a zombie waiting for its parent to reap it runs no more)."""
    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    return not any(running(pid) for pid in pids)


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Callable[..., ProcessRecord]]:
    """Start SERVER (a leader and its child); whatever a test leaves of it is killed afterwards."""
    records: list[ProcessRecord] = []

    def start(reap_orphans: bool = False) -> ProcessRecord:
        record = spawn("server", SERVER_ARGV, tmp_path / "server.log", reap_orphans=reap_orphans)
        records.append(record)
        until(lambda: len(record.session()) == (3 if reap_orphans else 2), "the server started its child")
        return record

    yield start
    for record in records:
        kill(record)


def orphan(record: ProcessRecord) -> list[int]:
    """SIGKILL the record's main process only; the pids of the rest of its session."""
    left = [proc.pid for proc in record.session() if proc.pid != record.pid]
    os.kill(record.pid, signal.SIGKILL)
    until(lambda: not record.is_running(), "the main process is gone")
    return left


@pytest.mark.parametrize("end", [stop, kill])
def test_a_dead_servers_children_are_strays_that_stop_and_kill_end(
        started: Callable[..., ProcessRecord], end: Callable[[ProcessRecord], bool]) -> None:
    record = started()
    assert record.strays() == []  # the server runs: its child is no stray
    left = orphan(record)
    assert [proc.pid for proc in record.strays()] == left
    assert end(record)
    assert gone(left) and record.session() == []
    assert not end(record)  # nothing left to end


def test_a_running_server_is_stopped_with_its_children(started: Callable[..., ProcessRecord]) -> None:
    record = started()
    tree = [proc.pid for proc in record.session()]
    assert stop(record, timeout_s=5)
    assert gone(tree)


def test_a_stranger_holding_the_pid_is_never_signalled(tmp_path: Path) -> None:
    stranger = subprocess.Popen(SERVER_ARGV, start_new_session=True)
    try:
        until(lambda: len(psutil.Process(stranger.pid).children()) == 1, "the stranger started its child")
        record = ProcessRecord("server", stranger.pid, started_at=0.0, argv=["not", "this"], log="")
        assert record.session() == [] and record.strays() == []
        assert not stop(record, timeout_s=1) and not kill(record)
        assert stranger.poll() is None
    finally:
        os.killpg(stranger.pid, signal.SIGKILL)
        stranger.wait()


def test_the_reaper_stops_the_children_as_soon_as_the_server_dies(started: Callable[..., ProcessRecord]) -> None:
    record = started(reap_orphans=True)
    assert psutil.Process(record.pid).cmdline() == SERVER_ARGV  # the record names the server itself
    left = orphan(record)  # the child and the reaper
    until(lambda: gone(left), "the reaper stopped the child and exited")
    assert "stopping what it left running" in Path(record.log).read_text()


def test_a_reaped_server_stops_whole_reaper_included(started: Callable[..., ProcessRecord]) -> None:
    record = started(reap_orphans=True)
    tree = [proc.pid for proc in record.session()]
    assert stop(record, timeout_s=10)
    assert gone(tree)


class FakeServer(Service):
    """SERVER as a stack service: healthy while it runs."""

    name = "fake"
    stop_timeout_s = 5.0

    def __init__(self, settings: StackSettings) -> None:
        super().__init__(settings)
        self.port = free_port()

    def ports(self) -> list[int]:
        return [self.port]

    def address(self) -> str:
        return f"fake:{self.port}"

    def launch(self) -> Launch:
        return Launch(argv=SERVER_ARGV)

    def check_health(self) -> None:
        pass


def test_stack_status_reports_strays_up_clears_them_and_down_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stack = Stack(StackSettings(home=tmp_path / "home"))
    fake = FakeServer(stack.settings)
    monkeypatch.setattr(stack, "services", lambda: [fake])
    messages: list[str] = []
    try:
        stack.start(fake, progress=messages.append)
        first = stack.table.get(fake.name)
        assert first is not None
        until(lambda: len(first.session()) == 2, "the server started its child")
        left = orphan(first)

        [row] = stack.status()
        assert not row.healthy and row.pid is None and "1 stray process" in row.detail
        [stray] = row.strays
        assert stray.pid == left[0] and "time.sleep(120)" in stray.command and stray.rss_bytes > 0

        stack.start(fake, progress=messages.append)  # `up` clears the strays, then starts it again
        assert gone(left) and any("stray" in message for message in messages)
        second = stack.table.get(fake.name)
        assert second is not None and second.is_running()
        until(lambda: len(second.session()) == 2, "the new server started its child")
        tree = [proc.pid for proc in second.session()]
        left = orphan(second)
    finally:
        stack.down(progress=messages.append)
    assert gone(tree) and stack.table.load() == {}
