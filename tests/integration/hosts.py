"""Separate "hosts" on one machine: Linux network namespaces on a bridge of their own.

Each host is a network namespace with its own loopback and one address on a private /24; a bridge
in the root namespace joins them (veth pairs), and the root namespace gets an address there too, as
the operator's machine (the test process). Nothing else is reachable from a host: a service that
still assumed localhost, or a worker that took an address from anywhere but its settings, fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

SUBNET = "10.231.147"
"""The hosts' /24: host i is SUBNET.(i + 1), the operator SUBNET.254."""
OPERATOR = f"{SUBNET}.254"


class NamespacesUnavailable(RuntimeError):
    """Network namespaces (or veth pairs, or a bridge) cannot be made here; the message says why."""


@dataclass(frozen=True)
class Host:
    netns: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's network namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True)
        return [int(pid) for pid in out.stdout.split()]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise NamespacesUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.stdout.strip()}")


@contextmanager
def network_hosts(count: int) -> Iterator[list[Host]]:
    """`count` hosts on one bridge; on the way out, every process left in them is killed (and
    named in the error raised then), and the namespaces, veth pairs and bridge are removed."""
    tag = f"rlp{os.getpid() % 100000}"
    bridge = f"{tag}br"
    hosts = [Host(f"{tag}h{i}", f"{SUBNET}.{i + 1}") for i in range(count)]
    made: list[list[str]] = []  # how to undo each step, in the order made
    completed = False
    try:
        try:
            _ip("link", "add", bridge, "type", "bridge")
        except FileNotFoundError as exc:
            raise NamespacesUnavailable("the `ip` command (iproute2) is not installed") from exc
        made.append(["link", "del", bridge])
        _ip("addr", "add", f"{OPERATOR}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, host in enumerate(hosts):
            outside, inside = f"{tag}v{i}", f"{tag}p{i}"
            _ip("netns", "add", host.netns)
            made.append(["netns", "del", host.netns])
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            made.append(["link", "del", outside])
            _ip("link", "set", inside, "netns", host.netns)
            _ip("link", "set", outside, "master", bridge)
            _ip("link", "set", outside, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", inside)
            _ip("-n", host.netns, "link", "set", inside, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        yield hosts
        completed = True
    finally:
        left = {host.netns: host.pids() for host in hosts if ["netns", "del", host.netns] in made}
        for pids in left.values():
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for undo in reversed(made):
            subprocess.run(["ip", *undo], capture_output=True)
        stray = {netns: pids for netns, pids in left.items() if pids}
        if stray and completed:  # else the failure in flight says more
            raise AssertionError(f"processes outlived their host's teardown (killed): {stray}")
