"""Where workers and the CLI connect: the environment's addresses first, else the local stack's.

Secrets (the Postgres password, S3 keys) are read here, in the process that needs them, and
never put into workflow inputs or Temporal history.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from rlpipe.infra.settings import StackSettings, named_urls

START_THE_STACK = ("start it with `rlpipe stack up` (or set DATABASE_URL, S3_ENDPOINT_URL and TEMPORAL_ADDRESS "
                   "to point at your own services)")


class StackNotRunning(RuntimeError):
    """The local stack was never started in this state directory and no address replaces it."""


@dataclass(frozen=True)
class Endpoints:
    temporal_address: str
    temporal_namespace: str
    temporal_external: bool
    """An external cluster: connections take the Temporal profile's API key and TLS (infra/temporal_client.py)."""
    database_url: str
    s3_endpoint: str | None
    s3_access_key: str | None = field(repr=False)
    s3_secret_key: str | None = field(repr=False)
    s3_region: str
    bucket: str
    inference_urls: list[str]
    temporal_ui_url: str | None
    inference_token: str | None = field(repr=False)
    """What the inference servers' admin routes (pause, reload) take (inference/admin_guard.py)."""


def resolve_endpoints(settings: StackSettings) -> Endpoints:
    from rlpipe.infra.inference import inference_token
    from rlpipe.infra.postgres import PostgresService
    from rlpipe.infra.seaweed import SeaweedService

    if settings.external_database_url is not None:
        database_url = normalise_database_url(settings.external_database_url)
    else:
        postgres = PostgresService(settings)
        _require_started(postgres.password_file)
        database_url = postgres.database_url()
    if settings.external_s3_endpoint is not None:
        key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    else:
        seaweed = SeaweedService(settings)
        _require_started(seaweed.credentials_file)
        key, secret = seaweed.credentials()
    return Endpoints(
        temporal_address=settings.temporal_address,
        temporal_namespace=settings.temporal_namespace,
        temporal_external=settings.external_temporal is not None,
        database_url=database_url,
        s3_endpoint=settings.s3_endpoint,
        s3_access_key=key,
        s3_secret_key=secret,
        s3_region=os.environ.get("AWS_REGION", "us-east-1"),
        bucket=settings.bucket,
        inference_urls=settings.inference_urls(),
        temporal_ui_url=settings.temporal_ui_url,
        inference_token=inference_token(settings),
    )


def _require_started(secret: Path) -> None:
    """The local stack writes its services' secrets when it first starts them: without one, that
    service was never started here (another RLPIPE_HOME, or no `rlpipe stack up` yet)."""
    if not secret.exists():
        raise StackNotRunning(f"the stack is not running ({secret} does not exist): {START_THE_STACK}")


def database_url(url: str | None = None) -> str:
    """`url` in SQLAlchemy's form, else DATABASE_URL / the local stack's, as the workers resolve it."""
    from rlpipe.infra.settings import load_settings

    return normalise_database_url(url) if url else resolve_endpoints(load_settings()).database_url


def normalise_database_url(url: str) -> str:
    """SQLAlchemy needs the driver named; accept the plain `postgresql://` form users have."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def libpq_url(url: str) -> str:
    """`url` without SQLAlchemy's driver name, as psql and other libpq clients take it (they reject
    `postgresql+psycopg://`); `normalise_database_url` turns it back."""
    from sqlalchemy.engine import make_url

    return make_url(normalise_database_url(url)).set(drivername="postgresql").render_as_string(hide_password=False)


def redact(url: str) -> str:
    """The URL with its password replaced, for logs and status lines."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a database URL: show nothing risky
        return url.split("@")[-1]


def check_external(settings: StackSettings) -> list[tuple[str, str, bool, str]]:
    """(name, address, healthy, detail) for each service configured from outside."""
    rows: list[tuple[str, str, bool, str]] = []
    if settings.external_database_url is not None:
        rows.append(("postgres (external)", redact(settings.external_database_url),
                     *_probe(lambda: _check_database(normalise_database_url(settings.external_database_url or "")))))
    if settings.external_s3_endpoint is not None:
        rows.append(("s3 (external)", settings.s3_endpoint or "AWS S3", *_probe(lambda: _check_s3(settings))))
    if settings.external_temporal is not None:
        rows.append(("temporal (external)", settings.external_temporal, *_probe(lambda: _check_temporal(settings))))
    for name, url in named_urls(settings.external_inference_urls).items():
        rows.append((f"inference {name} (external)", url, *_probe(partial(_check_http, url + "/health"))))
    return rows


def _probe(check: Callable[[], object]) -> tuple[bool, str]:
    try:
        check()
        return True, "healthy"
    except Exception as exc:  # noqa: BLE001 - report any failure as its text
        return False, f"unhealthy: {type(exc).__name__}: {exc}"


def _check_database(url: str) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("select 1"))
    finally:
        engine.dispose()


def _check_s3(settings: StackSettings) -> None:
    from rlpipe.storage.object_store import ObjectStore

    ObjectStore.from_endpoints(resolve_endpoints(settings)).check()


def _check_temporal(settings: StackSettings) -> None:
    import asyncio

    from rlpipe.infra.temporal_client import connect_temporal, temporal_connection

    async def probe() -> None:
        client = await connect_temporal(temporal_connection(settings.temporal_address, settings.temporal_namespace,
                                                            external=True))
        await client.service_client.check_health()

    asyncio.run(probe())


def _check_http(url: str) -> None:
    import httpx

    httpx.get(url, timeout=3).raise_for_status()
