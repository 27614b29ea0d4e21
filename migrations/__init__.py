"""Alembic migrations. `rlpipe db upgrade|downgrade|current` drives them through `alembic_config`."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from alembic.config import Config

from rlpipe.infra.endpoints import normalise_database_url

HERE = Path(str(resources.files(__name__)))  # env.py, script.py.mako and versions/ ship in the package


def alembic_config(database_url: str) -> Config:
    """An Alembic config pointing at this folder and `database_url`, in SQLAlchemy's or libpq's form
    (no alembic.ini needed)."""
    config = Config()
    config.set_main_option("script_location", str(HERE))
    config.set_main_option("version_locations", str(HERE / "versions"))
    config.set_main_option("path_separator", "os")
    config.attributes["database_url"] = normalise_database_url(database_url)
    return config
