"""Shared fixtures: ONE stack of real servers (Temporal dev server, Postgres, SeaweedFS) per
test session, in a temporary directory on free ports, stopped at the end of the session.

Set RLPIPE_TEST_HOME to reuse a stack directory between local runs (it is then left running).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlpipe.infra.endpoints import Endpoints, resolve_endpoints
from rlpipe.infra.process import port_holder
from rlpipe.infra.settings import LOOPBACK, StackSettings
from rlpipe.infra.stack import Stack

WORKFLOW_LOGIC_NAMESPACE = "rlpipe-workflow-logic"
"""Where tests/workflows run their fake activities: the session's real workers poll the same task
queue names in the main namespace and would take the fakes' tasks."""


def free_port_block(count: int) -> int:
    """The first of `count` consecutive free loopback ports, picked at random from 20000 up to the
    kernel's ephemeral range: a port in that range can be taken at any moment as the local end of
    some outgoing connection (CI once lost SeaweedFS's S3 port so, seconds after checking it)."""
    top = ephemeral_ports()[0] - count
    for _ in range(200):
        base = random.randint(20000, top)
        if all(port_holder(LOOPBACK, base + i) is None for i in range(count)):
            return base
    raise RuntimeError(f"no block of {count} free ports found below {top + count}")


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; its default elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def test_stack_settings(home: Path) -> StackSettings:
    """Settings for a private stack: 16 consecutive free ports, state under `home`."""
    base = free_port_block(16)
    return StackSettings(
        home=home, temporal_port=base, temporal_ui_port=base + 1, temporal_http_port=base + 2,
        temporal_metrics_port=base + 3, postgres_port=base + 4, s3_port=base + 5, seaweed_base_port=base + 6,
        inference_base_port=base + 14, metrics_base_port=0,  # workers pick free metrics ports
        temporal_extra_namespaces=[WORKFLOW_LOGIC_NAMESPACE],
    )


test_stack_settings.__test__ = False  # a helper, not a test


@pytest.fixture(scope="session")
def stack_settings() -> Iterator[StackSettings]:
    keep = os.environ.get("RLPIPE_TEST_HOME")
    home = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="rlpipe-test-"))
    settings_file = home / "settings.json"
    if keep and settings_file.exists():
        settings = StackSettings.model_validate_json(settings_file.read_text())
    else:
        home.mkdir(parents=True, exist_ok=True)
        settings = test_stack_settings(home)
        settings_file.write_text(settings.model_dump_json())
    yield settings
    if not keep:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def session_stack(stack_settings: StackSettings) -> Iterator[Stack]:
    """The session's stack, its services started only as fixtures need them; all stopped at the end."""
    stack = Stack(stack_settings)
    yield stack
    if not os.environ.get("RLPIPE_TEST_HOME"):
        stack.down(progress=lambda msg: None)


@pytest.fixture(scope="session")
def temporal_server(session_stack: Stack) -> Stack:
    """Only the Temporal dev server, for tests of the workflows' own logic."""
    session_stack.up(only=["temporal"], progress=lambda msg: None)
    return session_stack


@pytest.fixture(scope="session")
def stack(session_stack: Stack, request: pytest.FixtureRequest) -> Stack:
    """Temporal, Postgres and SeaweedFS (inference servers come with `inference_servers`). When the
    session's tests need the tiny model too, it is built (in a child process) while they start."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        started = pool.submit(session_stack.up, progress=lambda msg: None)
        if any("tiny_model" in item.fixturenames for item in request.session.items):
            request.getfixturevalue("tiny_model")
        started.result()
    return session_stack


@pytest.fixture(scope="session")
def endpoints(stack: Stack) -> Endpoints:
    return resolve_endpoints(stack.settings)


@pytest.fixture(scope="session")
def migrated_db(endpoints: Endpoints):  # type: ignore[no-untyped-def]
    from alembic import command

    from rlpipe.migrations import alembic_config
    from rlpipe.storage.db import Database

    command.upgrade(alembic_config(endpoints.database_url), "head")
    db = Database(endpoints.database_url)
    yield db
    db.dispose()


@pytest.fixture
def empty_database(endpoints):  # type: ignore[no-untyped-def]
    """The URL of a database of its own on the session's Postgres, with no tables: before migrations."""
    import sqlalchemy as sa

    admin = sa.create_engine(endpoints.database_url, isolation_level="AUTOCOMMIT")
    name = f"mig_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'create database "{name}"')
    url = sa.engine.make_url(endpoints.database_url).set(database=name)
    yield url.render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'drop database "{name}" with (force)')
    admin.dispose()


@pytest.fixture(scope="session")
def object_store(endpoints: Endpoints):  # type: ignore[no-untyped-def]
    from rlpipe.storage.object_store import ObjectStore

    return ObjectStore.from_endpoints(endpoints)


@pytest.fixture(scope="session")
async def temporal_client(endpoints: Endpoints):  # type: ignore[no-untyped-def]
    from rlpipe.workers.common import connect

    return await connect(endpoints)


@pytest.fixture
async def clean_workflows(temporal_client):  # type: ignore[no-untyped-def]
    """Terminate the workflows a test leaves running (abandoned rollout groups of a cancelled run,
    say), so that the next test's workers on the same task queues never see them."""
    yield
    import asyncio

    from temporalio.client import WorkflowExecutionStatus

    # the list is eventually consistent (a group started a moment ago may not be in it yet): list until
    # two passes in a row find nothing running
    quiet_passes = 0
    for _ in range(40):
        found = 0
        async for wf in temporal_client.list_workflows("ExecutionStatus = 'Running'"):
            if wf.status == WorkflowExecutionStatus.RUNNING:
                found += 1
                try:
                    await temporal_client.get_workflow_handle(wf.id, run_id=wf.run_id).terminate("test cleanup")
                except Exception:  # noqa: BLE001 - it finished meanwhile
                    pass
        quiet_passes = quiet_passes + 1 if found == 0 else 0
        if quiet_passes == 2:
            return
        await asyncio.sleep(0.25)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny test model, reused across local sessions through the cache dir. Under CI it is
    built into an empty directory, so CI sees what a new machine sees (the build is reproducible
    byte for byte: tests/unit/test_policy.py checks a fresh build against this one)."""
    from rlpipe.policy.models import prepare_tiny

    return prepare_tiny(test_cache(tmp_path_factory) / "models" / "tiny")


def test_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """RLPIPE_TEST_CACHE if set; a fresh directory under CI=true; else ~/.cache/rlpipe-test."""
    if "RLPIPE_TEST_CACHE" in os.environ:
        return Path(os.environ["RLPIPE_TEST_CACHE"])
    if os.environ.get("CI") == "true":
        return tmp_path_factory.mktemp("fresh-test-cache")
    return Path.home() / ".cache" / "rlpipe-test"


test_cache.__test__ = False  # a helper, not a test


@pytest.fixture(scope="session")
def inference_servers(stack: Stack, tiny_model: Path) -> list[str]:
    """One real vLLM server with the tiny model, on the session stack; its URL."""
    from rlpipe.infra.settings import save_settings

    stack.settings.inference_servers = 1
    stack.settings.inference_model = tiny_model
    save_settings(stack.settings)
    for svc in stack.services():
        if svc.name.startswith("inference-"):
            stack.start(svc, progress=lambda msg: None)
    return stack.settings.inference_urls()


@pytest.fixture(scope="session")
def spare_server_settings(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> StackSettings:
    return StackSettings(home=tmp_path_factory.mktemp("spare-server"), inference_servers=1,
                         inference_base_port=free_port_block(1), inference_model=tiny_model)


@pytest.fixture(scope="session")
def spare_server_token(spare_server_settings: StackSettings) -> str:
    """What the spare server's admin routes (pause, reload, ...) take."""
    from rlpipe.infra.inference import local_inference_token

    return local_inference_token(spare_server_settings)


@pytest.fixture(scope="session")
def spare_server(spare_server_settings: StackSettings) -> Iterator[str]:
    """A vLLM server with the tiny model that no worker uses (own state directory and port), for
    tests that load weights into it and pause it; started once (~35 s), stopped at the end."""
    from rlpipe.infra.inference import InferenceService

    settings = spare_server_settings
    stack, service = Stack(settings), InferenceService(settings, 0)
    stack.start(service, progress=lambda msg: None)
    try:
        yield service.address()
    finally:
        stack.stop_service(service, progress=lambda msg: None)


@pytest.fixture(scope="session")
def pipeline_workers(stack: Stack, inference_servers: list[str], migrated_db):  # type: ignore[no-untyped-def]
    """The real worker processes (rollout, sandbox, grader, trainer, sync sidecar) on the stack, started
    on a migrated database, as `rlpipe stack up` leaves it."""
    from rlpipe.workers.launcher import WorkerSet

    workers = WorkerSet(stack.settings)
    workers.up(progress=lambda msg: None)
    yield workers
    workers.down(progress=lambda msg: None)
