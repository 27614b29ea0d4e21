"""Separate "hosts" on one machine: Linux network namespaces on a bridge of their own.

Each host is a network namespace with its own loopback and one address on a private /24; a bridge
in the root namespace joins them (veth pairs), and the root namespace gets an address there too, as
the operator's machine (the test process). Nothing else is reachable from a host: a service that
still assumed localhost, or a worker that took an address from anywhere but its settings, fails.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

SUBNETS = [f"10.231.{third}" for third in range(147, 163)] + [f"172.31.{third}" for third in range(231, 239)]
"""The hosts' /24 is the first of these the machine does not route already (a CI machine's own
network may be one of them): host i is SUBNET.(i + 1), the operator SUBNET.254."""
PREFIX = "rlp"
"""Every bridge, veth and namespace made here is named PREFIX<pid of the test process>...: what a
killed test process left behind is known by its dead pid."""


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
    if shutil.which("ip") is None:
        raise NamespacesUnavailable("the `ip` command (iproute2) is not installed")
    _remove_leftovers()
    subnet = _free_subnet()
    tag = f"{PREFIX}{os.getpid()}"
    bridge = f"{tag}br"
    hosts = [Host(f"{tag}h{i}", f"{subnet}.{i + 1}") for i in range(count)]
    made: list[list[str]] = []  # how to undo each step, in the order made
    completed = False
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made.append(["link", "del", bridge])
        _ip("addr", "add", f"{subnet}.254/24", "dev", bridge)  # the operator: this test process
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


def _remove_leftovers() -> None:
    """Namespaces and links made by a test process that was killed before its teardown (its pid is
    gone): a stale bridge holding the operator's address would take the route to the hosts."""
    def dead(name: str) -> bool:
        found = re.match(rf"{PREFIX}(\d+)(h|br|v|p)\d*$", name)
        if found is None:
            return False
        try:
            os.kill(int(found[1]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, someone else's
            return False
        return False

    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    for netns in (line.split()[0] for line in listed if line.strip()):
        if dead(netns):
            for pid in Host(netns, "").pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout.splitlines()
    for link in (line.split()[0].split("@")[0] for line in links if line.strip()):
        if dead(link):
            subprocess.run(["ip", "link", "del", link], capture_output=True)


def _free_subnet() -> str:
    """The first of SUBNETS that overlaps no route and no address of this machine: with an overlap
    the operator's packets to a host could leave by another interface (and meet a stranger)."""
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    addresses = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    used = [ipaddress.ip_network(dest, strict=False) for dest in
            [_route_destination(line.split()) for line in routes.splitlines() if line.strip()] +
            [fields[fields.index("inet") + 1] for fields in (line.split() for line in addresses.splitlines())
             if "inet" in fields]
            if dest != "default"]
    for subnet in SUBNETS:
        network = ipaddress.ip_network(f"{subnet}.0/24")
        if not any(network.overlaps(other) for other in used if other.prefixlen > 0):
            return subnet
    raise NamespacesUnavailable(f"every candidate /24 for the hosts is routed here already: {SUBNETS}")


ROUTE_TYPES = {"unicast", "local", "broadcast", "multicast", "throw", "unreachable", "prohibit", "blackhole",
               "nat", "anycast"}


def _route_destination(fields: list[str]) -> str:
    """The destination of one line of `ip route show`: its first word, after the route type if any."""
    return fields[1] if fields[0] in ROUTE_TYPES else fields[0]
