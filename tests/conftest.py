"""Shared fixtures: ONE stack of real servers (Temporal dev server, Postgres, SeaweedFS) per
test session, in a temporary directory on free ports, stopped at the end of the session.

Set RLPIPE_TEST_HOME to reuse a stack directory between local runs (it is then left running).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.endpoints import Endpoints, resolve_endpoints
from infra.process import port_holder
from infra.settings import LOOPBACK, StackSettings
from infra.stack import Stack


def free_port_block(count: int) -> int:
    """The first of `count` consecutive free loopback ports, picked at random above 20000."""
    for _ in range(200):
        base = random.randint(20000, 60000 - count)
        if all(port_holder(LOOPBACK, base + i) is None for i in range(count)):
            return base
    raise RuntimeError(f"no block of {count} free ports found")


def test_stack_settings(home: Path) -> StackSettings:
    """Settings for a private stack: 16 consecutive free ports, state under `home`."""
    base = free_port_block(16)
    return StackSettings(
        home=home, temporal_port=base, temporal_ui_port=base + 1, temporal_http_port=base + 2,
        temporal_metrics_port=base + 3, postgres_port=base + 4, s3_port=base + 5, seaweed_base_port=base + 6,
        inference_base_port=base + 14,
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
def stack(stack_settings: StackSettings) -> Iterator[Stack]:
    stack = Stack(stack_settings)
    stack.up(progress=lambda msg: None)
    yield stack
    if not os.environ.get("RLPIPE_TEST_HOME"):
        stack.down(progress=lambda msg: None)


@pytest.fixture(scope="session")
def endpoints(stack: Stack) -> Endpoints:
    return resolve_endpoints(stack.settings)


@pytest.fixture(scope="session")
def migrated_db(endpoints: Endpoints):  # type: ignore[no-untyped-def]
    from alembic import command

    from migrations import alembic_config
    from storage.db import Database

    command.upgrade(alembic_config(endpoints.database_url), "head")
    db = Database(endpoints.database_url)
    yield db
    db.dispose()


@pytest.fixture(scope="session")
def object_store(endpoints: Endpoints):  # type: ignore[no-untyped-def]
    from storage.object_store import ObjectStore

    return ObjectStore.from_endpoints(endpoints)
