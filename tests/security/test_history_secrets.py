"""No secret reaches Temporal, and the stack listens on loopback only.

Workers read the Postgres password, the S3 keys and the inference admin token from their own
environment (infra/endpoints.py); a run's workflows carry ids, versions and small summaries. The
scan below reads every byte Temporal stores for a real run (the training run's executions and its
rollout groups: inputs, results, failures, memo, search attributes) and looks for each secret. A
planted secret proves the scan can see one. Payload encryption has its own tests (test_payload_encryption.py).
"""

from __future__ import annotations

import ipaddress
import uuid
from pathlib import Path

import psutil
import pytest
from sqlalchemy.engine import make_url
from temporalio.client import Client

from rlpipe.infra.endpoints import Endpoints
from rlpipe.infra.settings import LOOPBACK, StackSettings
from rlpipe.infra.stack import Stack
from rlpipe.storage.db import Database
from tests.integration.runs import rows, run_to_end, tiny_config

pytestmark = [pytest.mark.stack]


def stack_secrets(endpoints: Endpoints) -> dict[str, str]:
    url = make_url(endpoints.database_url)
    found = {"postgres password": url.password, "database url": endpoints.database_url,
             "database url (plain driver)": url.set(drivername="postgresql").render_as_string(hide_password=False),
             "s3 access key": endpoints.s3_access_key, "s3 secret key": endpoints.s3_secret_key,
             "inference admin token": endpoints.inference_token}
    assert all(found.values()), "the local stack has every secret set; an empty one would match anything"
    return {name: value for name, value in found.items() if value}


async def history_bytes(client: Client, workflow_id: str, run_id: str | None = None) -> bytes:
    """Everything Temporal stores for one workflow execution, as serialized events."""
    history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
    return b"".join(event.SerializeToString() for event in history.events)


def leaks(stored: bytes, secrets: dict[str, str]) -> list[str]:
    return [name for name, value in secrets.items() if value.encode() in stored]


async def test_no_secret_in_the_histories_of_a_run(
        temporal_client: Client, pipeline_workers, migrated_db: Database, tiny_model: Path,
        endpoints: Endpoints) -> None:
    # control: a workflow whose input holds a secret is caught by the same scan
    secrets = stack_secrets(endpoints)
    planted = await temporal_client.start_workflow(
        "NoSuchWorkflow", {"dsn": endpoints.database_url}, id=f"planted-{uuid.uuid4()}",
        task_queue=f"nobody-{uuid.uuid4()}")
    try:
        assert "postgres password" in leaks(await history_bytes(temporal_client, planted.id), secrets)
    finally:
        await planted.terminate("test done")

    cfg = tiny_config(tiny_model, steps=1)
    await run_to_end(temporal_client, cfg)
    executions = [(wf.id, wf.run_id) async for wf in temporal_client.list_workflows(
        f"WorkflowId = '{cfg.workflow_id}'")]
    groups = [(g.workflow_id, None) for g in rows(migrated_db, "select workflow_id from rollout_groups "
                                                               "where run_id = :r", r=cfg.name)]
    assert executions and groups
    for workflow_id, run_id in executions + groups:
        stored = await history_bytes(temporal_client, workflow_id, run_id)
        assert cfg.name.encode() in stored, "the scan reads the payloads (they are not encrypted here)"
        assert leaks(stored, secrets) == [], f"{workflow_id} stores a secret"


def test_stack_settings_default_to_loopback() -> None:
    settings = StackSettings(inference_servers=2)
    assert settings.host == LOOPBACK == "127.0.0.1"
    addresses = [settings.temporal_address, settings.temporal_ui_url, settings.s3_endpoint,
                 *settings.inference_urls()]
    assert all(address and "//127.0.0.1:" in f"//{address.split('//')[-1]}" for address in addresses), addresses


def test_every_stack_and_worker_process_listens_on_loopback_only(stack: Stack, pipeline_workers) -> None:  # type: ignore[no-untyped-def]
    records = [*stack.table.load().values(), *pipeline_workers.table.load().values()]
    listening: dict[str, set[str]] = {}
    for record in records:
        process = record.process()
        assert process is not None, f"{record.name} is not running"
        for proc in [process, *process.children(recursive=True)]:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    listening.setdefault(record.name, set()).add(conn.laddr.ip)
    assert {"temporal", "postgres", "seaweedfs"} <= set(listening), listening
    exposed = {name: ips for name, ips in listening.items()
               if not all(ipaddress.ip_address(ip).is_loopback for ip in ips)}
    assert exposed == {}, f"listening beyond loopback: {exposed}"
