"""Alembic migrations against a fresh database on the real Postgres."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.script import ScriptDirectory

from rlpipe.migrations import alembic_config
from rlpipe.schemas.tables import Base

pytestmark = pytest.mark.stack

VIEWS = {"v_trajectory_lineage", "v_version_lag", "v_failures"}


def schema_objects(url: str) -> tuple[set[str], set[str]]:
    engine = sa.create_engine(url)
    try:
        inspector = sa.inspect(engine)
        return set(inspector.get_table_names()) - {"alembic_version"}, set(inspector.get_view_names())
    finally:
        engine.dispose()


def test_upgrade_empty_database_then_downgrade_cleanly(empty_database: str) -> None:
    config = alembic_config(empty_database)
    assert schema_objects(empty_database) == (set(), set())

    command.upgrade(config, "head")
    tables, views = schema_objects(empty_database)
    assert tables == set(Base.metadata.tables) and views == VIEWS
    command.check(config)  # the models and the migrations agree (raises if autogenerate finds a diff)

    command.downgrade(config, "base")
    assert schema_objects(empty_database) == (set(), set())
    command.upgrade(config, "head")  # and up again: downgrade left nothing behind that blocks it
    assert schema_objects(empty_database)[0] == set(Base.metadata.tables)


def test_migration_history_is_linear() -> None:
    script = ScriptDirectory.from_config(alembic_config("postgresql+psycopg://unused"))
    assert len(script.get_heads()) == 1, "two migration heads: merge them"
