"""What every worker process does first: read addresses, connect to Temporal and the database.

Addresses come from the environment (TEMPORAL_ADDRESS, DATABASE_URL, S3_ENDPOINT_URL,
INFERENCE_URLS), else from the local stack's state directory (`infra.endpoints`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter
from temporalio.runtime import Runtime
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

# The built-in environments and graders, loaded in every worker: a config's env.name and grader.name are
# checked against the registries loaded in the process (rlpipe.registry), wherever a config is decoded.
import rlpipe.envs.registry  # noqa: F401
import rlpipe.graders.registry  # noqa: F401
from rlpipe.infra.endpoints import Endpoints, resolve_endpoints
from rlpipe.infra.process import free_port
from rlpipe.infra.settings import load_settings, named_urls
from rlpipe.infra.temporal_client import TemporalUnreachable, connect_temporal, temporal_connection
from rlpipe.security.codec import EncryptionCodec

# Modules that workflow code imports (through `imports_passed_through`) and that must be shared
# with the worker rather than re-imported in every workflow sandbox.
WORKFLOW_PASSTHROUGH = ("rlpipe.schemas", "rlpipe.envs", "rlpipe.graders", "rlpipe.sandbox",
                        "rlpipe.workflows.policies", "rlpipe.workflows.admission")


def endpoints() -> Endpoints:
    return resolve_endpoints(load_settings())


def data_converter() -> DataConverter:
    """Payloads may be pydantic models (RunConfig) or dataclasses; with RLPIPE_PAYLOAD_KEY set they
    are encrypted before they reach Temporal (security/codec.py)."""
    codec = EncryptionCodec.from_environment()
    return dataclasses.replace(pydantic_data_converter, payload_codec=codec) if codec else pydantic_data_converter


WORKER_CONNECT_WAIT_S = 300.0
"""How long a worker starting while Temporal is down (restarting) keeps trying to connect; once
connected, the SDK reconnects by itself. Without it a worker started during an outage exits at
once and its queue has no poller until someone restarts it (a chaos run found the grader so)."""


async def connect(ep: Endpoints, runtime: Runtime | None = None, wait_s: float = 0.0) -> Client:
    """A client of the run's Temporal; `wait_s` > 0 retries a refused first connection that long."""
    conn = temporal_connection(ep.temporal_address, ep.temporal_namespace, external=ep.temporal_external)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await connect_temporal(conn, data_converter=data_converter(), runtime=runtime)
        except TemporalUnreachable as exc:
            if time.monotonic() >= deadline:
                raise
            logging.getLogger("rlpipe").warning("%s; retrying", exc)
            await asyncio.sleep(2.0)


def start_metrics(name: str, kind: str, boxes: tuple[str, ...], server: str | None = None) -> Runtime:
    """Serve this worker's Prometheus metrics and build the Temporal runtime that serves the SDK's.
    The bound ports are written to `<home>/workers/<name>.metrics` for scrapers and tests."""
    from rlpipe.observe.metrics import METRICS, metrics_port, sdk_metrics_port, serve_metrics, temporal_runtime

    settings = load_settings()
    METRICS.tracker.declare(*boxes)
    base = settings.metrics_base_port
    # a sidecar's fixed port is by its server's position; a server named otherwise takes a free port
    fixed = base and (server is None or server.isdigit())
    wanted = metrics_port(kind, int(server) if server is not None else None, base) if fixed else 0
    port = serve_metrics(wanted, addr=settings.host)
    sdk_port = sdk_metrics_port(port) if base else free_port(settings.host)
    ports_file = settings.home.resolve() / "workers" / f"{name}.metrics"
    ports_file.parent.mkdir(parents=True, exist_ok=True)
    ports_file.write_text(f"{port} {sdk_port}\n")
    return temporal_runtime(sdk_port, addr=settings.host, service=f"rlpipe-{name}")


def workflow_runner() -> SandboxedWorkflowRunner:
    return SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_modules(
        *WORKFLOW_PASSTHROUGH))


def server_urls(ep: Endpoints) -> dict[str, str]:
    """Inference server name -> URL, as configured (INFERENCE_URLS `NAME=URL` entries; a bare URL
    and the local stack's servers are named by position: "0", "1", ...)."""
    return named_urls(ep.inference_urls)


def setup_logging(name: str) -> logging.Logger:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return logging.getLogger(f"rlpipe.{name}")
