"""Where the stack's services live: ports, data directory and external addresses.

Every address can be overridden from the environment so that the same code points at a
Temporal cluster, a managed Postgres, AWS S3 or GPU vLLM servers instead of the local stack:

| variable | meaning |
|---|---|
| `RLPIPE_HOME` | state directory of the local stack (data, logs, pid records) |
| `TEMPORAL_ADDRESS` | host:port of an external Temporal frontend; the local dev server is not started |
| `TEMPORAL_NAMESPACE` | Temporal namespace (default `default`) |
| `TEMPORAL_API_KEY`, `TEMPORAL_TLS_*`, `TEMPORAL_PROFILE`, ... | Temporal's own client settings (temporal_client.py) |
| `DATABASE_URL` | an external Postgres; the embedded one is not started |
| `S3_ENDPOINT_URL` | an external S3-compatible endpoint; SeaweedFS is not started (empty string = AWS) |
| `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_REGION` | S3 credentials for an external endpoint |
| `RLPIPE_BUCKET` | bucket for checkpoints and bulky data |
| `INFERENCE_URLS` | comma-separated base URLs of external vLLM servers; local ones are not started |
| `RLPIPE_WEIGHT_STREAM_HOST` / `_PORT` | where the trainer serves published weights (sync.transport "stream") |

A TOML file (`RLPIPE_CONFIG`, default `rlpipe.toml` in the working directory) may hold a
`[stack]` table with the same fields as `StackSettings`; environment variables win over it.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator

LOOPBACK = "127.0.0.1"
SERVER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
"""An inference server's name: it is part of its sync queue's name (`inference-<name>`)."""


class StackSettings(BaseModel):
    """Ports and paths of the local stack. Defaults avoid the well-known ports of the same
    services (7233, 5432, 8333, 8000) so that a developer's own servers do not collide."""

    model_config = ConfigDict(extra="forbid")

    home: Path = Path(".rlpipe")
    """State directory: one sub-directory per service with its data and log."""
    host: str = LOOPBACK
    """Address every local service binds to. Keep loopback unless you know why not."""

    temporal_port: int = Field(17233, ge=1, le=65535)
    """Temporal frontend gRPC port."""
    temporal_ui_port: int = Field(18233, ge=1, le=65535)
    """Temporal Web UI port."""
    temporal_http_port: int = Field(17243, ge=1, le=65535)
    """Temporal HTTP API port."""
    temporal_metrics_port: int = Field(17244, ge=1, le=65535)
    """Temporal server's Prometheus metrics port."""
    temporal_namespace: str = "default"
    """Namespace the workers and runs use."""
    temporal_extra_namespaces: list[str] = Field(default_factory=list)
    """More namespaces the dev server creates (with the search attributes): isolated task queues,
    e.g. for a team's experiments or for the workflow tests' fake activities."""
    temporal_sqlite_pragmas: list[Annotated[str, StringConstraints(pattern=r"^[a-z_]+=[A-Za-z0-9_]+$")]] = Field(
        default_factory=lambda: ["journal_mode=wal", "synchronous=normal"])
    """SQLite pragmas of the dev server's database. WAL without an fsync per commit survives a killed
    server (only a machine crash can lose the last commits) and doubles the dev server's rate of
    workflows (BENCHMARKS.md, orchestration); `[]` keeps SQLite's defaults."""
    ui_codec_endpoint: str | None = None
    """A codec server (`rlpipe codec`) the Web UI asks to decode encrypted payloads (RLPIPE_PAYLOAD_KEY)."""

    postgres_port: int = Field(15432, ge=1, le=65535)
    """Embedded PostgreSQL port."""
    postgres_db: str = "rlpipe"

    s3_port: int = Field(18333, ge=1, le=65535)
    """SeaweedFS S3 gateway port (its master, volume and filer use the next ports, see `seaweed.py`)."""
    seaweed_base_port: int = Field(19330, ge=1, le=65000)
    """First of the 8 consecutive internal SeaweedFS ports (master, volume, filer and their gRPC)."""
    bucket: str = "rlpipe"

    inference_servers: int = Field(0, ge=0, le=16)
    """Local vLLM servers the stack starts (0 = none; `rlpipe stack up --inference N`)."""
    inference_base_port: int = Field(18100, ge=1, le=65000)
    """Port of the first local vLLM server; server i listens on base + i."""
    inference_model: Path | None = None
    """Model directory the local vLLM servers load at start."""
    inference_max_model_len: int | None = Field(None, ge=64)
    """Context length of the local vLLM servers; None takes the model's own (max_position_embeddings).
    A run's model.max_model_len must fit in it."""

    metrics_base_port: int = Field(9100, ge=0, le=65000)
    """Workers serve Prometheus metrics at fixed offsets from this port (observe/metrics.py,
    infra/prometheus.yml); 0 lets each worker pick a free port (tests)."""

    weight_stream_host: str | None = None
    """Address the trainer serves its published weights on, to the servers' weight-transfer engines
    (weights/stream.py; the sync's hot path); None: `host`. Servers on other hosts must reach it."""
    weight_stream_port: int = Field(0, ge=0, le=65535)
    """Port of the trainer's weight stream; 0 picks a free one (each version records the endpoint)."""

    external_temporal: str | None = None
    external_database_url: str | None = None
    external_s3_endpoint: str | None = None
    external_inference_urls: list[str] = Field(default_factory=list)
    """INFERENCE_URLS: `URL` (named by its position, "0", "1", ...) or `NAME=URL` entries."""

    @field_validator("external_inference_urls")
    @classmethod
    def _named_servers(cls, entries: list[str]) -> list[str]:
        named_urls(entries)  # raises, naming the bad entry
        return entries

    @property
    def temporal_address(self) -> str:
        return self.external_temporal or f"{self.host}:{self.temporal_port}"

    @property
    def temporal_ui_url(self) -> str | None:
        return None if self.external_temporal else f"http://{self.host}:{self.temporal_ui_port}"

    @property
    def s3_endpoint(self) -> str | None:
        """None means AWS's own endpoint (S3_ENDPOINT_URL set to the empty string)."""
        if self.external_s3_endpoint is not None:
            return self.external_s3_endpoint or None
        return f"http://{self.host}:{self.s3_port}"

    def inference_urls(self) -> list[str]:
        if self.external_inference_urls:
            return list(self.external_inference_urls)
        return [f"http://{self.host}:{self.inference_base_port + i}" for i in range(self.inference_servers)]

    def inference_servers_by_name(self) -> dict[str, str]:
        """Inference server name -> URL."""
        return named_urls(self.inference_urls())

    def service_dir(self, name: str) -> Path:
        return (self.home / name).resolve()


def named_urls(entries: list[str]) -> dict[str, str]:
    """Server name -> URL from INFERENCE_URLS entries: `NAME=URL`, or a bare `URL` named by its
    position ("0", "1", ...), so that existing positional setups keep their names."""
    servers: dict[str, str] = {}
    for position, entry in enumerate(entries):
        name, sep, url = entry.partition("=")
        if not sep or "://" in name:  # a bare URL (whose query string may hold '=')
            name, url = str(position), entry
        if not SERVER_NAME.fullmatch(name):
            raise ValueError(f"inference server name {name!r} in {entry!r}: use letters, digits, '.', '_' or '-'")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"inference server {name!r}: {url!r} is not an http(s) URL")
        if name in servers:
            raise ValueError(f"inference server name {name!r} is given twice")
        servers[name] = url.rstrip("/")
    return servers


class SettingsError(ValueError):
    """The stack settings file or environment holds a bad value; the message names it."""


_ENV_FIELDS = {
    "RLPIPE_HOME": "home",
    "DATABASE_URL": "external_database_url",
    "S3_ENDPOINT_URL": "external_s3_endpoint",
    "RLPIPE_BUCKET": "bucket",
    "RLPIPE_WEIGHT_STREAM_HOST": "weight_stream_host",
    "RLPIPE_WEIGHT_STREAM_PORT": "weight_stream_port",
}


SAVED_SETTINGS = "settings.json"
"""Written by `rlpipe stack up` into the state directory: what the running stack was started with
(e.g. `--inference 2`), so that workers and later commands find the same servers."""


def save_settings(settings: StackSettings) -> None:
    home = settings.home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    (home / SAVED_SETTINGS).write_text(settings.model_dump_json(indent=2, exclude_unset=True))


def _temporal_profile_values(env: dict[str, str]) -> dict[str, object]:
    """TEMPORAL_ADDRESS and TEMPORAL_NAMESPACE, or a Temporal config-file profile's address and namespace."""
    # imported here: temporal_client loads temporalio's native bridge, which most settings readers never need
    from rlpipe.infra.temporal_client import TemporalSettingsError, load_profile

    try:
        profile = load_profile(env)
    except TemporalSettingsError as exc:
        raise SettingsError(str(exc)) from exc
    values: dict[str, object] = {}
    if profile.address:
        values["external_temporal"] = profile.address
    if profile.namespace:
        values["temporal_namespace"] = profile.namespace
    return values


def load_settings(config_file: Path | None = None, env: dict[str, str] | None = None) -> StackSettings:
    """Settings saved by the running stack, then the TOML file's `[stack]` table, then the
    environment on top."""
    env = dict(os.environ if env is None else env)
    path = config_file or Path(env.get("RLPIPE_CONFIG", "rlpipe.toml"))
    values: dict[str, object] = {}
    saved = Path(env.get("RLPIPE_HOME", ".rlpipe")) / SAVED_SETTINGS
    if saved.exists():
        values.update(StackSettings.model_validate_json(saved.read_text()).model_dump(
            exclude={"external_temporal", "external_database_url", "external_s3_endpoint",
                     "external_inference_urls"}))
    if path.exists():
        try:
            values.update(tomllib.loads(path.read_text()).get("stack", {}))
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"{path}: not valid TOML: {exc}") from exc
    for var, field in _ENV_FIELDS.items():
        if var in env:
            values[field] = env[var]
    values.update(_temporal_profile_values(env))
    if env.get("INFERENCE_URLS"):
        values["external_inference_urls"] = [u.strip() for u in env["INFERENCE_URLS"].split(",") if u.strip()]
    try:
        return StackSettings.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise SettingsError(f"stack setting '{field}' ({path} or environment): {first['msg']}") from exc
