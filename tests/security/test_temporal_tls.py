"""Temporal over TLS and mTLS, configured the way Temporal's own tools are (TEMPORAL_* variables,
infra/temporal_client.py), against the session's dev server behind a TLS-terminating proxy the test
starts with certificates it makes; and `rlpipe temporal prepare` over that connection."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from google.protobuf.duration_pb2 import Duration
from temporalio.api.workflowservice.v1 import RegisterNamespaceRequest
from temporalio.client import Client

from rlpipe.infra.settings import load_settings
from rlpipe.infra.stack import Stack
from rlpipe.infra.temporal import SEARCH_ATTRIBUTES
from rlpipe.infra.temporal_client import TemporalUnreachable, connect_temporal, temporal_connection
from rlpipe.infra.temporal_cluster import TOO_NEW, prepare_cluster
from tests.security.tls_proxy import Authority, Issued, server_context, tls_proxy

pytestmark = pytest.mark.stack


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server: Issued
    client: Issued
    stranger: Issued
    """A client certificate from another CA: well-formed, but not one the server trusts."""


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    directory = tmp_path_factory.mktemp("tls")
    ours, theirs = Authority(directory, "rlpipe-test"), Authority(directory, "stranger")
    return Certificates(ours.cert, ours.issue("temporal-proxy", server=True), ours.issue("worker", server=False),
                        theirs.issue("worker", server=False))


@pytest.fixture
async def tls_address(temporal_server: Stack, certificates: Certificates) -> AsyncIterator[str]:
    """The dev server over TLS; clients need not show a certificate."""
    async with tls_proxy(temporal_server.settings.temporal_address, server_context(certificates.server, None)) as a:
        yield a


@pytest.fixture
async def mtls_address(temporal_server: Stack, certificates: Certificates) -> AsyncIterator[str]:
    """The dev server over mTLS: only clients with a certificate from the test's CA get in."""
    async with tls_proxy(temporal_server.settings.temporal_address,
                         server_context(certificates.server, certificates.ca)) as address:
        yield address


async def connect_with(env: dict[str, str], tmp_path: Path) -> Client:
    """Connect as a worker would: the stack settings and the connection both from `env`."""
    settings = load_settings(config_file=tmp_path / "absent.toml", env={"RLPIPE_HOME": str(tmp_path), **env})
    assert settings.external_temporal == env["TEMPORAL_ADDRESS"]  # an external cluster: no dev server of ours
    conn = temporal_connection(settings.temporal_address, settings.temporal_namespace,
                               external=settings.external_temporal is not None, env=env)
    return await connect_temporal(conn)


def tls_env(address: str, certificates: Certificates, client: Issued | None = None,
            namespace: str = "default") -> dict[str, str]:
    env = {"TEMPORAL_ADDRESS": address, "TEMPORAL_NAMESPACE": namespace,
           "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(certificates.ca)}
    if client is not None:
        env |= {"TEMPORAL_TLS_CLIENT_CERT_PATH": str(client.cert), "TEMPORAL_TLS_CLIENT_KEY_PATH": str(client.key)}
    return env


async def test_tls_connection_prepares_a_namespace_idempotently(tls_address: str, certificates: Certificates,
                                                                tmp_path: Path) -> None:
    namespace = f"rlpipe-tls-{uuid.uuid4().hex[:8]}"
    client = await connect_with(tls_env(tls_address, certificates, namespace=namespace), tmp_path)
    missing = await prepare_cluster(client, namespace)
    assert [(f.ok, f.item) for f in missing] == [(False, f"namespace {namespace}")]
    assert "does not exist" in missing[0].detail and "temporal operator namespace create" in missing[0].detail

    retention = Duration(seconds=int(timedelta(days=1).total_seconds()))
    await client.workflow_service.register_namespace(
        RegisterNamespaceRequest(namespace=namespace, workflow_execution_retention_period=retention))
    first = await prepare_cluster(client, namespace)
    for _ in range(60):  # the dev server's services learn of a new namespace within seconds
        if TOO_NEW not in first:
            break
        await asyncio.sleep(1.0)
        first = await prepare_cluster(client, namespace)
    assert all(f.ok for f in first), first
    assert {f.item: f.detail for f in first[1:]} == {
        f"search attribute {name}": f"registered now ({kind})" for name, kind in SEARCH_ATTRIBUTES.items()}

    # the command, run again over the same TLS settings: everything is already there, nothing changes
    env = {**tls_env(tls_address, certificates, namespace=namespace), "RLPIPE_HOME": str(tmp_path), "COLUMNS": "300"}
    command = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rlpipe.cli.main", "--config", str(tmp_path / "absent.toml"), "temporal", "prepare",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output = (await command.stdout.read()).decode() if command.stdout else ""
    assert await command.wait() == 0, output
    assert output.count("already registered") == len(SEARCH_ATTRIBUTES) and "registered now" not in output, output


async def test_mtls_admits_only_a_client_with_a_certificate_the_server_trusts(
        mtls_address: str, certificates: Certificates, tmp_path: Path) -> None:
    client = await connect_with(tls_env(mtls_address, certificates, certificates.client), tmp_path)
    assert await client.service_client.check_health()

    with pytest.raises(TemporalUnreachable) as without:
        await connect_with(tls_env(mtls_address, certificates), tmp_path)
    message = str(without.value)
    assert f"cannot reach Temporal at {mtls_address}" in message and "TLS without a client certificate" in message
    assert "requires client certificates (mTLS)" in message and "TEMPORAL_TLS_CLIENT_CERT_PATH" in message

    with pytest.raises(TemporalUnreachable) as stranger:
        await connect_with(tls_env(mtls_address, certificates, certificates.stranger), tmp_path)
    assert "mTLS with a client certificate" in str(stranger.value)
    assert "does not trust this client certificate" in str(stranger.value)


async def test_a_client_that_does_not_trust_the_server_is_refused(tls_address: str, certificates: Certificates,
                                                                  tmp_path: Path) -> None:
    env = {"TEMPORAL_ADDRESS": tls_address, "TEMPORAL_TLS": "true"}  # the system's roots: not our test CA
    with pytest.raises(TemporalUnreachable) as refused:
        await connect_with(env, tmp_path)
    assert f"cannot reach Temporal at {tls_address}" in str(refused.value)
    assert "set TEMPORAL_TLS_SERVER_CA_CERT_PATH" in str(refused.value)
