"""The fleet registry on real Postgres: a sidecar registers its server by name, and a worker that
was started without that server finds it there (what a join to a running run relies on)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from rlpipe.inference.directory import ServerDirectory, UnknownServer, announce
from rlpipe.storage.db import Database
from rlpipe.storage.servers import register_server, registered_servers

pytestmark = pytest.mark.stack


def _register(db: Database, name: str, url: str) -> None:
    with db.begin() as s:
        register_server(s, name, url)


async def test_a_worker_finds_a_server_registered_after_it_started(migrated_db: Database) -> None:
    joiner = f"gpu-{uuid.uuid4().hex[:8]}"
    directory = ServerDirectory({"0": "http://10.0.0.1:8000"}, migrated_db)
    with pytest.raises(UnknownServer) as unknown:
        await directory.url(joiner)
    assert f"no inference server named {joiner!r}" in str(unknown.value)
    assert f"rlpipe worker sidecar --server {joiner} --url URL" in str(unknown.value)

    _register(migrated_db, joiner, "http://10.0.0.9:8000")
    assert await directory.url(joiner) == "http://10.0.0.9:8000"
    assert await directory.url("0") == "http://10.0.0.1:8000"


async def test_registering_again_moves_a_server_and_configured_names_win(migrated_db: Database) -> None:
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    _register(migrated_db, name, "http://10.0.0.2:8000")
    _register(migrated_db, name, "http://10.0.0.3:8000")  # its sidecar restarted on another host
    with migrated_db.begin() as s:
        assert registered_servers(s)[name] == "http://10.0.0.3:8000"
    # a worker configured with the name keeps its own address for it
    assert await ServerDirectory({name: "http://10.0.0.4:8000"}, migrated_db).url(name) == "http://10.0.0.4:8000"


async def test_a_sidecar_started_before_the_migrations_registers_once_they_are_applied(empty_database: str) -> None:
    from alembic import command

    from rlpipe.migrations import alembic_config

    db = Database(empty_database)
    try:
        announcing = asyncio.create_task(announce(db, "gpu-early", "http://10.0.0.5:8000", every_s=0.2))
        await asyncio.sleep(1.0)
        assert not announcing.done()  # no table yet: it keeps trying instead of dying
        await asyncio.to_thread(command.upgrade, alembic_config(empty_database), "head")
        await asyncio.wait_for(announcing, 30)
        assert await ServerDirectory({}, db).url("gpu-early") == "http://10.0.0.5:8000"
    finally:
        db.dispose()
