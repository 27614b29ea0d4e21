"""Alembic environment: the one metadata from `schemas.tables`, no connection pool, short
timeouts, and a Postgres advisory lock so two processes never migrate at once."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from rlpipe.schemas.tables import Base

MIGRATION_LOCK = 7_231_001  # arbitrary advisory-lock id owned by rlpipe migrations

config = context.config
target_metadata = Base.metadata


def _database_url() -> str:
    """The URL `rlpipe.migrations.alembic_config` was given, else an alembic.ini's sqlalchemy.url."""
    url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL to migrate: build the config with rlpipe.migrations.alembic_config(url)")
    return str(url)


def run_migrations_online() -> None:
    engine = sa.create_engine(_database_url(), poolclass=sa.pool.NullPool)
    with engine.connect() as connection:
        connection.execute(sa.text("set lock_timeout = '10s'"))
        connection.execute(sa.text("set statement_timeout = '120s'"))
        connection.execute(sa.text("select pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK})
        connection.commit()
        try:
            context.configure(connection=connection, target_metadata=target_metadata, compare_type=True)
            with context.begin_transaction():
                context.run_migrations()
        finally:
            connection.execute(sa.text("select pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK})
            connection.commit()
    engine.dispose()


def run_migrations_offline() -> None:
    """Write the migrations as one SQL script (`alembic upgrade --sql`), for a DBA who applies them
    by hand to a managed Postgres; nothing is connected to."""
    context.configure(url=_database_url(), target_metadata=target_metadata, literal_binds=True,
                      dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
