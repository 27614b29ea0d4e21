"""Each box on its own host (issue #20 item 2): three network namespaces on a private bridge.

Host A runs the stack (Temporal, PostgreSQL, SeaweedFS) bound to its own address; host B an
inference server and its sync sidecar, pointed at A by what `rlpipe stack env` printed on A; host C
the rollout, sandbox, grader and trainer workers, pointed at A and at B's server by what A and B
printed. The test process is the operator's machine on the same bridge: it starts a run on A's
Temporal and reads the audit trail from A's PostgreSQL. Nothing runs on loopback across hosts, no
checkpoint is shared through a filesystem (B downloads each version from A's S3), and every
process is gone and every namespace removed afterwards.

Skipped, with the reason, where network namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlpipe.cli.run_commands import start_run
from rlpipe.infra.endpoints import normalise_database_url
from rlpipe.infra.temporal_client import connect_temporal, temporal_connection
from rlpipe.observe.invariants import check_run
from rlpipe.storage.db import Database
from rlpipe.storage.object_store import ObjectStore
from rlpipe.workers.common import data_converter
from tests.integration.hosts import Host, NamespacesUnavailable, network_hosts
from tests.integration.runs import RUN_TIMEOUT_S, rows, tiny_config
from tests.waiting import run_result

pytestmark = [pytest.mark.stack, pytest.mark.vllm]

ADDRESS_VARIABLES = ("RLPIPE_CONFIG", "RLPIPE_HOME", "TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "DATABASE_URL",
                     "S3_ENDPOINT_URL", "INFERENCE_URLS", "RLPIPE_INFERENCE_TOKEN", "RLPIPE_BUCKET",
                     "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
WORKERS = ("rollout", "sandbox", "grader", "trainer")


class Machine:
    """One host with its own state directory and settings file, driven through the `rlpipe` CLI."""

    def __init__(self, host: Host, home: Path, stack: dict[str, object], env: dict[str, str]) -> None:
        self.host = host
        self.home = home
        home.mkdir(parents=True)
        lines = [f"{key} = {value!r}" if isinstance(value, int) else f'{key} = "{value}"'
                 for key, value in {"home": str(home), "host": host.address, **stack}.items()]
        (home / "rlpipe.toml").write_text("[stack]\n" + "\n".join(lines) + "\n")
        outer = {k: v for k, v in os.environ.items() if k not in ADDRESS_VARIABLES}
        self.env = {**outer, **env, "RLPIPE_CONFIG": str(home / "rlpipe.toml"), "RLPIPE_HOME": str(home)}

    def rlpipe(self, *args: str, timeout_s: float = 300) -> str:
        done = subprocess.run(self.host.command([sys.executable, "-m", "rlpipe.cli.main", *args]),
                              capture_output=True, text=True, env=self.env, timeout=timeout_s, cwd=self.home)
        assert done.returncode == 0, f"`rlpipe {' '.join(args)}` on {self.host.address}:\n{done.stdout}{done.stderr}"
        return done.stdout

    def exports(self) -> dict[str, str]:
        """What `rlpipe stack env` prints on this host, for the other hosts."""
        pairs = (line.removeprefix("export ").split("=", 1) for line in self.rlpipe("stack", "env").splitlines()
                 if line.startswith("export "))
        return {key: value.strip("'") for key, value in pairs}


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN); this test runs as an unprivileged user")
    try:
        with network_hosts(3) as made:
            yield made
    except NamespacesUnavailable as exc:
        pytest.skip(f"network namespaces cannot be made here: {exc}")


async def test_a_run_with_the_stack_the_inference_server_and_the_workers_on_three_hosts(
        hosts: list[Host], tmp_path: Path, tiny_model: Path) -> None:
    stack_host, inference_host, worker_host = hosts
    stack = Machine(stack_host, tmp_path / "a", {"inference_servers": 0}, {})
    started: list[tuple[Machine, tuple[str, ...]]] = []  # what to stop, in reverse order
    try:
        stack.rlpipe("stack", "up")
        started.append((stack, ("stack", "down")))
        services = stack.exports()
        assert stack_host.address in services["TEMPORAL_ADDRESS"] and stack_host.address in services["DATABASE_URL"]

        inference = Machine(inference_host, tmp_path / "b",
                            {"inference_servers": 1, "inference_model": str(tiny_model)}, services)
        inference.rlpipe("stack", "up", timeout_s=600)
        started.append((inference, ("stack", "down")))
        inference.rlpipe("workers", "up", "sidecar-0")
        started.append((inference, ("workers", "down")))
        server = inference.exports()
        assert server["INFERENCE_URLS"].startswith(f"http://{inference_host.address}:")

        workers = Machine(worker_host, tmp_path / "c", {"inference_servers": 0},
                          {**services, "INFERENCE_URLS": server["INFERENCE_URLS"]})
        workers.rlpipe("workers", "up", *WORKERS)
        started.append((workers, ("workers", "down")))

        # the operator's machine starts the run on host A's Temporal and reads A's PostgreSQL
        client = await connect_temporal(temporal_connection(services["TEMPORAL_ADDRESS"], "default", external=False),
                                        data_converter=data_converter())
        cfg = tiny_config(tiny_model, steps=3)
        result = await run_result(await start_run(client, cfg), RUN_TIMEOUT_S)
        assert result.steps == 3 and result.groups_failed == 0

        db = Database(normalise_database_url(services["DATABASE_URL"]))
        store = ObjectStore.connect(services["S3_ENDPOINT_URL"], services["AWS_ACCESS_KEY_ID"],
                                    services["AWS_SECRET_ACCESS_KEY"], services["RLPIPE_BUCKET"])
        try:
            published = {r.version for r in rows(db, "select version from policy_versions where run_id = :r",
                                                 r=cfg.name)}
            syncs = rows(db, "select version, status, bytes from sync_events where run_id = :r and server = '0'",
                         r=cfg.name)
            servers_used = {r.server for r in rows(db, "select distinct tu.server from turns tu join trajectories t "
                                                       "on t.id = tu.trajectory_id where t.run_id = :r", r=cfg.name)}
            with db.begin() as s:
                broken = [inv for inv in check_run(s, cfg.name, store=store) if not inv.ok]
        finally:
            db.dispose()
        assert broken == [], broken
        assert max(published) == result.version and servers_used == {"0"}
        assert {r.version for r in syncs if r.status == "ok"} >= {result.version}, "the final version was verified"
        assert all(r.bytes > 0 for r in syncs if r.status == "ok"), "host B downloaded each version from A's S3"

        # host C's workers reach A's services and B's server at their addresses
        talked_to = _peers(worker_host.pids()[0])
        assert stack_host.address in talked_to and inference_host.address in talked_to, talked_to
    finally:
        for machine, command in reversed(started):
            machine.rlpipe(*command)


def _peers(pid: int) -> set[str]:
    """The remote IPv4 addresses of the established TCP connections in the network namespace of
    `pid` (its /proc/PID/net/tcp: psutil reads the caller's namespace's table instead)."""
    peers = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        _, _, remote, state, *_ = line.split()
        if state == "01":  # ESTABLISHED
            address = int(remote.split(":")[0], 16)  # little-endian IPv4
            peers.add(str(ipaddress.IPv4Address(address.to_bytes(4, "little"))))
    return peers
