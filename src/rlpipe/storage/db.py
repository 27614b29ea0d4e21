"""Database engine and sessions. Data functions take a `Session`; the caller owns the
transaction (`with db.begin() as s: ...`), as the SQLAlchemy docs recommend."""

from __future__ import annotations

from contextlib import AbstractContextManager

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from rlpipe.infra.endpoints import normalise_database_url


class Database:
    """One engine and session factory per process, built from a database URL: SQLAlchemy's
    `postgresql+psycopg://` or libpq's `postgresql://` (what psql and DATABASE_URL usually hold)."""

    def __init__(self, url: str, pool_size: int = 5) -> None:
        self.engine = sa.create_engine(normalise_database_url(url), pool_size=pool_size, max_overflow=10,
                                       pool_pre_ping=True, connect_args={"connect_timeout": 5})
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)

    def begin(self) -> AbstractContextManager[Session]:
        """A session inside a transaction that commits on leaving the `with` (rolls back on error)."""
        return self.sessions.begin()

    def session(self) -> Session:
        return self.sessions()

    def dispose(self) -> None:
        self.engine.dispose()
