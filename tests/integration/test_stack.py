"""The local stack's life cycle on real servers: up, idempotent up, status, a Temporal restart
that keeps workflow state, clear errors, and down leaving nothing running."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import uuid
from pathlib import Path

import psutil
import pytest
from temporalio.client import Client

from rlpipe.infra.inference import InferenceService
from rlpipe.infra.process import wait_for
from rlpipe.infra.service import Launch
from rlpipe.infra.settings import StackSettings
from rlpipe.infra.stack import Stack, StackError
from tests.conftest import free_port_block, test_stack_settings

pytestmark = pytest.mark.stack


async def start_parked_workflow(address: str) -> str:
    """A workflow execution no worker will ever pick up: it stays Running in the server's state."""
    client = await Client.connect(address)
    workflow_id = f"survives-restart-{uuid.uuid4()}"
    await client.start_workflow("NoSuchWorkflow", id=workflow_id, task_queue=f"nobody-{uuid.uuid4()}")
    return workflow_id


async def workflow_listed(address: str, workflow_id: str) -> bool:
    client = await Client.connect(address)
    description = await client.get_workflow_handle(workflow_id).describe()
    return description.id == workflow_id and description.status is not None


def test_stack_lifecycle(tmp_path: Path) -> None:
    settings = test_stack_settings(tmp_path / "home")
    stack = Stack(settings)
    try:  # a service that fails to start must not leave the others running
        stack.up(progress=lambda msg: None)
        rows = stack.status()
        assert [r.name for r in rows] == ["postgres", "seaweedfs", "temporal"]
        assert all(r.healthy and r.pid for r in rows), rows
        pids = {r.name: r.pid for r in rows}

        stack.up(progress=lambda msg: None)  # a second `up` starts no second copy of anything
        assert {r.name: r.pid for r in stack.status()} == pids
        assert len([p for p in psutil.process_iter(["cmdline"])
                    if str(settings.home.resolve()) in " ".join(p.info["cmdline"] or [])
                    and "start-dev" in (p.info["cmdline"] or [])]) == 1

        temporal = stack.service("temporal")
        assert (temporal.dir / "temporal.db-wal").exists(), "the dev server's SQLite is not in WAL mode"
        workflow_id = asyncio.run(start_parked_workflow(settings.temporal_address))
        stack.stop_service(temporal, progress=lambda msg: None)
        assert not stack.table.get("temporal")
        stack.start(temporal, progress=lambda msg: None)
        assert asyncio.run(workflow_listed(settings.temporal_address, workflow_id))
        trees = [proc.pid for record in stack.table.load().values() for proc in record.session()]
    finally:
        stack.down(progress=lambda msg: None)

    assert stack.table.load() == {}
    for pid in [*pids.values(), *trees]:  # down leaves nothing of any service's session
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    for port in (settings.temporal_port, settings.postgres_port, settings.s3_port):
        with socket.socket() as sock:
            assert sock.connect_ex((settings.host, port)) != 0, f"port {port} still answers after down"


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.vllm
def test_a_killed_inference_server_leaves_no_engine_running(tmp_path: Path, tiny_model: Path) -> None:
    """vLLM's engine core outlived a SIGKILLed API server (~2.4 GB, issue #15): the reaper ends it."""
    settings = StackSettings(home=tmp_path / "home", inference_servers=1, inference_base_port=free_port_block(1),
                             inference_model=tiny_model)
    stack, server = Stack(settings), InferenceService(settings, 0)
    stack.start(server, progress=lambda msg: None)
    try:
        record = stack.table.get(server.name)
        assert record is not None
        engine = [proc.pid for proc in psutil.Process(record.pid).children(recursive=True)]
        assert engine, "vLLM runs its engine core in a child process"
        os.kill(record.pid, signal.SIGKILL)
        assert wait_for(lambda: not any(running(pid) for pid in engine), timeout_s=30), "the engine outlived its server"
        assert wait_for(lambda: record.session() == [], timeout_s=10), f"left: {record.session()}"  # the reaper too
        [row] = [row for row in stack.status() if row.name == server.name]
        assert row.detail == "not running" and row.strays == []
    finally:
        stack.down(progress=lambda msg: None)
    assert record.session() == []


def test_port_taken_by_a_stranger_names_service_port_and_log(tmp_path: Path) -> None:
    settings = test_stack_settings(tmp_path / "home")
    with socket.socket() as squatter:
        squatter.bind((settings.host, settings.postgres_port))
        squatter.listen()
        with pytest.raises(StackError) as caught:
            Stack(settings).up(progress=lambda msg: None)
    message = str(caught.value)
    assert "postgres" in message and str(settings.postgres_port) in message and "postgres.log" in message
    assert Stack(settings).table.load() == {}  # nothing was started


def test_service_failing_its_health_check_is_reported_with_its_log(tmp_path: Path) -> None:
    settings = test_stack_settings(tmp_path / "home")
    stack = Stack(settings)
    temporal = stack.service("temporal")
    temporal.startup_timeout_s = 3
    temporal.launch = lambda: Launch(argv=["sleep", "30"])  # runs, never answers
    with pytest.raises(StackError) as caught:
        stack.start(temporal, progress=lambda msg: None)
    message = str(caught.value)
    assert "temporal" in message and "health check" in message and "temporal.log" in message
    assert stack.table.load() == {}  # the unhealthy process was stopped and forgotten


def test_bad_settings_name_the_field(tmp_path: Path) -> None:
    from rlpipe.infra.settings import SettingsError, load_settings

    config = tmp_path / "rlpipe.toml"
    config.write_text("[stack]\npostgres_port = 99999\n")
    with pytest.raises(SettingsError, match="postgres_port"):
        load_settings(config, env={})
    config.write_text("[stack]\npostgres_prot = 5432\n")
    with pytest.raises(SettingsError, match="postgres_prot"):
        load_settings(config, env={})
    config.write_text('[stack]\ntemporal_sqlite_pragmas = ["journal_mode wal"]\n')
    with pytest.raises(SettingsError, match="temporal_sqlite_pragmas"):
        load_settings(config, env={})
    assert isinstance(load_settings(tmp_path / "absent.toml", env={}), StackSettings)
